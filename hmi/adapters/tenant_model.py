"""One tenant's adapter and head over the root's upper layers, trainable: what a fine-tune
trains, hosted or private.

The forward pass is the served one (``hmi.model.encoder_layers`` with the hosted batched kernels'
sites, ``GroupSites``, over a pool of one slot), so a trained tenant answers exactly as it trains.
The adapter's tensors are the pool's slot itself, in the pool's layout; ``weights()`` reads them
back in the canonical layout.  The frozen projections run where ``sites()`` says: here on the
root's own modules (hosted), on the server's base executor for a private tenant
(``hmi.split.model.PrivateModel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hmi.adapters.batched import Group, GroupSites, batched_heads, segment_plan
from hmi.adapters.pool import SlotPool
from hmi.adapters.spec import AdapterSpec
from hmi.model import encoder_layers

HEAD_DROPOUT = 0.1  # on the upper layers' output while training, before the head


class TenantModel:
    """``layers``: the root's upper layers (shared, never written; their frozen projections are
    only read through ``sites``); ``relative_bias``: an MPNet root's; ``weights``: the adapter and
    head in the canonical layout (``hmi.adapters.spec``). The adapter's tensors take the layers'
    dtype (float32 as served; float64 for a reference computed in higher precision)."""

    def __init__(self, layers: nn.ModuleList, spec: AdapterSpec, weights: dict[str, torch.Tensor],
                 hidden: int, intermediate: int, relative_bias=None):
        self.layers, self.spec, self.relative_bias = layers, spec, relative_bias
        self.dtype = next(layers.parameters()).dtype
        self.pool = SlotPool.for_spec(spec, 1, len(layers), hidden, intermediate, max(2, spec.num_labels),
                                      dtype=self.dtype)
        self.load(weights)

    def weights(self) -> dict[str, torch.Tensor]:
        """The adapter's and head's weights in the canonical layout (what an export holds), copied."""
        return self.pool.read(0, self.spec.num_labels)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.pool.write(0, {k: v.to(self.dtype) for k, v in weights.items()})

    def parameters(self) -> list[torch.Tensor]:
        """The adapter's and head's tensors (the pool's one slot), made trainable, in that order."""
        return self.adapter_parameters() + self.head_parameters()

    def adapter_parameters(self) -> list[torch.Tensor]:
        """The adapter's tensors of every layer, made trainable."""
        return [t.requires_grad_(True) for layer in self.pool.layers for t in layer.values()]

    def head_parameters(self) -> list[torch.Tensor]:
        """The head's tensors, made trainable."""
        params = [self.pool.head_w, self.pool.head_b]
        if self.pool.head_layers > 1:
            params += [self.pool.head_hidden_w, self.pool.head_hidden_b]
        return [p.requires_grad_(True) for p in params]

    def sites(self, group: Group, mask: torch.Tensor, train: bool) -> GroupSites:
        """Where the frozen projections run: here, on the root's own modules."""
        return GroupSites([group])

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, train: bool = False) -> torch.Tensor:
        """The head's logits for the upper layers' input ``hidden`` (the merged PLOT output); with
        ``train``, the dropouts of training (the layers' and ``HEAD_DROPOUT``).
        Shapes: hidden (B, T, H); mask (B, T) -> (B, T, C_max) (classification at position 0)."""
        b = hidden.shape[0]
        group = self._group(b)
        out = F.dropout(self._upper(group, hidden, mask, train), HEAD_DROPOUT, train)
        tagging = torch.full((b,), self.spec.head == "tagging")
        mean = torch.full((b,), self.spec.pooling == "mean")
        return batched_heads(out, [group], tagging, mask, mean)

    def upper(self, hidden: torch.Tensor, mask: torch.Tensor, train: bool = False) -> torch.Tensor:
        """The upper layers' output with the adapter (what the head and a sentence embedding read).
        Shapes: hidden (B, T, H); mask (B, T) -> (B, T, H)."""
        return self._upper(self._group(hidden.shape[0]), hidden, mask, train)

    def _group(self, b: int) -> Group:
        return Group(torch.arange(b), torch.zeros(b, dtype=torch.long), self.pool, True, segment_plan([0] * b))

    def _upper(self, group: Group, hidden: torch.Tensor, mask: torch.Tensor, train: bool) -> torch.Tensor:
        return encoder_layers.upper_forward(self.layers, hidden, mask, self.sites(group, mask, train),
                                            relative_bias=self.relative_bias, train=train)

    def logits(self, hidden: torch.Tensor, mask: torch.Tensor, train: bool = False) -> torch.Tensor:
        """The logits as a loss reads them: (B, C) for classification, (B, T, C) for tagging."""
        out = self.forward(hidden, mask, train)[..., :self.spec.num_labels]
        return out if self.spec.head == "tagging" else out[:, 0]
