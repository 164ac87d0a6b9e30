"""The shared upper layers run once for a batch that mixes tenants, each with its own adapter.

Each group of requests with the same adapter signature (kind and size) reads its weights from
one stacked pool: per-request slot indices select the weights (``index_select``), and one
``bmm``/``baddbmm`` applies all of them; a group of one tenant runs one GEMM over all its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from hmi.model import encoder_layers
from hmi.model.encoder_layers import Sites


@dataclass(frozen=True)
class SegmentPlan:
    """What the layer loop needs to know of a group's per-request slots, worked out on the host
    once per batch (the slots are known there), so the loop never waits on the device:
    ``u`` distinct slots, ``first`` the smallest (the only one when u == 1)."""

    u: int
    first: int


def segment_plan(slots: list[int] | torch.Tensor) -> SegmentPlan:
    """The SegmentPlan of per-request slots (a host list; a tensor is read back once)."""
    if isinstance(slots, torch.Tensor):
        slots = slots.tolist()
    return SegmentPlan(len(set(slots)), min(slots, default=0))


def segment_bmm(x: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                plan: SegmentPlan | None = None) -> torch.Tensor:
    """Each request's rows times its own weight matrix, all requests at once.

    Semantics: y[n] = x[n] @ w[slots[n]] (+ b[slots[n]])
    Shapes: x (N, T, Din); slots (N,) int64 in [0, S); w (S, Din, Dout); b (S, Dout) -> y (N, T, Dout).
    One tenant: one GEMM over all rows.  Several: each request's matrix gathered (``index_select``,
    on the device, Din x Dout a request: LoRA's and the bottleneck's are small) and one ``bmm``; a
    thin output (Dout < T: LoRA's A, the bottleneck's down-projection, a tagging head) is computed
    transposed, y[n]^T = w[s]^T x[n]^T, where the CPU's batched GEMM runs up to 3.5x faster; the result
    is then a transposed view.  ``plan`` (``segment_plan`` of the same slots) makes the call free
    of host-device synchronization; without it the slots are read back.
    """
    n, t, d_in = x.shape
    if plan is None:
        plan = segment_plan(slots)
    if plan.u == 1:  # one tenant: a single GEMM over all rows, no gather
        y = torch.matmul(x, w[plan.first])
        return y if b is None else y + b[plan.first]
    wg = w.index_select(0, slots)
    if w.shape[2] < t:  # (N, Dout, Din) @ (N, Din, T) -> (N, Dout, T), viewed as (N, T, Dout)
        bias = None if b is None else b.index_select(0, slots).unsqueeze(2)
        wt, xt = wg.transpose(1, 2), x.transpose(1, 2)
        return (torch.bmm(wt, xt) if bias is None else torch.baddbmm(bias, wt, xt)).transpose(1, 2)
    if b is None:
        return torch.bmm(x, wg)
    return torch.baddbmm(b.index_select(0, slots).unsqueeze(1), x, wg)


def batched_bottleneck(a: torch.Tensor, slots: torch.Tensor, down_w, down_b, up_w, up_b,
                       plan: SegmentPlan | None = None) -> torch.Tensor:
    """Bottleneck adapter branch of each request.

    Semantics: u[n] = relu(a[n] @ down_w[slots[n]] + down_b[slots[n]]) @ up_w[slots[n]] + up_b[slots[n]]
    Shapes: a (N, T, H); slots (N,); down_w (S, H, r); down_b (S, r); up_w (S, r, H); up_b (S, H) -> (N, T, H).
    """
    return segment_bmm(torch.relu(segment_bmm(a, slots, down_w, down_b, plan)), slots, up_w, up_b, plan)


def batched_lora(x: torch.Tensor, slots: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, scaling: float,
                 plan: SegmentPlan | None = None) -> torch.Tensor:
    """LoRA update of a projection for each request.

    Semantics: delta[n] = scaling * x[n] @ A[slots[n]]^T @ B[slots[n]]^T
    Shapes: x (N, T, D_in); a_t (S, D_in, r) (= A^T); b_t (S, r, D_out) (= B^T) -> (N, T, D_out).
    """
    xa = segment_bmm(x, slots, a_t, plan=plan)  # (N, T, r): scaled here, r/D_out of the work
    return segment_bmm(xa if scaling == 1.0 else xa * scaling, slots, b_t, plan=plan)


@dataclass
class Group:
    """Requests of one batch that use one pool: their row indices and slot indices."""

    rows: torch.Tensor  # (n,) int64 rows of the batch
    slots: torch.Tensor  # (n,) int64 slots in the pool
    pool: object  # hmi.adapters.pool.SlotPool
    all_rows: bool = False  # the group covers the whole batch in order (no gather/scatter needed)
    plan: SegmentPlan | None = None  # segment_plan(slots), made on the host with the group
    # the pool's layer that layer ``li`` of the pass reads: li + offset (a ``whole`` tenant's pool holds
    # every layer of the root, so in a pass of the upper layers its layers start at the split)
    offset: int = 0


class GroupSites(Sites):
    """The adapter sites of a batch that mixes tenants: each group's adapter on its own rows,
    all of a group's tenants in one batched kernel (``hmi.model.encoder_layers.upper_forward``
    runs the layers).  The sites of the ``adapters`` library: LoRA on the projections its pool
    targets (query, key, value, the FFN's first and second layer; by default query and value),
    IA3 scaling of keys, values and the FFN's intermediate projection (before its activation), and
    the bottleneck adapter after the attention block: ``LN(h + x + up(relu(down(h))))`` with h the
    attention output projection and x the layer input (the library's default BnConfig)."""

    def __init__(self, groups: list[Group]):
        self.groups = groups

    def projections(self, li: int, sites: tuple[str, ...], x: torch.Tensor,
                    linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        """The projections of ``x`` at ``sites`` plus, on the rows of each LoRA group that targets
        a site, their tenant's update ``scaling * x @ A^T @ B^T``; a group's rows of ``x`` are
        gathered once for all its sites.  Shapes: x (B, T, D_in) -> one (B, T, D_out) per site."""
        ys = self.frozen(li, sites, x, linears)
        for g in self.groups:
            p = g.pool
            hit = [i for i, site in enumerate(sites) if p.kind == "lora" and site in p.targets]
            if not hit:
                continue
            xs, lw = x if g.all_rows else x.index_select(0, g.rows), p.layer(li + g.offset)
            for i in hit:
                delta = batched_lora(xs, g.slots, lw[f"{sites[i]}_A"], lw[f"{sites[i]}_B"], p.scaling, g.plan)
                if not g.all_rows:
                    ys[i] = ys[i].index_add(0, g.rows, delta)
                elif torch.is_grad_enabled():
                    ys[i] = ys[i] + delta
                else:  # serving: the update lands in the projection's own output
                    ys[i].add_(delta)
        return ys

    def scaled(self, li: int, site: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` with the rows of each IA3 group scaled by their tenant's vector at ``site`` (k, v,
        ffn).  Shapes: t (B, T, D) -> (B, T, D)."""
        for g in self.groups:
            if g.pool.kind == "ia3":
                s = g.pool.layer(li + g.offset)[site].index_select(0, g.slots).unsqueeze(1)
                t = t * s if g.all_rows else t.index_copy(0, g.rows, t.index_select(0, g.rows) * s)
        return t

    def attention_output(self, li: int, norm: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention block's output ``LN(h + x)``, with ``+ up(relu(down(h)))`` inside the norm
        for the rows of bottleneck groups (h = the attention's output projection).
        Shapes: h, x (B, T, H) -> (B, T, H)."""
        groups = self.groups
        pre = h + x
        if not any(g.pool.kind == "bottleneck" for g in groups):
            return norm(pre)
        ys = []
        y = norm(pre) if any(g.pool.kind != "bottleneck" for g in groups) else None
        for g in groups:
            if g.pool.kind != "bottleneck":
                continue
            lw = g.pool.layer(li + g.offset)
            rows_h = h if g.all_rows else h.index_select(0, g.rows)
            rows_pre = pre if g.all_rows else pre.index_select(0, g.rows)
            out = norm(rows_pre + batched_bottleneck(rows_h, g.slots, lw["down_w"], lw["down_b"],
                                                             lw["up_w"], lw["up_b"], g.plan))
            ys.append((g, out))
        if y is None and len(ys) == 1 and ys[0][0].all_rows:
            return ys[0][1]
        y = norm(pre) if y is None else y
        for g, out in ys:
            y[g.rows] = out
        return y


def upper_forward(layers: nn.ModuleList, hidden: torch.Tensor, mask: torch.Tensor, groups: list[Group],
                  before_layer=None, relative_bias=None) -> torch.Tensor:
    """The shared upper layers with each request's adapter applied (``GroupSites``).
    Shapes: hidden (B, T, H); mask (B, T) -> (B, T, H)."""
    return encoder_layers.upper_forward(layers, hidden, mask, GroupSites(groups), before_layer, relative_bias)


def pooled(hidden: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor | bool) -> torch.Tensor:
    """The sentence vector a classification head reads: [CLS] or the mean of the real tokens.

    Semantics: v[n] = mean over t with mask[n, t] = 1 of hidden[n, t] where mean[n], else hidden[n, 0].
    Shapes: hidden (B, T, H); mask (B, T) {0,1}; mean (B,) bool or one bool -> v (B, H).
    """
    cls = hidden[:, 0]
    if isinstance(mean, bool) and not mean:
        return cls
    m = mask.to(hidden.dtype).unsqueeze(-1)
    avg = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    if isinstance(mean, bool):
        return avg
    return torch.where(mean.unsqueeze(-1), avg, cls)


@lru_cache(maxsize=None)
def head_activation(name: str | None):
    """The activation between a head's layers as the ``adapters`` library applies it:
    transformers' ``get_activation`` of the lower-cased name, ``leakyrelu`` as torch's, None none."""
    if name is None:
        return lambda x: x
    if name.lower() == "leakyrelu":
        return torch.nn.functional.leaky_relu
    from transformers.activations import get_activation

    return get_activation(name.lower())


def head_hidden(x: torch.Tensor, slots: torch.Tensor, pool) -> torch.Tensor:
    """The hidden layers of each request's head, before its labels' layer.

    Semantics: x <- act(x[n] @ Wh[slot, j] + bh[slot, j]) for j = 0 .. L - 2 (L the pool's head
    layers; nothing for one-layer heads).  Shapes: x (N, T, H); slots (N,) -> (N, T, H).
    """
    act = head_activation(pool.head_activation)
    for j in range(pool.head_layers - 1):
        x = act(segment_bmm(x, slots, pool.head_hidden_w[:, j], pool.head_hidden_b[:, j]))
    return x


def batched_heads(hidden: torch.Tensor, groups: list[Group], tagging: torch.Tensor,
                  mask: torch.Tensor | None = None, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Each request's own head: classification on [CLS] or on the token mean, or per-token tagging.

    Semantics: logits[n] = head_hidden(pooled(hidden, mask, mean)[n]) @ W[slot] + b[slot]
               (classification), or head_hidden(hidden[n]) @ W[slot] + b[slot] for every token
               (tagging); padded to C_max labels (``head_hidden``: the hidden layers of heads with
               more than one, else nothing).
    Shapes: hidden (B, T, H); tagging (B,) bool; mask (B, T) and mean (B,) bool (both or neither;
    without them every classification row reads [CLS]) -> logits (B, T, C_max) (classification
    rows carry their logits at position 0).
    """
    if mean is not None and not bool(mean.any()):
        mean = None
    vec = hidden[:, :1] if mean is None else pooled(hidden, mask, mean).unsqueeze(1)
    B, T, _ = hidden.shape
    cmax = max(g.pool.max_labels for g in groups)
    logits = hidden.new_zeros(B, T, cmax)
    for g in groups:
        hs = hidden if g.all_rows else hidden.index_select(0, g.rows)
        vs = vec if g.all_rows else vec.index_select(0, g.rows)
        tag = tagging if g.all_rows else tagging.index_select(0, g.rows)
        w, b = g.pool.head_w, g.pool.head_b
        out = hs.new_zeros(hs.shape[0], T, g.pool.max_labels)
        if bool(tag.any()):
            tr = torch.nonzero(tag).squeeze(1)
            slots = g.slots.index_select(0, tr)
            out[tr] = segment_bmm(head_hidden(hs.index_select(0, tr), slots, g.pool), slots, w, b)
        if not bool(tag.all()):
            cr = torch.nonzero(~tag).squeeze(1)
            slots = g.slots.index_select(0, cr)
            out[cr, :1] = segment_bmm(head_hidden(vs.index_select(0, cr), slots, g.pool), slots, w, b)
        logits[g.rows, :, : g.pool.max_labels] = out
    return logits
