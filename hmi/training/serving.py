"""How a fine-tuned encoder tenant is served: on the windows (the hPLM: its domain's PLOT and the
adapter in the upper layers) or whole (its distilled fine-tune's teacher: the full root with the
adapter in every layer, ``AdapterSpec.whole``), chosen by the request or on the dev split."""

from __future__ import annotations

SERVING_MODES = ("windows", "whole", "auto")
# ``auto`` serves a tenant whole when its teacher beats the windows on dev by more than this
# (accuracy).  On the default root (3+3, 640 training texts, seeds 0 and 1) the teacher's lead on dev
# was 0.054 on review-sentiment both times, 0.016 and 0.021 on pos-tagging, none on news-topic and
# tweet-sentiment (hBERT-adapter against hBERT, learned back-off, distilled:
# docs/results/cells/eval_accuracy-a2216e4c7e3c93d7.jsonl).
WHOLE_MARGIN = 0.03
AUTO_RULE = f"whole where the teacher beats the windows on the dev split by more than {100 * WHOLE_MARGIN:g} points"


def choose_serving(asked: str, distilled: bool, teacher_dev: float | None, windows_dev: float | None) -> dict:
    """How a fine-tuned tenant is served: ``windows`` (the PLOT and its adapter in the upper
    layers: the hPLM), ``whole`` (its teacher, the full root with the adapter in every layer), or
    for ``auto`` the teacher when its dev accuracy beats the windows' by more than WHOLE_MARGIN
    (where the tri-gram windows lose what the task needs).  ``{"mode", "asked", "teacher_dev",
    "windows_dev"}``; ``whole`` and ``auto`` need the teacher (a distilled fine-tune), and ``auto``
    a dev split."""
    if asked not in SERVING_MODES:
        raise ValueError(f"unknown serving {asked!r}; use one of {', '.join(SERVING_MODES)}")
    if asked == "whole" and not distilled:
        raise ValueError("serving whole serves the teacher: the fine-tune must be distilled")
    mode = asked
    if asked == "auto":
        gain = None if teacher_dev is None or windows_dev is None else teacher_dev - windows_dev
        mode = "whole" if gain is not None and gain > WHOLE_MARGIN else "windows"
    return {"mode": mode, "asked": asked, "teacher_dev": teacher_dev, "windows_dev": windows_dev}
