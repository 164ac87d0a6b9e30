"""A private tenant's model on its own side: its adapter and head (the ``adapters`` library's
saved folder, as ``GET /v1/tenants/{t}/adapter`` exports it), the non-linear parts of the root's
upper layers (LayerNorms, activations, attention's softmax, an MPNet root's relative position
bias) and the tokenizer; every frozen linear projection, and the lower layers' PLOT lookup, run
on the server's base executor (``BaseClient``).

The upper layers are ``hmi.model.encoder_layers``' own, the adapter's arithmetic is the hosted
batched kernels' (``GroupSites`` with a pool of one slot): a private tenant computes what the same
adapter served as a hosted tenant computes.

With ``Noise``, what the server sees of each projection's input is hidden by additive noise whose
effect it computed once (Symbiosis, section 3.8): the client sends ``x + n``, receives
``(x + n) W^T + b`` and subtracts ``n W^T``.
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

from hmi.adapters.batched import Group, GroupSites, batched_heads, segment_plan
from hmi.adapters.heads import decode, word_starts
from hmi.adapters.pool import SlotPool
from hmi.adapters.portable import RootShape, read_encoder
from hmi.model import encoder_layers
from hmi.model.convert import load_relative_bias
from hmi.model.hplm import as_numpy_ids
from hmi.model.root import load_tokenizer
from hmi.split.client import BaseClient
from hmi.textlimit import fit_ids

SITE_PROJECTION = {"attn_out": "attn_out", "ffn_in": "ffn_in", "ffn_out": "ffn_out"}


class OnServer(nn.Module):
    """Stands where a frozen linear projection was: it runs on the server, never here."""

    def forward(self, x):
        raise RuntimeError("a frozen projection runs on the server's base executor")


def upper_layers(model_dir: str | Path, l_low: int) -> tuple[nn.ModuleList, BertConfig]:
    """The root's upper layers with their non-linear parameters only: the LayerNorms read from the
    checkpoint, every linear projection an ``OnServer`` stand-in (its weights are never read)."""
    config = BertConfig.from_pretrained(str(model_dir), local_files_only=True)
    config._attn_implementation = "eager"
    layers = nn.ModuleList()
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for i in range(l_low, config.num_hidden_layers):
            layer = BertLayer(config)
            att = layer.attention.self
            att.query = att.key = att.value = OnServer()
            layer.attention.output.dense = layer.intermediate.dense = layer.output.dense = OnServer()
            for norm, name in ((layer.attention.output.LayerNorm, "attention.output.LayerNorm"),
                               (layer.output.LayerNorm, "output.LayerNorm")):
                for p in ("weight", "bias"):
                    key = next(k for k in (f"encoder.layer.{i}.{name}.{p}", f"bert.encoder.layer.{i}.{name}.{p}")
                               if k in keys)
                    getattr(norm, p).data.copy_(f.get_tensor(key))
            layers.append(layer.eval().requires_grad_(False))
    return layers, config


class Noise:
    """Per (layer, projection), ``count`` noise vectors n_k (D_in,) of standard deviation ``scale``
    drawn once, with their effect n_k W^T (no bias) asked of the server once; the calls rotate
    through them."""

    def __init__(self, base: BaseClient, scale: float = 1.0, count: int = 4, seed: int = 0):
        self.base, self.scale, self.count = base, scale, count
        self.gen = torch.Generator().manual_seed(seed)
        self._values: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._turn: dict[tuple[int, str], int] = {}

    def hide(self, layer: int, projection: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + n, n W^T) for this call's noise value n.  Shapes: x (..., D_in) -> (..., D_in), (D_out,)."""
        key = (layer, projection)
        if key not in self._values:
            n = torch.randn(self.count, x.shape[-1], generator=self.gen) * self.scale
            self._values[key] = (n, self.base.linear(layer, projection, "nobias", n))
        k = self._turn.get(key, 0)
        self._turn[key] = (k + 1) % self.count
        n, effects = self._values[key]
        return x + n[k], effects[k]


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
                 noise: Noise | None = None, grad: bool = False):
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


