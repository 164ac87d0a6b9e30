"""A tenant's training examples: rows tokenized as inference reads them (``encode``), padded
(``pad``), and the metrics a fine-tune reports on them (``score_batches``, ``metrics_of``);
shared by the hosted fine-tune, its distillation and the full-context training beside it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.model.hplm import as_numpy_ids
from hmi.textlimit import TooLongError, fit_ids

IGNORE = -100


@dataclass
class Example:
    ids: list[int]
    target: int | list[int]  # label index, or per-token label indices (IGNORE off first sub-tokens)


def encode(tokenizer, rows: list[dict], spec: AdapterSpec, max_len: int, truncate: bool = True) -> list[Example]:
    """Tokenizes rows ``{"text", "label"}`` (classification) or ``{"tokens", "tags"}`` (tagging),
    each within ``max_len`` tokens as inference reads it (:func:`hmi.textlimit.fit_ids`): cut when
    ``truncate``, else a row over the limit raises :class:`TooLongError` naming it."""
    index = {label: i for i, label in enumerate(spec.labels)}
    out = []
    if not rows:
        return out
    if spec.head == "classification":
        missing = sorted({r["label"] for r in rows} - set(index))
        if missing:
            raise SpecError(f"training labels {missing[:5]} are not in the tenant's label set")
        enc = tokenizer([r["text"] for r in rows], truncation=False)
        return [Example(_fit(ids, max_len, truncate, i)[0], index[r["label"]])
                for i, (ids, r) in enumerate(zip(enc["input_ids"], rows))]
    missing = sorted({t for r in rows for t in r["tags"]} - set(index))
    if missing:
        raise SpecError(f"training tags {missing[:5]} are not in the tenant's label set")
    for i, r in enumerate(rows):
        enc = tokenizer(r["tokens"], is_split_into_words=True, truncation=False)
        targets, prev = [], None
        for w in enc.word_ids():
            targets.append(IGNORE if w is None or w == prev else index[r["tags"][w]])
            prev = w
        ids, _ = _fit(enc["input_ids"], max_len, truncate, i)
        out.append(Example(ids, fit_ids(targets, max_len, True)[0]))
    return out


def _fit(ids: list[int], max_len: int, truncate: bool, row: int) -> tuple[list[int], bool]:
    try:
        return fit_ids(ids, max_len, truncate)
    except TooLongError as exc:
        raise TooLongError(exc.n_tokens, exc.limit, row) from None


def pad(examples: list[Example]) -> tuple[np.ndarray, np.ndarray]:
    return as_numpy_ids([e.ids for e in examples])


def score_batches(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], tagging: bool, n_labels: int) -> dict:
    """``metrics_of`` over batches of (logits, gold): logits [B, C] with gold [B] (classification),
    or logits [B, T, C] with gold [B, T] whose IGNORE positions are not scored (tagging)."""
    preds, gold = [], []
    for logits, y in batches:
        keep = y != IGNORE if tagging else torch.ones_like(y, dtype=torch.bool)
        preds.append(logits.argmax(-1)[keep].numpy())
        gold.append(y[keep].numpy())
    return metrics_of(np.concatenate(preds), np.concatenate(gold), n_labels)


def metrics_of(preds: np.ndarray, gold: np.ndarray, n_labels: int) -> dict:
    """Accuracy (= micro F1 for single-label tagging) and macro F1 over the labels that occur."""
    acc = float((preds == gold).mean()) if len(gold) else 0.0
    f1s = []
    for c in range(n_labels):
        tp = int(((preds == c) & (gold == c)).sum())
        fp = int(((preds == c) & (gold != c)).sum())
        fn = int(((preds != c) & (gold == c)).sum())
        if tp + fn == 0:
            continue
        f1s.append(2 * tp / max(1, 2 * tp + fp + fn))
    return {"accuracy": round(acc, 4), "macro_f1": round(float(np.mean(f1s)) if f1s else 0.0, 4), "n": int(len(gold))}
