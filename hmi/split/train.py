"""A private tenant's fine-tune on its own side: the adapter and head trained with AdamW here,
every frozen projection's forward and backward on the server's base executor (training priority).
The loop is the hosted fine-tune's (``hmi.training.finetune.fit``: data, dropout masks, loss,
schedule, early stopping); only where the frozen projections and the PLOT lookup run differs."""

from __future__ import annotations

import numpy as np
import torch

from hmi.training.finetune import FinetuneConfig, fit


class RemoteLookup:
    """The model's lower layers (the server's PLOT lookup, or ``LocalLower`` here) as ``featurize``
    reads a lookup (``merged(ids, mask)``)."""

    def __init__(self, model):
        self.model = model

    def merged(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        return self.model.lower_layers(torch.from_numpy(ids), torch.from_numpy(mask))


def finetune_private(model, train: list[dict], dev: list[dict], cfg: FinetuneConfig | None = None,
                     progress: bool = False, on_progress=None, should_stop=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Trains a ``PrivateModel``'s adapter and head (starting from its current weights) on
    ``train``, early-stopping on ``dev``; returns (canonical weights of the best epoch, metrics).
    The model keeps the best weights.  ``on_progress``, ``should_stop``: as ``fit`` takes them
    (``should_stop()`` true ends the run with ``hmi.training.fit.Cancelled``)."""
    weights, metrics = fit(model, RemoteLookup(model), model.tokenizer, train, dev, None, cfg, progress,
                           on_progress, should_stop)
    metrics["round_trips"] = model.base.stats["round_trips"] if model.base is not None else 0
    return weights, metrics
