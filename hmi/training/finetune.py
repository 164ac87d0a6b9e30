"""Tenant fine-tunes: an adapter and a head trained on the root's upper layers as serving runs
them (``hmi.adapters.tenant_model``), fed with the merged PLOT representations of the tenant's
domain chain (exactly what serving computes).  The same loop (``fit``) trains a private tenant,
whose frozen projections run on the server (``hmi.split.train``); the ``adapters`` library
initializes new adapters and stays the reference the tests compare training with."""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertModel

from hmi.adapters.interop import attach, from_library
from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.adapters.tenant_model import HEAD_DROPOUT, TenantModel  # noqa: F401 (HEAD_DROPOUT: re-exported for training callers)
from hmi.model.hplm import UpperLayers
from hmi.plot.lookup import PlotLookup
from hmi.training.distil import Distillation
from hmi.training.examples import IGNORE, Example, encode, pad, score_batches
from hmi.training.fit import Fit, early_stopping, head_groups

NAME = "tenant"
# The learning rates dev chooses among, with the pooling of a classification head (``dev_options``): the
# accuracy tables' grid for every adapter scheme (benchmarks/eval_accuracy.py, GRIDS), so that a tenant's
# fine-tune, its teacher and its distilled student (at the teacher's pooling) are chosen as the tables'
# columns are and serve what they report.
GRID_LRS = (3e-3, 1e-3)


@dataclass
class FinetuneConfig:
    epochs: int = 4
    batch_size: int = 32
    lr: float = 1e-3
    head_lr: float | None = None  # the head's own rate (None: lr, as for the adapter)
    weight_decay: float = 0.01
    max_len: int = 128
    patience: int = 2
    seed: int = 0
    max_train: int | None = None
    truncate: bool = True  # texts over max_len are cut (else refused, naming the row), as inference reads them


def dev_options(spec: AdapterSpec, has_dev: bool, single: float = GRID_LRS[0],
                keep_pooling: bool = False) -> list[tuple[str, float]]:
    """The (pooling, learning rate) settings a fine-tune trains, dev keeping the best (``finetune``,
    ``train_teacher``): ``GRID_LRS`` and, for a classification head unless ``keep_pooling`` (a pooling
    the tenant named, a fine-tune continuing from weights trained with it, a student at its teacher's),
    the [CLS] vector and the mean of the tokens, in that order; without dev examples, the spec's
    pooling at ``single`` alone (by default the grid's first rate, the one dev keeps more often in
    the accuracy tables, for a fine-tune on the labels alone as for a teacher)."""
    if not has_dev:
        return [(spec.pooling, single)]
    poolings = ("cls", "mean") if spec.head == "classification" and not keep_pooling else (spec.pooling,)
    return [(p, rate) for p in poolings for rate in GRID_LRS]


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


