"""Tenant fine-tune jobs: the ``adapters`` library trains an adapter and a head on the upper
layers, fed with the merged PLOT representations of the tenant's domain chain (exactly what
serving computes)."""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hmi.adapters.batched import pooled
from hmi.adapters.interop import attach, from_library, library_model, to_library
from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.model.hplm import UpperLayers, as_numpy_ids
from hmi.plot.lookup import PlotLookup
from hmi.textlimit import TooLongError, fit_ids
from hmi.training.fit import Fit, early_stopping

IGNORE = -100
NAME = "tenant"


@dataclass
class FinetuneConfig:
    epochs: int = 4
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_len: int = 128
    patience: int = 2
    seed: int = 0
    max_train: int | None = None
    truncate: bool = True  # texts over max_len are cut (else refused, naming the row), as inference reads them


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


def featurize(lookup: PlotLookup, examples: list[Example], batch: int = 64) -> list[torch.Tensor]:
    """The merged lower-layer output of each example (fp16, (T_i, H)), computed once: the lower
    side is frozen, so every epoch reuses it."""
    feats: list[torch.Tensor | None] = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        ids, mask = pad([examples[i] for i in idx])
        merged = lookup.merged(ids, mask)
        for j, i in enumerate(idx):
            feats[i] = merged[j, :len(examples[i].ids)].to(torch.float16)
    return feats


def collate(examples: list[Example], feats: list[torch.Tensor], idx: list[int], tagging: bool):
    T = max(len(examples[i].ids) for i in idx)
    H = feats[idx[0]].shape[-1]
    x = torch.zeros(len(idx), T, H)
    mask = torch.zeros(len(idx), T, dtype=torch.long)
    y = torch.full((len(idx), T), IGNORE, dtype=torch.long) if tagging else torch.zeros(len(idx), dtype=torch.long)
    for j, i in enumerate(idx):
        n = len(examples[i].ids)
        x[j, :n] = feats[i].float()
        mask[j, :n] = 1
        if tagging:
            y[j, :n] = torch.tensor(examples[i].target)
        else:
            y[j] = examples[i].target
    return x, mask, y


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


class TenantTrainer:
    """One tenant's adapter and head on a private library copy of the root's upper layers."""

    def __init__(self, root_bert, l_low: int, spec: AdapterSpec, init: dict[str, torch.Tensor] | None = None,
                 seed: int = 0, private_copy: bool = True):
        torch.manual_seed(seed)
        self.spec, self.l_low = spec, l_low
        # A worker process attaches the adapter to its own module objects, whose weights stay in
        # the server's shared memory (frozen, never written); elsewhere the root is copied first.
        self.model = library_model(root_bert) if private_copy else root_bert
        attach(self.model, NAME, spec, l_low, train=True)
        self.upper = UpperLayers(self.model, l_low)
        self.head = nn.Linear(root_bert.config.hidden_size, spec.num_labels)
        self.dropout = nn.Dropout(0.1)
        if init is not None:
            self.load(init)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        to_library(self.model, NAME, self.spec, self.l_low, {k: v.float() for k, v in weights.items()})
        with torch.no_grad():
            self.head.weight.copy_(weights["head.w"].float().t())
            self.head.bias.copy_(weights["head.b"].float())

    def weights(self) -> dict[str, torch.Tensor]:
        w = from_library(self.model, NAME, self.spec, self.l_low)
        w["head.w"] = self.head.weight.detach().t().contiguous().clone()
        w["head.b"] = self.head.bias.detach().clone()
        return w

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad] + list(self.head.parameters())

    def logits(self, x, mask, train: bool):
        self.model.train(train)
        out = self.upper(x, mask)
        out = self.dropout(out) if train else out
        if self.spec.head == "tagging":
            return self.head(out)
        return self.head(pooled(out, mask, self.spec.pooling == "mean"))

    @torch.no_grad()
    def evaluate(self, examples, feats, batch: int = 64) -> dict:
        if not examples:
            return {"accuracy": 0.0, "macro_f1": 0.0, "n": 0}
        tagging = self.spec.head == "tagging"
        preds, gold = [], []
        for s in range(0, len(examples), batch):
            idx = list(range(s, min(len(examples), s + batch)))
            x, mask, y = collate(examples, feats, idx, tagging)
            p = self.logits(x, mask, train=False).argmax(-1)
            if tagging:
                keep = y != IGNORE
                preds.append(p[keep].numpy())
                gold.append(y[keep].numpy())
            else:
                preds.append(p.numpy())
                gold.append(y.numpy())
        return metrics_of(np.concatenate(preds), np.concatenate(gold), self.spec.num_labels)


