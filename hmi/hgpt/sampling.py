"""Choosing a generation's next token, and the part of its text that can be streamed.

Both run per request (one row of a decoding step); the engine calls them for every active
request after each batched step.
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-3  # temperatures under this decode greedily: dividing logits by them overflows to inf/NaN


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token from one request's logits (V,).

    Greedy (argmax) when ``temperature < GREEDY_BELOW`` or no generator is given; otherwise a draw
    from softmax(logits / temperature) restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (the most likely token always stays in it), with ``generator``.
    """
    if generator is None or temperature < GREEDY_BELOW:
        return int(logits.argmax())
    p = torch.softmax(logits / temperature, -1)
    if top_p < 1:
        sp, si = torch.sort(p, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        keep[0] = True  # the most likely token always stays (a tiny top_p underflows in float32)
        p = torch.zeros_like(p).scatter(0, si[keep], sp[keep])
    return int(torch.multinomial(p / p.sum(), 1, generator=generator))


def streamable(text: str, emitted: int, stop: list[str], final: bool) -> int:
    """How much of the completion ``text`` may be sent so far (``>= emitted``, what was sent): until
    the end it holds back a tail that could still become a stop string, and an incomplete
    multi-byte character (the tokenizer's U+FFFD)."""
    hold = 0 if final else max((len(s) - 1 for s in stop), default=0)
    upto = max(emitted, len(text) - hold)
    if text.endswith("\ufffd") and not final:
        upto = min(upto, len(text) - 1)
    return max(upto, emitted)
