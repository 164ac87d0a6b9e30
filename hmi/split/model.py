"""A private tenant's model on its own side: its adapter and head (the ``adapters`` library's
saved folder, as ``GET /v1/tenants/{t}/adapter`` exports it) and the tokenizer; the lower layers'
PLOT lookup runs on the server's base executor (``BaseClient``), or here (``hmi.split.lower``: no
token id leaves the client).  The upper layers run here whole
(the ``blind`` split: the server sees the token ids alone), or here only in their non-linear parts
(LayerNorms, activations, attention's softmax, an MPNet root's relative position bias) with every
frozen linear projection on the server (the ``projections`` split).

The model is a hosted fine-tune's (``hmi.adapters.tenant_model``: ``hmi.model.encoder_layers``
with the hosted batched kernels' sites over a pool of one slot), with the frozen projections
moved to the server in the ``projections`` split: a private tenant computes, and trains, as the
same adapter hosted does.

With noise (``hmi.split.noise``), the ``projections`` split changes what the server sees of each
projection's input: the client sends ``x + n``, receives ``(x + n) W^T + b`` and subtracts
``n W^T``.  That does not hide the adapter from a provider that predicts the activations
(``hmi.split.attack.predicted``).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from hmi.adapters.batched import Group, GroupSites
from hmi.adapters.heads import decode, word_starts
from hmi.adapters.portable import RootShape, read_encoder
from hmi.adapters.tenant_model import TenantModel
from hmi.model.convert import load_relative_bias
from hmi.model.hplm import as_numpy_ids
from hmi.model.root import load_tokenizer
from hmi.split.client import BaseClient
from hmi.split.lower import LocalLower
from hmi.split.noise import ClientNoise, ServerNoise, checkpoint_tensor
from hmi.textlimit import fit_ids

SITE_PROJECTION = {"attn_out": "attn_out", "ffn_in": "ffn_in", "ffn_out": "ffn_out"}


class OnServer(nn.Module):
    """Stands where a frozen linear projection was: it runs on the server, never here."""

    def forward(self, x):
        raise RuntimeError("a frozen projection runs on the server's base executor")


def upper_layers(model_dir: str | Path, l_low: int, frozen_here: bool = False) -> tuple[nn.ModuleList, BertConfig]:
    """The root's upper layers with their non-linear parameters only: the LayerNorms read from the
    checkpoint, every linear projection an ``OnServer`` stand-in (its weights are never read);
    with ``frozen_here``, every parameter read from the (public) checkpoint: the whole layers."""
    config = BertConfig.from_pretrained(str(model_dir), local_files_only=True)
    config._attn_implementation = "eager"
    layers = nn.ModuleList()
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for i in range(l_low, config.num_hidden_layers):
            layer = BertLayer(config)
            if not frozen_here:
                att = layer.attention.self
                att.query = att.key = att.value = OnServer()
                layer.attention.output.dense = layer.intermediate.dense = layer.output.dense = OnServer()
            for name, param in layer.named_parameters():
                param.data.copy_(checkpoint_tensor(f, keys, f"encoder.layer.{i}.{name}"))
            layers.append(layer.eval().requires_grad_(False))
    return layers, config


class RemoteProjection(torch.autograd.Function):
    """A frozen projection on the server, differentiable: forward ``x W^T + b`` (through
    ``RemoteSites._call``, noise included), backward ``grad_y W`` (the executor's ``backward``, at
    training priority).  The projection has no weight gradient: it is frozen.  The gradients sent
    back are not hidden by the noise.  Shapes: x (..., D_in) -> (..., D_out)."""

    @staticmethod
    def forward(ctx, x, sites, layer, projection):
        ctx.sites, ctx.layer, ctx.projection = sites, layer, projection
        return sites._plain(layer, projection, x)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.sites
        return s.base.linear(ctx.layer, ctx.projection, "backward", grad, training=True), None, None, None


class RemoteSites(GroupSites):
    """The adapter sites of a private tenant: the adapter here (``GroupSites``), the frozen
    projections on the server (q, k and v in one call) for the real tokens' rows only (``mask``;
    a padding row's projection is never read, so it is left at zero), hidden by ``noise`` when
    given; with ``grad``, differentiable through the server (``RemoteProjection``)."""

    def __init__(self, groups: list[Group], base: BaseClient, l_low: int, mask: torch.Tensor,
                 noise: ClientNoise | ServerNoise | None = None, grad: bool = False):
        super().__init__(groups)
        self.base, self.l_low, self.noise, self.grad = base, l_low, noise, grad
        self.real = mask.bool()

    def frozen(self, li: int, sites: tuple[str, ...], x: torch.Tensor, linears) -> list[torch.Tensor]:
        layer = self.l_low + li
        if sites == ("q", "k", "v"):
            return list(self._call(layer, "qkv", x).chunk(3, dim=-1))
        return [self._call(layer, SITE_PROJECTION[site], x) for site in sites]

    def _call(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """Shapes: x (B, T, D_in) -> (B, T, D_out), zero at padding."""
        rows = x[self.real]
        if self.grad and torch.is_grad_enabled():
            y = RemoteProjection.apply(rows, self, layer, projection)
        else:
            y = self._plain(layer, projection, rows)
        out = y.new_zeros(*x.shape[:-1], y.shape[-1])
        out[self.real] = y
        return out

    def _plain(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        if self.noise is None:
            return self.base.linear(layer, projection, "forward", x, training=self.grad)
        hidden, effect = self.noise.hide(layer, projection, x)
        return self.base.linear(layer, projection, "forward", hidden, training=self.grad) - effect


SPLITS = ("projections", "blind")


class PrivateModel(TenantModel):
    """A private tenant's hPLM: ``infer(texts)`` answers as the hosted route does; trained by the
    hosted fine-tune's loop (``hmi.split.train``).

    ``split`` says what the server runs for it: ``projections``, the PLOT lookup and every frozen
    linear projection of the upper layers (hidden by ``noise``, which does not stop a provider that
    predicts the activations: ``hmi.split.attack.predicted``); ``blind``, the PLOT lookup alone,
    the client running the upper layers whole from the public root's weights, so that nothing the
    server receives or computes depends on the adapter (it still sees the token ids).

    ``lower`` says where the lower layers run: None, the server's PLOT lookup (it receives the
    token ids); a ``LocalLower``, here, so the server sees no token id (with the blind split, no
    call at all: ``base`` may then be None)."""

    def __init__(self, base: BaseClient | None, model_dir: str | Path, l_low: int, adapter_files: dict[str, bytes],
                 noise: ClientNoise | ServerNoise | None = None, max_len: int = 128, split: str = "projections",
                 lower: LocalLower | None = None):
        if split not in SPLITS:
            raise ValueError(f"split is one of {', '.join(SPLITS)}, not {split!r}")
        if split == "blind" and noise is not None:
            raise ValueError("the blind split sends the server no activation: there is nothing for noise to hide")
        if base is None and not (split == "blind" and lower is not None):
            raise ValueError("only the blind split with the lower layers here calls no server: give a BaseClient")
        self.base, self.l_low, self.noise, self.max_len, self.split = base, l_low, noise, max_len, split
        self.lower = lower
        layers, config = upper_layers(model_dir, l_low, frozen_here=split == "blind")
        self.config = config
        self.tokenizer = load_tokenizer(str(model_dir))
        shape = RootShape(config.model_type, config.hidden_size, config.num_hidden_layers, l_low, config.hidden_size)
        spec, weights = read_encoder(adapter_files, shape)
        if spec.whole:
            raise ValueError(f"the adapter has weights in the lower layers 0-{l_low - 1}, which a private tenant reads "
                             f"from the server's PLOT: train it with leave_out={list(range(l_low))}")
        super().__init__(layers, spec, weights, config.hidden_size, config.intermediate_size,
                         load_relative_bias(Path(model_dir), config))

    @staticmethod
    def files_of(archive: bytes) -> dict[str, bytes]:
        """The files of a zipped adapter folder (what ``GET /v1/tenants/{t}/adapter`` answers)."""
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            return {Path(n).name: zf.read(n) for n in zf.namelist() if not n.endswith("/")}

    def sites(self, group: Group, mask: torch.Tensor, train: bool) -> GroupSites:
        """The frozen projections on the server, differentiable through it when ``train``; with
        the blind split, here (the hosted sites over the client's own copy of the layers)."""
        if self.split == "blind":
            return GroupSites([group])
        return RemoteSites([group], self.base, self.l_low, mask, self.noise, grad=train)

    def text_logits(self, texts: list[str], truncate: bool = False):
        """(logits (B, T, C_max), the batch's encoding, its token ids) of texts read as the hosted
        route reads them (``fit_ids``: refused past ``max_len`` unless ``truncate``)."""
        enc = self.tokenizer(texts, truncation=False, return_offsets_mapping=True)
        ids_list = [fit_ids(ids, self.max_len, truncate)[0] for ids in enc["input_ids"]]
        ids, mask = (torch.from_numpy(a) for a in as_numpy_ids(ids_list))
        with torch.no_grad():
            return self.forward(self.lower_layers(ids, mask), mask), enc, ids_list

    def lower_layers(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The upper layers' input: the server's PLOT lookup, or ``LocalLower`` here.
        Shapes: ids, mask (B, T) -> (B, T, H)."""
        if self.lower is not None:
            return self.lower.merged(ids.numpy(), mask.numpy())
        return self.base.lower(ids, mask)

    def infer(self, texts: list[str], truncate: bool = False) -> list[dict]:
        """The answers of ``POST /v1/tenants/{t}/infer`` for ``texts``."""
        logits, enc, ids_list = self.text_logits(texts, truncate)
        out = []
        for i, text in enumerate(texts):
            starts = word_starts(enc, i, text) if self.spec.head == "tagging" else []
            out.append(decode(self.spec, logits[i], [s for s in starts if s[0] < len(ids_list[i]) - 1]))
        return out