class PrivateModel:
    """A private tenant's hPLM: ``infer(texts)`` answers as the hosted route does."""

    def __init__(self, base: BaseClient, model_dir: str | Path, l_low: int, adapter_files: dict[str, bytes],
                 noise: Noise | None = None, max_len: int = 128):
        self.base, self.l_low, self.noise, self.max_len = base, l_low, noise, max_len
        self.layers, config = upper_layers(model_dir, l_low)
        self.config = config
        self.tokenizer = load_tokenizer(str(model_dir))
        self.relative_bias = load_relative_bias(Path(model_dir), config)
        shape = RootShape(config.model_type, config.hidden_size, config.num_hidden_layers, l_low, config.hidden_size)
        self.spec, weights = read_encoder(adapter_files, shape)
        self.pool = SlotPool(self.spec.signature(config.hidden_size), 1, len(self.layers), config.hidden_size,
                             config.intermediate_size, max(2, self.spec.num_labels), scaling=self.spec.scaling)
        self.pool.write(0, weights)

    @staticmethod
    def files_of(archive: bytes) -> dict[str, bytes]:
        """The files of a zipped adapter folder (what ``GET /v1/tenants/{t}/adapter`` answers)."""
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            return {Path(n).name: zf.read(n) for n in zf.namelist() if not n.endswith("/")}

    def weights(self) -> dict[str, torch.Tensor]:
        """The adapter's and head's weights in the canonical layout (what an export holds)."""
        return self.pool.read(0, self.spec.num_labels)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.pool.write(0, weights)

    def parameters(self) -> list[torch.Tensor]:
        """The adapter's and head's tensors (the pool's one slot), made trainable."""
        params = [t for layer in self.pool.layers for t in layer.values()]
        if self.pool.max_labels:
            params += [self.pool.head_w, self.pool.head_b]
        return [p.requires_grad_(True) for p in params]

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """The head's logits for the upper layers' input ``hidden`` (``BaseClient.lower``); with
        ``grad``, differentiable in ``parameters()`` through the server's projections.
        Shapes: hidden (B, T, H); mask (B, T) -> (B, T, C_max)."""
        b = hidden.shape[0]
        group = Group(torch.arange(b), torch.zeros(b, dtype=torch.long), self.pool, True, segment_plan([0] * b))
        sites = RemoteSites([group], self.base, self.l_low, mask, self.noise, grad=grad)
        out = encoder_layers.upper_forward(self.layers, hidden, mask, sites, relative_bias=self.relative_bias)
        tagging = torch.full((b,), self.spec.head == "tagging")
        mean = torch.full((b,), self.spec.pooling == "mean")
        return batched_heads(out, [group], tagging, mask, mean)

    def logits(self, texts: list[str], truncate: bool = False):
        """(logits (B, T, C_max), the batch's encoding, its token ids) of texts read as the hosted
        route reads them (``fit_ids``: refused past ``max_len`` unless ``truncate``)."""
        enc = self.tokenizer(texts, truncation=False, return_offsets_mapping=True)
        ids_list = [fit_ids(ids, self.max_len, truncate)[0] for ids in enc["input_ids"]]
        ids, mask = (torch.from_numpy(a) for a in as_numpy_ids(ids_list))
        with torch.no_grad():
            return self.forward(self.base.lower(ids, mask), mask), enc, ids_list

    def infer(self, texts: list[str], truncate: bool = False) -> list[dict]:
        """The answers of ``POST /v1/tenants/{t}/infer`` for ``texts``."""
        logits, enc, ids_list = self.logits(texts, truncate)
        out = []
        for i, text in enumerate(texts):
            starts = word_starts(enc, i, text) if self.spec.head == "tagging" else []
            out.append(decode(self.spec, logits[i], [s for s in starts if s[0] < len(ids_list[i]) - 1]))
        return out
