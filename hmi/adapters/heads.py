"""What a tenant's head answers: labels and scores of a classification head, one tag per word of a
tagging head (read at the word's first sub-token), decoded from the head's logits."""

from __future__ import annotations

import numpy as np
import torch

from hmi.adapters.spec import AdapterSpec


def word_starts(enc, i: int, text: str) -> list[tuple[int, str]]:
    """(position, word) of the first sub-token of each word of text ``i`` of a fast tokenizer's
    batch encoding ``enc`` (with ``return_offsets_mapping``), from its word ids."""
    out, prev = [], None
    offsets = enc["offset_mapping"][i]
    words = enc.word_ids(i)
    for pos, w in enumerate(words):
        if w is None or w == prev:
            prev = w if w is not None else prev
            continue
        prev = w
        start = offsets[pos][0]
        end = start
        for q in range(pos, len(words)):
            if words[q] != w:
                break
            end = offsets[q][1]
        out.append((pos, text[start:end]))
    return out


def decode(spec: AdapterSpec, logits: torch.Tensor, starts: list[tuple[int, str]]) -> dict:
    """The answer of one request from its head's logits (T, max_labels) (the pool's head is as
    wide as the widest; columns past the tenant's labels are ignored).

    classification: ``{"label", "scores": {label: probability}}`` from position 0;
    tagging: ``{"tokens": [{"token": word, "tag": label}]}`` at each word's first sub-token."""
    labels = spec.labels
    c = len(labels)
    if spec.head == "classification":
        probs = torch.softmax(logits[0, :c], -1).tolist()
        best = int(np.argmax(probs))
        return {"label": labels[best], "scores": {lab: round(float(p), 6) for lab, p in zip(labels, probs)}}
    tags = logits[:, :c].argmax(-1).tolist()
    return {"tokens": [{"token": w, "tag": labels[tags[pos]]} for pos, w in starts]}
