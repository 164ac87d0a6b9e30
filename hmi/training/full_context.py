"""Training on the full-context root (every layer reads the whole text, as the root was trained),
outside serving: the teacher a tenant's served adapter is distilled from (``hmi.training.distil``:
the ``adapters`` library's adapters in every layer), and the reference schemes the accuracy
benchmark compares hBERT with: all weights trained ("full"), adapters in every layer ("adapter")
or in the layers from ``l_low`` up ("upper"), the head alone on the frozen root ("head"), or all
weights of a student made of the root's first two layers ("compress").  The same head, loss,
batches, dropout and early stopping for all."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hmi.adapters.batched import pooled
from hmi.adapters.interop import attach, from_library, library_model
from hmi.adapters.spec import AdapterSpec
from hmi.model.root import full_forward
from hmi.training.examples import IGNORE, Example, encode, pad, score_batches
from hmi.training.finetune import FinetuneConfig, dev_options
from hmi.training.fit import Fit, early_stopping, head_groups

MODES = ("full", "adapter", "upper", "head", "compress")
COMPRESS_LAYERS = 2
BATCH = 32
PROBE_LR = 1e-2  # the head's rate while it is trained alone first (the frozen root's grid: 3e-3, 1e-2, 1e-3)


class FullContextModel:
    """A private copy of the root (``library_model``: a deep copy) with the trainable part of
    ``mode`` and a head of ``spec``; initialized after ``torch.manual_seed(seed)``."""

    def __init__(self, bert, spec: AdapterSpec, mode: str, l_low: int = 0, seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        torch.manual_seed(seed)
        self.spec, self.mode, self.tagging = spec, mode, spec.head == "tagging"
        self.model = model = library_model(bert)
        if mode == "compress":
            model.encoder.layer = model.encoder.layer[:COMPRESS_LAYERS]
            model.config.num_hidden_layers = COMPRESS_LAYERS
        if mode in ("adapter", "upper"):
            attach(model, "t", spec, l_low if mode == "upper" else 0, train=True)
        for p in model.parameters() if mode in ("full", "compress", "head") else ():
            p.requires_grad_(mode != "head")
        self.head = nn.Linear(bert.config.hidden_size, spec.num_labels)
        self.drop = nn.Dropout(0.1)
        self.frozen: dict[int, torch.Tensor] = {}  # id(example) -> the frozen root's output, "head" only

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad] + list(self.head.parameters())

    def batch(self, exs: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids and mask (B, T) and targets (B,) or (B, T) of padded examples."""
        ids, mask = pad(exs)
        if self.tagging:
            y = torch.full(ids.shape, IGNORE)
            for i, e in enumerate(exs):
                y[i, :len(e.target)] = torch.tensor(e.target)
        else:
            y = torch.tensor([e.target for e in exs])
        return torch.from_numpy(ids), torch.from_numpy(mask), y

    def hidden(self, exs: list[Example], ids: torch.Tensor, mask: torch.Tensor, train: bool) -> torch.Tensor:
        """The last layer's output (B, T, H); the frozen root of "head" runs once per example."""
        if self.mode != "head":
            self.model.train(train)
            return full_forward(self.model, ids, mask)[-1]  # with an MPNet root's relative position bias
        todo = [i for i, e in enumerate(exs) if id(e) not in self.frozen]
        if todo:
            self.model.eval()
            with torch.no_grad():
                h = full_forward(self.model, ids[todo], mask[todo])[-1]
            for j, i in enumerate(todo):
                self.frozen[id(exs[i])] = h[j, :len(exs[i].ids)].clone()
        out = torch.zeros(ids.shape + (self.head.in_features,))
        for i, e in enumerate(exs):
            out[i, :len(e.ids)] = self.frozen[id(e)]
        return out

    def logits(self, exs: list[Example], ids: torch.Tensor, mask: torch.Tensor, train: bool) -> torch.Tensor:
        """(B, C), or (B, T, C) for tagging."""
        h = self.hidden(exs, ids, mask, train)
        h = self.drop(h) if train else h
        return self.head(h) if self.tagging else self.head(pooled(h, mask, self.spec.pooling == "mean"))

    @torch.no_grad()
    def answers(self, exs: list[Example]) -> list[torch.Tensor]:
        """The logits of each example, (C,) or (T_i, C): a teacher (``hmi.training.distil.Teacher``)."""
        out = []
        for s in range(0, len(exs), 64):
            ids, mask, _ = self.batch(exs[s:s + 64])
            lg = self.logits(exs[s:s + 64], ids, mask, False)
            out += [lg[j, :len(e.ids)] if self.tagging else lg[j] for j, e in enumerate(exs[s:s + 64])]
        return out

    @torch.no_grad()
    def evaluate(self, exs: list[Example]) -> dict:
        def batches():
            for s in range(0, len(exs), 64):
                ids, mask, y = self.batch(exs[s:s + 64])
                yield self.logits(exs[s:s + 64], ids, mask, False), y
        return score_batches(batches(), self.tagging, self.spec.num_labels)

    def train(self, ex_train: list[Example], ex_dev: list[Example], epochs: int, lr: float, seed: int = 0,
              on_progress: Callable[[float, dict], None] | None = None,
              should_stop: Callable[[], bool] | None = None, probe_epochs: int = 0,
              head_lr: float | None = None) -> float | None:
        """AdamW for ``epochs`` epochs of batches of 32 in a seeded order, every epoch run; the best
        epoch on dev accuracy is kept (loaded), without dev examples the last.  With ``probe_epochs``
        (modes "adapter" and "upper"), the head alone is trained first for that many epochs at
        ``PROBE_LR``, the adapters still at their start, and the training goes on from there (LP-FT,
        Kumar et al., 2022): the probe's epochs are among those dev chooses from.  ``head_lr``: the
        head's rate while the rest trains at ``lr`` (None: ``lr``).  Returns the kept epoch's dev
        accuracy (None without dev examples)."""
        if probe_epochs and self.mode not in ("adapter", "upper"):
            raise ValueError(f"a probe first is for the adapter modes, not {self.mode!r}")
        rng, steps = np.random.default_rng(seed), -(-len(ex_train) // BATCH)
        score = (lambda r: r["dev"]) if ex_dev else (lambda r: r["epoch"])
        adapters = [p for p in self.model.parameters() if p.requires_grad]
        best, state, done = float("-inf"), None, 0
        for n, rate, probing in ((probe_epochs, PROBE_LR, True), (epochs, lr, False)):
            if n == 0:
                continue
            for p in adapters:  # frozen while the head is probed: nothing flows back through the root then
                p.requires_grad_(not probing)
            params = head_groups([] if probing else adapters, list(self.head.parameters()), None if probing else head_lr)
            with Fit(params, (epochs + probe_epochs) * steps, lr=rate, weight_decay=0.01, progress=False,
                     start=done, on_progress=on_progress, should_stop=should_stop, report_every=5) as fit:

                def run_epoch(epoch: int, fit=fit, first=done // steps) -> dict:
                    order = rng.permutation(len(ex_train))
                    for s in range(0, len(order), BATCH):
                        fit.check()
                        exs = [ex_train[i] for i in order[s:s + BATCH]]
                        ids, mask, y = self.batch(exs)
                        out = self.logits(exs, ids, mask, True)
                        fit.step(F.cross_entropy(out.reshape(-1, self.spec.num_labels), y.reshape(-1),
                                                 ignore_index=IGNORE))
                    return {"dev": self.evaluate(ex_dev)["accuracy"] if ex_dev else None, "epoch": first + epoch}

                best, state, _ = early_stopping(n, n, run_epoch, score, self._snapshot, best, state)
                done = fit.step_count
        self.model.load_state_dict(state[0])
        self.head.load_state_dict(state[1])
        return best if ex_dev else None

    def upper_weights(self, l_low: int) -> dict[str, torch.Tensor]:
        """The trained adapter of the layers from ``l_low`` up and the head, copied, in the canonical
        layout of a tenant served at split ``l_low`` (``hmi.adapters.spec``): where a distilled
        student can start from its teacher (``Distillation.start``).  Modes "adapter" and "upper"."""
        if self.mode not in ("adapter", "upper"):
            raise ValueError(f"mode {self.mode!r} trains no adapter a tenant could start from")
        weights = from_library(self.model, "t", self.spec, l_low)
        weights["head.w"] = self.head.weight.detach().t().contiguous()
        weights["head.b"] = self.head.bias.detach().clone()
        return weights

    def whole_weights(self) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
        """What a tenant served on the full root stores: the spec made ``whole`` and the trained
        adapter of every layer with the head (mode "adapter"; a head of one layer, as trained here)."""
        if self.mode != "adapter":
            raise ValueError(f"mode {self.mode!r} has no adapter in every layer")
        return replace(self.spec, whole=True, head_layers=1), self.upper_weights(0)

    def _snapshot(self) -> tuple[dict, dict]:
        return ({k: v.clone() for k, v in self.model.state_dict().items()},
                {k: v.clone() for k, v in self.head.state_dict().items()})


def train_full_context(bert, spec: AdapterSpec, ex_train: list[Example], ex_dev: list[Example],
                       ex_test: list[Example], mode: str, epochs: int, lr: float, seed: int = 0, l_low: int = 0,
                       probe_epochs: int = 0, head_lr: float | None = None) -> dict:
    """A reference scheme trained and scored (``probe_epochs``, ``head_lr``: ``FullContextModel.train``'s):
    ``{"dev": {"accuracy"}, "test": metrics, "teacher": the trained model's answers, "upper": its
    ``upper_weights``}``."""
    m = FullContextModel(bert, spec, mode, l_low, seed)
    best = m.train(ex_train, ex_dev, epochs, lr, seed, probe_epochs=probe_epochs, head_lr=head_lr)
    return {"dev": {"accuracy": best}, "test": m.evaluate(ex_test), "teacher": m.answers, "upper": m.upper_weights}


def teacher_options(spec: AdapterSpec, has_dev: bool, lr: float | None = None,
                    keep_pooling: bool = False) -> list[tuple[str, float]]:
    """The (pooling, learning rate) a tenant's teacher is trained with, dev choosing among them
    (``dev_options``: the accuracy tables choose hBERT-adapter's the same way, which the front's
    served-auto column assumes); the spec's pooling at ``lr`` alone when ``lr`` is given, at the
    first of ``GRID_LRS`` without dev examples."""
    return [(spec.pooling, lr)] if lr is not None else dev_options(spec, has_dev, keep_pooling=keep_pooling)


def train_teacher(bert, tokenizer, spec: AdapterSpec, train: list[dict], dev: list[dict], cfg: FinetuneConfig,
                  lr: float | None = None, keep_pooling: bool = False,
                  on_progress: Callable[[float, dict], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> tuple[Callable[[list[Example]], list[torch.Tensor]], dict]:
    """A tenant's teacher: ``spec``'s adapters in every layer of the full-context root, trained on
    its rows (``cfg``'s epochs, seed and text limit; the best epoch on dev, else the last) with each
    of ``teacher_options``, the one with the best dev accuracy kept (the first of equals).
    Returns its answers (a ``Teacher``) and ``{"dev": accuracy or None, "pooling", "lr", "tried":
    [[pooling, lr, dev], ...], "model": the kept FullContextModel, "seconds" over every setting}``
    (the model: what a tenant served on the full root serves, ``whole_weights``)."""
    t0 = time.time()
    options = teacher_options(spec, bool(dev), lr, keep_pooling)
    best, tried = None, []
    for i, (pooling, rate) in enumerate(options):
        s = replace(spec, pooling=pooling)
        ex_train, ex_dev = (encode(tokenizer, rows, s, cfg.max_len, cfg.truncate) for rows in (train, dev))
        m = FullContextModel(bert, s, "adapter", 0, cfg.seed)
        part = None if on_progress is None else (
            lambda f, info, i=i: on_progress((i + f) / len(options), {**info, "setting": i + 1, "settings": len(options)}))
        acc = m.train(ex_train, ex_dev, cfg.epochs, rate, cfg.seed, part, should_stop, head_lr=cfg.head_lr)
        tried.append([pooling, rate, acc])
        if best is None or (acc is not None and acc > best[0]):
            best = (acc, m, pooling, rate)
    acc, m, pooling, rate = best
    return m.answers, {"dev": acc, "pooling": pooling, "lr": rate, "tried": tried, "model": m,
                       "seconds": round(time.time() - t0, 1)}