def finetune(root_bert, l_low: int, lookup: PlotLookup, tokenizer, spec: AdapterSpec, train: list[dict],
             dev: list[dict], test: list[dict] | None = None, cfg: FinetuneConfig | None = None,
             init: dict[str, torch.Tensor] | None = None, progress: bool = True,
             on_progress: Callable[[float, dict], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             private_copy: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Trains (or, with ``init``, continues training) a tenant's adapter and head.

    AdamW, seeded, early stopping on the dev metric (accuracy; the best epoch's weights are
    kept).  Returns canonical weights and a metrics record.
    """
    cfg = cfg or FinetuneConfig()
    if not train:
        raise SpecError("no training examples")
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    t0 = time.time()
    train = train[:cfg.max_train] if cfg.max_train else train
    ex = {name: encode(tokenizer, rows or [], spec, cfg.max_len, cfg.truncate) for name, rows in
          (("train", train), ("dev", dev), ("test", test))}
    feats = {name: featurize(lookup, e) for name, e in ex.items()}
    trainer = TenantTrainer(root_bert, l_low, spec, init, cfg.seed, private_copy=private_copy)
    tagging = spec.head == "tagging"
    rng = np.random.default_rng(cfg.seed)
    steps_per_epoch = (len(ex["train"]) + cfg.batch_size - 1) // cfg.batch_size
    with Fit(trainer.parameters(), steps_per_epoch * cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay,
             desc="fine-tune", progress=progress, should_stop=should_stop, on_progress=on_progress,
             report_every=5) as fit:

        def run_epoch(epoch: int) -> dict:
            order = rng.permutation(len(ex["train"]))
            for s in range(0, len(order), cfg.batch_size):
                fit.check()
                x, mask, y = collate(ex["train"], feats["train"], order[s:s + cfg.batch_size].tolist(), tagging)
                logits = trainer.logits(x, mask, train=True)
                loss = F.cross_entropy(logits.reshape(-1, spec.num_labels), y.reshape(-1), ignore_index=IGNORE)
                fit.step(loss, {"epoch": epoch + 1}, epoch=epoch + 1)
            dev_m = trainer.evaluate(ex["dev"], feats["dev"]) if ex["dev"] else None
            return {"epoch": epoch + 1, "loss": round(fit.last_loss, 4), "dev": dev_m}

        # Without a dev set the score is the last batch's loss.
        _, best_state, history = early_stopping(
            cfg.epochs, cfg.patience, run_epoch, lambda r: r["dev"]["accuracy"] if r["dev"] else -r["loss"],
            lambda: copy.deepcopy(trainer.weights()))
    trainer.load(best_state)
    metrics = {"train": trainer.evaluate(ex["train"][:2000], feats["train"][:2000]),
               "dev": trainer.evaluate(ex["dev"], feats["dev"]),
               "test": trainer.evaluate(ex["test"], feats["test"]) if ex["test"] else None,
               "epochs_run": len(history), "history": history, "seconds": round(time.time() - t0, 1),
               "config": asdict(cfg), "lookup_hits": dict(lookup.hits)}
    if on_progress is not None:
        on_progress(1.0, {"done": True})
    return best_state, metrics
