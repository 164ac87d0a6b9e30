"""The forward pass of the decoder root's (Llama's) upper layers over a KV cache, written once,
with the LoRA sites (query and value projections) left to the caller.

The generation engine (``hmi.hgpt.generation``) runs them for the new tokens of several
requests at once, each reading and extending its own row of the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# lora(li, site, x) -> the update a tenant's LoRA adds to the projection of x at ``site``
# (q or v) of upper layer li.  Shapes: x (B, Tq, H) -> (B, Tq, D_out).
LoraFn = Callable[[int, str, torch.Tensor], torch.Tensor]


@dataclass
class KVCache:
    """Keys and values of every upper layer for ``R`` cache rows (one a request).
    Shapes: k[li], v[li] (R, kv_heads, max_len, head_dim)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass(frozen=True)
class Step:
    """Where a batch's new tokens sit: token j of request b is at position starts[b] + j of cache
    row rows[b]; the first q_lens[b] of its Tq tokens are real.  ``mask`` (B, Tq, Lk) additive:
    each token sees the cached positions before it and the new tokens up to itself;
    ``cos``/``sin``: the rotary embedding of the positions.  Lk = max(starts + q_lens)."""

    rows: torch.Tensor
    starts: torch.Tensor
    q_lens: torch.Tensor
    mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def upper_forward(layers: nn.ModuleList, h: torch.Tensor, step: Step, cache: KVCache, heads: int, kv_heads: int,
                  head_dim: int, lora: LoraFn) -> torch.Tensor:
    """The upper layers for new tokens of several requests, with their KV cache and LoRA.

    Exactly Llama's decoder layer (RMSNorm, attention with rotary positions and grouped-query
    heads, residual, RMSNorm, gated MLP, residual), the new keys/values written to the cache rows.
    Shapes: h (B, Tq, H) -> (B, Tq, H) (before the final norm).
    """
    for li, layer in enumerate(layers):
        h = layer_forward(li, layer, h, step, cache, heads, kv_heads, head_dim, lora)
    return h


def layer_forward(li: int, layer: nn.Module, h: torch.Tensor, step: Step, cache: KVCache, heads: int,
                  kv_heads: int, head_dim: int, lora: LoraFn) -> torch.Tensor:
    """One upper layer (index ``li``).  Shapes: h (B, Tq, H) -> (B, Tq, H)."""
    B, Tq, _ = h.shape
    att = layer.self_attn
    x = layer.input_layernorm(h)
    q = att.q_proj(x) + lora(li, "q", x)
    k = att.k_proj(x)
    v = att.v_proj(x) + lora(li, "v", x)
    q = q.view(B, Tq, heads, head_dim).transpose(1, 2)
    k = k.view(B, Tq, kv_heads, head_dim).transpose(1, 2)
    v = v.view(B, Tq, kv_heads, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, step.cos, step.sin)
    K, V = _write_and_read(cache.k[li], cache.v[li], k, v, step)
    # Query heads grouped by their key/value head (GQA) so keys and values are not repeated.
    qg = q.view(B, kv_heads, heads // kv_heads, Tq, head_dim)
    scores = torch.matmul(qg, K.transpose(-1, -2)) / math.sqrt(head_dim) + step.mask.unsqueeze(1)
    ctx = torch.matmul(torch.softmax(scores, dim=-1), V).view(B, heads, Tq, head_dim)
    ctx = ctx.transpose(1, 2).reshape(B, Tq, heads * head_dim)
    h = h + att.o_proj(ctx)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _write_and_read(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new keys/values (j < q_lens[b]) to the cache rows and reads back the first Lk
    positions of the batch's rows.
    Shapes: kc, vc (R, kv_heads, L, hd); k, v (B, kv_heads, Tq, hd) -> K, V (B, kv_heads, 1, Lk, hd)."""
    rows, starts, q_lens = step.rows, step.starts, step.q_lens
    if k.shape[2] == 1:
        kc[rows, :, starts] = k[:, :, 0]
        vc[rows, :, starts] = v[:, :, 0]
    else:
        for b in range(k.shape[0]):
            s, n = int(starts[b]), int(q_lens[b])
            kc[rows[b], :, s:s + n] = k[b, :, :n]
            vc[rows[b], :, s:s + n] = v[b, :, :n]
    lk = step.mask.shape[-1]
    return kc[:, :, :lk].index_select(0, rows).unsqueeze(2), vc[:, :, :lk].index_select(0, rows).unsqueeze(2)
