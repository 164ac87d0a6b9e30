"""Decoder tenant fine-tuning: the ``adapters`` library trains a LoRA in the upper layers with the
causal language-model loss on the tenant's text, fed with the split-point states that serving
reads from the causal PLOT (frozen lower side, computed once)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hmi.adapters.interop import attach, from_library, library_model, to_library
from hmi.adapters.spec import AdapterSpec
from hmi.model.decoder import DecoderRoot, run_layers
from hmi.plot.lookup import PlotLookup
from hmi.training.examples import Example
from hmi.training.finetune import featurize
from hmi.training.fit import Fit, early_stopping

NAME = "tenant"


@dataclass
class LmFinetuneConfig:
    epochs: int = 2
    batch_size: int = 8
    lr: float = 2e-3
    weight_decay: float = 0.0
    max_len: int = 128
    max_steps: int | None = None
    patience: int = 1
    seed: int = 0


def _features(lookup: PlotLookup, token_lists: list[list[int]]):
    """(ids, split-point states fp16) of each text, computed once (the lower side is frozen)."""
    feats = featurize(lookup, [Example(t, 0) for t in token_lists])
    return [(torch.tensor(t), h) for t, h in zip(token_lists, feats)]


def _batch(items):
    T = max(len(t) for t, _ in items)
    H = items[0][1].shape[-1]
    ids = torch.zeros(len(items), T, dtype=torch.long)
    x = torch.zeros(len(items), T, H)
    mask = torch.zeros(len(items), T, dtype=torch.long)
    for i, (t, h) in enumerate(items):
        ids[i, :len(t)], x[i, :len(t)], mask[i, :len(t)] = t, h.float(), 1
    return ids, x, mask


def lm_loss(model, root: DecoderRoot, items) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy of a batch through ``model``'s upper layers and head."""
    ids, x, mask = _batch(items)
    out = run_layers(root, model.model.layers[root.l_low:], x, mask)
    logits = model.lm_head(model.model.norm(out))[:, :-1]
    tgt = ids[:, 1:].masked_fill(~(mask[:, 1:].bool() & mask[:, :-1].bool()), -100)
    n = int((tgt != -100).sum())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), ignore_index=-100), n


def finetune_lm(root: DecoderRoot, lookup: PlotLookup, spec: AdapterSpec, train_texts: list[str], dev_texts: list[str],
                cfg: LmFinetuneConfig | None = None, init: dict[str, torch.Tensor] | None = None,
                progress: bool = True, on_progress: Callable[[float, dict], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Trains (or continues, with ``init``) a tenant's LoRA; keeps the epoch with the lowest dev loss.
    Returns canonical weights and metrics (dev perplexity before and after, steps, seconds)."""
    cfg = cfg or LmFinetuneConfig()
    if not train_texts:
        raise ValueError("no training text")
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    tok = root.tokenizer
    enc = lambda texts: [t for t in tok(texts, add_special_tokens=False, truncation=True,  # noqa: E731
                                        max_length=cfg.max_len)["input_ids"] if len(t) >= 2]
    train, dev = _features(lookup, enc(train_texts)), _features(lookup, enc(dev_texts or train_texts[:16]))
    model = library_model(root.model)
    attach(model, NAME, spec, root.l_low, train=True)
    if init is not None:
        to_library(model, NAME, spec, root.l_low, init)
    params = [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def dev_loss() -> float:
        model.eval()
        total, count = 0.0, 0
        for s in range(0, len(dev), 16):
            loss, n = lm_loss(model, root, dev[s:s + 16])
            total, count = total + loss.item() * n, count + n
        return total / max(1, count)

    before = dev_loss()
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    total = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
    rng = np.random.default_rng(cfg.seed)
    with Fit(params, total, lr=cfg.lr, weight_decay=cfg.weight_decay, desc="LoRA fine-tune", progress=progress,
             should_stop=should_stop, on_progress=on_progress) as fit:

        def run_epoch(epoch: int) -> dict:
            model.train()
            order = rng.permutation(len(train))
            for s in range(0, len(train), cfg.batch_size):
                if fit.done:
                    break
                fit.check()
                loss, _ = lm_loss(model, root, [train[i] for i in order[s:s + cfg.batch_size]])
                fit.step(loss, {"epoch": epoch + 1}, epoch=epoch + 1)
            return {"epoch": epoch + 1, "dev_loss": dev_loss(), "stop": fit.done}

        neg_best, best_w, history = early_stopping(
            cfg.epochs, cfg.patience, run_epoch, lambda r: -r["dev_loss"],
            lambda: from_library(model, NAME, spec, root.l_low), best=-before,
            best_state=from_library(model, NAME, spec, root.l_low))
    metrics = {"dev_ppl_before": round(math.exp(before), 3), "dev_ppl_after": round(math.exp(-neg_best), 3),
               "steps": fit.step_count, "history": [{**r, "dev_loss": round(r["dev_loss"], 4)} for r in history],
               "seconds": round(time.time() - t0, 1), "config": asdict(cfg),
               "train_texts": len(train), "dev_texts": len(dev), "lookup_hits": dict(lookup.hits)}
    return copy.deepcopy(best_w), metrics
