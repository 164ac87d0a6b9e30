"""The time of one calibration step: before and after the changes that made it cheaper, side by side.

Usage: python benchmarks/bench_calibration_step.py [--quick] [--root mpnet-base] [--steps N]

A step as ``hmi calibrate`` runs it (``hmi.training.calibrate.calibration_loss`` on length-grouped
batches of 32 lines of the general corpus, read as the other half's PLOT serves them, then the
optimizer step, inside ``hmi.training.fit.deterministic()`` as the recipe runs it), on the root's
uncalibrated windowed layers; the variants take turns on the same batches (``round_robin``: each
round one batch, every variant on it), so a drift of the machine hits them alike.  A step's time
grows with its batch's tokens (the corpus's lines are 7 to 128 tokens, batches of similar lengths
hold 300 to 4,100), so a variant's figure is its mean over the rounds' batches, as a whole run
averages them, not the median (which the few long batches leave out):

- **before**: fp32, with torch's deterministic mode filling every new tensor with NaN (its
  default, ``torch.utils.deterministic.fill_uninitialized_memory``);
- **fp32**: deterministic without that fill (``deterministic()`` today: the same bits);
- **bf16**: and the GEMMs inside ``hmi.model.kernels.bf16_matmuls()`` (``hmi calibrate --bf16``),
  where the CPU has native bf16; elsewhere the row says it ran fp32;
- **served once**: and each distinct window the back-off serves computed once
  (``CalibrationConfig.served_once``);
- **present tokens**: the windows run on their present tokens alone
  (``CalibrationConfig.present_tokens``); both with bf16: mpnet-base's recipe.

Also timed: the teacher's forward alone (the full-context root, no gradient), the part of a step
that does not depend on what is trained. Writes docs/bench_calibration_step[_<root>].md.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, result_name, root_flags, root_options, round_robin, start, table  # noqa: E402


def main() -> None:
    args = start(__doc__, lambda ap: (root_options(ap), ap.add_argument("--steps", type=int, default=None)))
    import torch

    from hmi.bootstrap import calibration_recipe
    from hmi.data import load_corpus
    from hmi.model.aliases import DEFAULT_ROOT
    from hmi.model.artifact import uncalibrated_root
    from hmi.model.catalog import root_spec
    from hmi.model.hplm import HPLM
    from hmi.model.kernels import NATIVE_BF16, bf16_matmuls
    from hmi.model.root import full_forward
    from hmi.training.calibrate import (
        CalibrationConfig,
        HeldOutBackoff,
        calibration_loss,
        distill_fit,
        length_grouped,
        token_lists,
        tokenize,
    )
    from hmi.training.fit import deterministic

    name = args.root or DEFAULT_ROOT
    rounds = args.steps or (3 if args.quick else 8)
    cfg = CalibrationConfig(**calibration_recipe(name))
    root = uncalibrated_root(root_spec(name, args.l_low, None))
    texts = load_corpus("general")  # the whole corpus, as the recipe reads it: its batches' lengths
    lists = token_lists(root.tokenizer, texts, cfg.max_len)
    held = HeldOutBackoff(lists)
    rng = np.random.default_rng(0)
    order = length_grouped(rng.permutation(np.arange(0, len(texts), 2)), [len(x) for x in lists], cfg.batch_size, rng)
    batches = [tokenize(root.tokenizer, [texts[i] for i in order[b * cfg.batch_size:(b + 1) * cfg.batch_size]],
                        cfg.max_len) for b in range(rounds + 1)]
    hplm = HPLM(root.bert, root.windowed)
    fit = distill_fit(root.windowed, cfg, "bench", progress=False)
    root.windowed.train()
    turn = {"i": 0}

    def batch():
        return batches[turn["i"]]

    def before_round(r: int) -> None:
        turn["i"] = r  # -1: the warm-up's batch, the last

    def step(bf16: bool, fill: bool = False, once: bool = False, present: bool = False):
        variant = replace(cfg, served_once=once, present_tokens=present)

        def run():
            ids, mask = batch()
            with deterministic(), bf16_matmuls(bf16):
                torch.utils.deterministic.fill_uninitialized_memory = fill  # deterministic() restores it
                loss, _ = calibration_loss(root, hplm, ids, mask, variant, held.serve(0))
                fit.step(loss)
        return run

    def teacher():
        ids, mask = batch()
        with torch.no_grad():
            full_forward(root.bert, ids, mask)

    secs = round_robin({"before": step(False, fill=True), "fp32": step(False), "bf16": step(True),
                        "once": step(True, once=True), "present": step(True, present=True),
                        "recipe": step(True, once=True, present=True),
                        "fp32_recipe": step(False, once=True, present=True), "teacher": teacher}, rounds,
                       before_round=before_round, stat=statistics.mean)
    tokens = sum(int(m.sum()) for _, m in batches[:rounds]) / rounds
    labels = {"before": "fp32, deterministic mode's NaN fill on (before)",
              "fp32": "fp32, the fill off (the same bits)",
              "bf16": f"bf16 GEMMs, the fill off{'' if NATIVE_BF16 else ' (no native bf16 here: ran fp32)'}",
              "once": "bf16, each served window computed once",
              "present": "bf16, the windows on their present tokens",
              "recipe": "bf16, both (mpnet-base's recipe)",
              "fp32_recipe": "fp32, both",
              "teacher": "teacher forward alone (fp32, no gradient)"}
    rows = [(labels[k], f"{secs[k]:.2f}", f"{secs[k] / secs['before']:.2f}", f"{tokens / secs[k]:.0f}") for k in labels]
    text = (f"Root {name} split at L_low={root.spec.l_low}; batches of {cfg.batch_size} lines, "
            f"{tokens:.0f} real tokens on average; mean of {rounds} rounds, one batch each, every variant on it.\n\n"
            + table(rows, ("step", "seconds", "of before", "tokens/s")))
    result = {"root": name, "l_low": root.spec.l_low, "native_bf16": NATIVE_BF16, "rounds": rounds,
              "tokens_per_batch": round(tokens), **{f"{k}_s": round(v, 3) for k, v in secs.items()},
              "fp32_over_before": round(secs["fp32"] / secs["before"], 3),
              "bf16_over_before": round(secs["bf16"] / secs["before"], 3),
              "recipe_over_before": round(secs["recipe"] / secs["before"], 3)}
    quick = " --quick" if args.quick else ""
    finish(result_name("bench_calibration_step", args), text, result,
           f"python benchmarks/bench_calibration_step.py{quick}{root_flags(args)}")


if __name__ == "__main__":
    main()
