"""The forward pass of the root encoder's upper layers, written once, with the places where a
tenant's adapter enters a layer (its *sites*) left to the caller.

Hosted batched serving fills the sites with every tenant of a batch at once
(``hmi.adapters.batched.GroupSites``); the root alone leaves them empty (``Sites``).  A caller
that runs the frozen linear projections elsewhere (split execution) passes stand-ins for them:
every projection goes through ``Sites.projections`` with the module that computes it.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from hmi.model import kernels
from hmi.model.root import attention_mask

# The query, key and value weights of an attention, concatenated once (keyed by its query module;
# rebuilt when a weight changes): frozen projections run as one GEMM of width 3H.
_FUSED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def fused_projection(linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen ``linears`` (same input) as one weight (sum of D_out, D_in) and bias."""
    key = tuple((t.data_ptr(), t._version) for lin in linears for t in (lin.weight, lin.bias) if t is not None)
    hit = _FUSED.get(linears[0])
    if hit is None or hit[0] != key:
        with torch.no_grad():
            w = torch.cat([lin.weight for lin in linears])
            b = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        hit = _FUSED[linears[0]] = (key, w, b)
    return hit[1], hit[2]


class Sites:
    """The adapter sites of an encoder layer, as the ``adapters`` library places them; this base
    class adds no adapter (the root's own layer).

    - ``projections``: every frozen linear projection of the layer, by site: q, k, v and
      ``attn_out`` of the attention, ``ffn_in`` and ``ffn_out`` of the FFN (LoRA adds its update
      at the first three and the last two), each computed by ``frozen``;
    - ``scaled``: IA3's scaling of keys, values and the FFN's intermediate projection (``k``,
      ``v``, ``ffn``, before the activation);
    - ``attention_output``: the attention block's ``LN(h + x)`` (h its output projection),
      inside which the bottleneck adds ``up(relu(down(h)))``.
    ``li`` is the index of the layer among the upper layers."""

    def projections(self, li: int, sites: tuple[str, ...], x: torch.Tensor,
                    linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        """The projections at ``sites`` with their adapter; here the frozen ones alone.
        Shapes: x (B, T, D_in) -> one (B, T, D_out) per site."""
        return self.frozen(li, sites, x, linears)

    def frozen(self, li: int, sites: tuple[str, ...], x: torch.Tensor,
               linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        """The root's own projections at ``sites`` (run here; split execution runs them on the
        server); several frozen ones of the same input (query, key, value) as one GEMM.
        Shapes: x (B, T, D_in) -> one (B, T, D_out) per site."""
        if len(linears) == 1 or any(lin.weight.requires_grad for lin in linears):
            return [lin(x) for lin in linears]
        w, b = fused_projection(linears)
        return list(kernels.linear(x, w, b).split([lin.out_features for lin in linears], -1))

    def scaled(self, li: int, site: str, t: torch.Tensor) -> torch.Tensor:
        """Shapes: t (B, T, D) -> (B, T, D)."""
        return t

    def attention_output(self, li: int, norm: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Shapes: h, x (B, T, H) -> (B, T, H)."""
        return norm(h + x)


def upper_forward(layers: nn.ModuleList, hidden: torch.Tensor, mask: torch.Tensor, sites: Sites,
                  before_layer=None, relative_bias=None, train: bool = False) -> torch.Tensor:
    """The upper layers, each with ``sites`` filled in.

    Exactly the eager BertLayer (attention, dense, residual + LayerNorm, FFN, residual +
    LayerNorm) when the sites add nothing; with ``train``, its dropouts too, drawn in the
    library's order (the layers' own modules are left in whatever mode they are).  ``before_layer(i)``, when given, is called before
    layer i runs (the scheduler waits there for that layer's adapter weights to be resident);
    ``relative_bias``: an MPNet root's (``hmi.model.root.attention_mask``).
    Shapes: hidden (B, T, H); mask (B, T) -> (B, T, H).
    """
    ext = attention_mask(mask, hidden.dtype, relative_bias)
    for li, layer in enumerate(layers):
        if before_layer is not None:
            before_layer(li)
        hidden = layer_forward(li, layer, hidden, ext, sites, train)
    return hidden


def layer_forward(li: int, layer: nn.Module, x: torch.Tensor, ext: torch.Tensor, sites: Sites,
                  train: bool = False) -> torch.Tensor:
    """One upper layer (index ``li``) with its adapter sites; ``train``: with the layer's dropouts
    (attention probabilities, attention output, FFN output; the adapters see the dropped values,
    as in the library).

    Shapes: x (B, T, H); ext (B, 1, 1, T) or (B, heads, T, T) additive mask -> (B, T, H).
    """
    att = layer.attention.self
    q, k, v = sites.projections(li, ("q", "k", "v"), x, (att.query, att.key, att.value))
    k, v = sites.scaled(li, "k", k), sites.scaled(li, "v", v)
    B, T, H = x.shape
    nh, hd = att.num_attention_heads, att.attention_head_size
    qh = q.view(B, T, nh, hd).transpose(1, 2)
    kh = k.view(B, T, nh, hd).transpose(1, 2)
    vh = v.view(B, T, nh, hd).transpose(1, 2)
    if train and att.dropout.p > 0:  # the library's dropout on the probabilities, drawn in its order
        scores = torch.matmul(qh, kh.transpose(-1, -2)) / math.sqrt(hd) + ext
        ctx = torch.matmul(F.dropout(torch.softmax(scores, dim=-1), att.dropout.p, train), vh)
    else:  # softmax(q k^T / sqrt(hd) + ext) v, fused
        ctx = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=ext.to(qh.dtype))
    ctx = ctx.transpose(1, 2).reshape(B, T, H)
    (h,) = sites.projections(li, ("attn_out",), ctx, (layer.attention.output.dense,))
    h = F.dropout(h, layer.attention.output.dropout.p, train)
    y = sites.attention_output(li, layer.attention.output.LayerNorm, h, x)
    (inter,) = sites.projections(li, ("ffn_in",), y, (layer.intermediate.dense,))
    inter = layer.intermediate.intermediate_act_fn(sites.scaled(li, "ffn", inter))
    (out,) = sites.projections(li, ("ffn_out",), inter, (layer.output.dense,))
    return layer.output.LayerNorm(F.dropout(out, layer.output.dropout.p, train) + y)