def initial_weights(config, l_low: int, spec: AdapterSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A new tenant's weights (canonical layout): the adapter as the ``adapters`` library
    initializes it and the head as ``nn.Linear`` does, both drawn after ``torch.manual_seed(seed)``.
    The library attaches to a throwaway model of the root's shapes whose weights are never
    written nor read (allocated, not initialized: a few MB resident); the root is not touched."""
    shape = copy.deepcopy(config)
    shape.vocab_size = 8
    with torch.device("meta"):
        skeleton = BertModel(shape, add_pooling_layer=False)
    skeleton = skeleton.to_empty(device="cpu")
    torch.manual_seed(seed)
    attach(skeleton, NAME, spec, l_low, train=True)
    weights = from_library(skeleton, NAME, spec, l_low)
    for j in range(spec.head_layers - 1):  # the hidden layers of a deeper head (an uploaded library head)
        layer = nn.Linear(config.hidden_size, config.hidden_size)
        weights[f"head.hidden.{j}.w"] = layer.weight.detach().t().contiguous()
        weights[f"head.hidden.{j}.b"] = layer.bias.detach().clone()
    head = nn.Linear(config.hidden_size, spec.num_labels)
    weights["head.w"] = head.weight.detach().t().contiguous()
    weights["head.b"] = head.bias.detach().clone()
    return weights


def tenant_model(root_bert, l_low: int, spec: AdapterSpec, init: dict[str, torch.Tensor] | None = None,
                 seed: int = 0) -> TenantModel:
    """A hosted tenant's trainable model on the root's own upper layers (shared, frozen, never
    copied): ``init``'s weights, or new ones (``initial_weights``)."""
    cfg = root_bert.config
    weights = init if init is not None else initial_weights(cfg, l_low, spec, seed)
    return TenantModel(UpperLayers(root_bert, l_low).layers, spec, weights, cfg.hidden_size, cfg.intermediate_size,
                       getattr(root_bert, "relative_bias", None))


@torch.no_grad()
def evaluate(model: TenantModel, examples: list[Example], feats: list[torch.Tensor], batch: int = 64) -> dict | None:
    """Accuracy and macro F1 of ``model`` on encoded examples with their lower-layer features; None
    without examples (no score, rather than a 0.0 that reads as one)."""
    if not examples:
        return None
    tagging = model.spec.head == "tagging"

    def batches():
        for s in range(0, len(examples), batch):
            x, mask, y = collate(examples, feats, list(range(s, min(len(examples), s + batch))), tagging)
            yield model.logits(x, mask), y
    return score_batches(batches(), tagging, model.spec.num_labels)


def finetune(root_bert, l_low: int, lookup: PlotLookup, tokenizer, spec: AdapterSpec, train: list[dict],
             dev: list[dict], test: list[dict] | None = None, cfg: FinetuneConfig | None = None,
             init: dict[str, torch.Tensor] | None = None, progress: bool = True,
             on_progress: Callable[[float, dict], None] | None = None,
             should_stop: Callable[[], bool] | None = None, distil: Distillation | None = None,
             options: list[tuple[str, float]] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Trains (or, with ``init``, continues training) a hosted tenant's adapter and head on the
    root's upper layers (``fit``; with ``distil``, from a teacher too, starting where its ``start``
    says when ``init`` does not).  With ``options`` ((pooling, learning rate) pairs: ``dev_options``)
    one fit per setting from the same start, on features computed once, the best dev accuracy kept
    (the first of equals); without, ``spec``'s pooling at ``cfg.lr``.  Returns canonical weights and
    a metrics record: the kept fit's, with its ``pooling`` (the served spec's), ``tried`` ([[pooling,
    lr, dev accuracy or None], ...]) and ``seconds`` over every setting."""
    cfg = cfg or FinetuneConfig()
    if init is None and distil is not None:
        init = distil.start
    options = options or [(spec.pooling, cfg.lr)]
    t0 = time.time()
    prepared = prepare(lookup, tokenizer, spec, train, dev, test, cfg, distil)
    best, tried = None, []
    for i, (pooling, rate) in enumerate(options):
        model = tenant_model(root_bert, l_low, replace(spec, pooling=pooling), init, cfg.seed)
        part = None if on_progress is None or len(options) == 1 else (
            lambda f, info, i=i: on_progress((i + f) / len(options), {**info, "setting": i + 1, "settings": len(options)}))
        weights, metrics = fit(model, lookup, tokenizer, train, dev, test, replace(cfg, lr=rate), progress,
                               part or on_progress, should_stop, distil, prepared)
        score = metrics["dev"]["accuracy"] if metrics["dev"] else None
        tried.append([pooling, rate, score])
        if best is None or (score is not None and score > best[0]):
            best = (score, weights, {**metrics, "pooling": pooling})
    _, weights, metrics = best
    metrics.update(tried=tried, seconds=round(time.time() - t0, 1), lookup_hits=dict(lookup.hits))
    return weights, metrics


@dataclass
class Prepared:
    """What every fit of one fine-tune reads, whatever its pooling and rate: the examples by split,
    the labelled training examples the train metric reads (at most 2,000), the teacher's logits and
    where they count (None twice without distillation), and each split's lower-layer features."""
    ex: dict[str, list[Example]]
    labelled: list[Example]
    soft: object
    where: object
    feats: dict[str, list[torch.Tensor]]


