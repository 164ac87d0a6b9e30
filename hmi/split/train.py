"""A private tenant's fine-tune on its own side: the adapter and head trained with AdamW here,
every frozen projection's forward and backward on the server's base executor (training priority).
The data, loss, schedule and early stopping are the hosted fine-tune's (``hmi.training.finetune``);
what differs: no dropout on the upper layers' output (the hosted trainer's 0.1), and the adapter
runs through ``hmi.model.encoder_layers`` rather than the ``adapters`` library's model."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from hmi.training.finetune import IGNORE, FinetuneConfig, collate, encode, featurize, metrics_of
from hmi.training.fit import Fit, early_stopping


class RemoteLookup:
    """The server's PLOT lookup as ``featurize`` reads a lookup (``merged(ids, mask)``)."""

    def __init__(self, base):
        self.base = base

    def merged(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        return self.base.lower(torch.from_numpy(ids), torch.from_numpy(mask))


def _logits(model, x, mask, grad: bool) -> torch.Tensor:
    """The head's logits as the loss reads them: (B, C) for classification, (B, T, C) for tagging."""
    out = model.forward(x, mask, grad=grad)[..., :model.spec.num_labels]
    return out if model.spec.head == "tagging" else out[:, 0]


@torch.no_grad()
def evaluate(model, examples, feats, batch: int = 64) -> dict:
    if not examples:
        return {"accuracy": 0.0, "macro_f1": 0.0, "n": 0}
    tagging, preds, gold = model.spec.head == "tagging", [], []
    for s in range(0, len(examples), batch):
        x, mask, y = collate(examples, feats, list(range(s, min(len(examples), s + batch))), tagging)
        p = _logits(model, x, mask, grad=False).argmax(-1)
        keep = y != IGNORE if tagging else torch.ones_like(y, dtype=torch.bool)
        preds.append(p[keep].numpy())
        gold.append(y[keep].numpy())
    return metrics_of(np.concatenate(preds), np.concatenate(gold), model.spec.num_labels)


def finetune_private(model, train: list[dict], dev: list[dict], cfg: FinetuneConfig | None = None,
                     progress: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Trains a ``PrivateModel``'s adapter and head (starting from its current weights) on
    ``train``, early-stopping on ``dev``; returns (canonical weights of the best epoch, metrics).
    The model keeps the best weights."""
    cfg = cfg or FinetuneConfig()
    torch.manual_seed(cfg.seed)
    t0, tagging = time.time(), model.spec.head == "tagging"
    ex = {name: encode(model.tokenizer, rows, model.spec, cfg.max_len, cfg.truncate) for name, rows in
          (("train", train[:cfg.max_train] if cfg.max_train else train), ("dev", dev))}
    feats = {name: featurize(RemoteLookup(model.base), e) for name, e in ex.items()}
    rng = np.random.default_rng(cfg.seed)
    steps = (len(ex["train"]) + cfg.batch_size - 1) // cfg.batch_size
    params = model.parameters()
    with Fit(params, steps * cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay, desc="private fine-tune",
             progress=progress) as fit:

        def run_epoch(epoch: int) -> dict:
            order = rng.permutation(len(ex["train"]))
            for s in range(0, len(order), cfg.batch_size):
                x, mask, y = collate(ex["train"], feats["train"], order[s:s + cfg.batch_size].tolist(), tagging)
                logits = _logits(model, x, mask, grad=True)
                loss = F.cross_entropy(logits.reshape(-1, model.spec.num_labels), y.reshape(-1), ignore_index=IGNORE)
                fit.step(loss, {"epoch": epoch + 1}, epoch=epoch + 1)
            dev_m = evaluate(model, ex["dev"], feats["dev"]) if ex["dev"] else None
            return {"epoch": epoch + 1, "loss": round(fit.last_loss, 4), "dev": dev_m}

        _, best, history = early_stopping(cfg.epochs, cfg.patience, run_epoch,
                                          lambda r: r["dev"]["accuracy"] if r["dev"] else -r["loss"],
                                          lambda: copy.deepcopy(model.weights()))
    model.load(best)
    return best, {"dev": evaluate(model, ex["dev"], feats["dev"]), "history": history, "epochs_run": len(history),
                  "seconds": round(time.time() - t0, 1), "round_trips": model.base.stats["round_trips"]}