def prepare(lookup, tokenizer, spec: AdapterSpec, train: list[dict], dev: list[dict], test: list[dict] | None,
            cfg: FinetuneConfig, distil: Distillation | None) -> Prepared:
    """The examples and features of a fine-tune (``Prepared``).  With ``distil`` the training split
    is the labelled examples followed by the unlabeled texts."""
    if not train:
        raise SpecError("no training examples")
    train = train[:cfg.max_train] if cfg.max_train else train
    ex = {name: encode(tokenizer, rows or [], spec, cfg.max_len, cfg.truncate) for name, rows in
          (("train", train), ("dev", dev), ("test", test))}
    labelled, soft, where = ex["train"][:2000], None, None
    if distil is not None:
        ex["train"], soft, where = distil.extend(tokenizer, ex["train"], spec, cfg.max_len)
    return Prepared(ex, labelled, soft, where, {name: featurize(lookup, e) for name, e in ex.items()})


def fit(model: TenantModel, lookup, tokenizer, train: list[dict], dev: list[dict], test: list[dict] | None = None,
        cfg: FinetuneConfig | None = None, progress: bool = True,
        on_progress: Callable[[float, dict], None] | None = None,
        should_stop: Callable[[], bool] | None = None, distil: Distillation | None = None,
        prepared: Prepared | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The tenant fine-tune loop, hosted or private: ``lookup.merged(ids, mask)`` gives the lower
    layers' output (computed once: the lower side is frozen), ``model`` runs the upper layers;
    with ``distil``, also on its unlabeled texts, against its teacher's answers as well.

    AdamW, seeded (``torch.manual_seed(cfg.seed)`` before the first step: the dropout masks are
    the same wherever the frozen projections run), early stopping on the dev metric (accuracy;
    the best epoch's weights are kept, and loaded into ``model``; without dev examples every epoch
    runs and the last is kept).  Returns canonical weights and
    a metrics record.  ``prepared``: the examples and features of this fine-tune when an earlier fit
    of it computed them (``prepare``)."""
    cfg = cfg or FinetuneConfig()
    spec, tagging = model.spec, model.spec.head == "tagging"
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    t0 = time.time()
    prepared = prepared or prepare(lookup, tokenizer, spec, train, dev, test, cfg, distil)
    ex, labelled, soft, where, feats = (prepared.ex, prepared.labelled, prepared.soft, prepared.where,
                                        prepared.feats)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    steps_per_epoch = (len(ex["train"]) + cfg.batch_size - 1) // cfg.batch_size
    with Fit(head_groups(model.adapter_parameters(), model.head_parameters(), cfg.head_lr),
             steps_per_epoch * cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay, desc="fine-tune",
             progress=progress, should_stop=should_stop, on_progress=on_progress, report_every=5) as fit:

        def run_epoch(epoch: int) -> dict:
            order = rng.permutation(len(ex["train"]))
            for s in range(0, len(order), cfg.batch_size):
                fit.check()
                idx = order[s:s + cfg.batch_size].tolist()
                x, mask, y = collate(ex["train"], feats["train"], idx, tagging)
                logits = model.logits(x, mask, train=True)
                loss = (F.cross_entropy(logits.reshape(-1, spec.num_labels), y.reshape(-1), ignore_index=IGNORE)
                        if distil is None else distil.loss(logits, y, *distil.batch(soft, where, idx, tagging)))
                fit.step(loss, {"epoch": epoch + 1}, epoch=epoch + 1)
            dev_m = evaluate(model, ex["dev"], feats["dev"])
            return {"epoch": epoch + 1, "loss": round(fit.last_loss, 4), "dev": dev_m}

        # Without a dev set nothing tells the epochs apart (a batch's loss is no measure of one): every
        # epoch runs and the last is kept.
        score = (lambda r: r["dev"]["accuracy"]) if ex["dev"] else (lambda r: r["epoch"])
        _, best_state, history = early_stopping(cfg.epochs, cfg.patience, run_epoch, score,
                                                lambda: copy.deepcopy(model.weights()))
    model.load(best_state)
    metrics = {"train": evaluate(model, labelled, feats["train"][:len(labelled)]),  # the labelled come first
               "dev": evaluate(model, ex["dev"], feats["dev"]),
               "test": evaluate(model, ex["test"], feats["test"]),
               "epochs_run": len(history), "history": history, "seconds": round(time.time() - t0, 1),
               "config": asdict(cfg)}
    if on_progress is not None:
        on_progress(1.0, {"done": True})
    return best_state, metrics
