"""Stage C of the scheduler's pipeline (``hmi.scheduler.pipeline.Scheduler``): a prepared batch's
rows through the root's layers with each tenant's adapter, then the heads.

A batch is split when it holds more tenants than the pools have slots (``split_by_pools``), and
into groups of similar length where padding to the longest would cost more (``split_by_length``).
The rows of ``whole`` tenants (served on the full root; stage R gave them the root's embeddings)
run the lower layers with their adapters first, in passes of their own, and their states then join
every other row in the upper layers' pass, where their pools' groups read layers from the split
on (``Group.offset``).  Stage A (``hmi.scheduler.residency``) makes each pass's adapters resident
layer by layer; a layer runs once its weights have landed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from hmi.adapters.batched import batched_heads, upper_forward
from hmi.adapters.heads import decode
from hmi.adapters.pool import PoolExhaustedError
from hmi.model.kernels import bf16_matmuls
from hmi.scheduler.residency import ResidencyManager
from hmi.scheduler.trace import Tracer
from hmi.scheduler.types import InferRequest, Prepared, TenantEntry, fail

# What one more pass through the upper layers costs beyond its token rows, in token rows: the
# layers and heads alone cost 34 on the default root, 2 cores (docs/results/bench_lengths.md); twice that
# for the residency work and the gathers of a pass that the fit leaves out.
PASS_OVERHEAD_TOKENS = 64


@dataclass(frozen=True)
class ComputeConfig:
    """What stage C takes of ``SchedulerConfig``: the pools' slots, grouping by length, batched
    adapters (else a pass per tenant), copies pipelined with compute, bf16 products."""

    pool_slots: int
    length_groups: bool
    batched_adapters: bool
    pipeline_swap: bool
    bf16: bool


class Compute:
    """Stage C for one scheduler: ``layers`` every layer of the root on the device, split at
    ``l_low``; ``relative_bias`` an MPNet root's; ``residency`` the device pools; ``pooling`` the
    root's sentence embedding (embedding requests); ``stats`` the scheduler's counters."""

    def __init__(self, layers: torch.nn.ModuleList, l_low: int, relative_bias, residency: ResidencyManager,
                 pooling, device: torch.device, tracer: Tracer, stats: dict, cfg: ComputeConfig):
        self.l_low, self.lower_layers, self.layers = l_low, layers[:l_low], layers[l_low:]
        self.relative_bias, self.residency, self.pooling = relative_bias, residency, pooling
        self.device, self.tracer, self.stats, self.cfg = device, tracer, stats, cfg
        self.hidden = residency.hidden

    def run(self, p: Prepared) -> None:
        """Stages A and C for one prepared batch, split when it holds more tenants than slots, and
        into groups of similar length where padding to the longest would cost more: the rows of
        ``whole`` tenants through the lower layers first (passes of their own), then every row
        through the upper layers."""
        lengths = p.mask.sum(1).tolist()
        hidden = p.hidden.to(self.device, non_blocking=True)  # each row's input to the pass it runs next
        for pool_rows in split_by_pools(p.entries, self.hidden, self.cfg.pool_slots):
            lower = self._passes([r for r in pool_rows if p.entries[r].whole], lengths, p.entries)
            upper = self._passes(pool_rows, lengths, p.entries)
            self.stats["length_groups"] += len(lower) + len(upper) - 1
            for rows in lower:
                self._lower_rows(p, hidden, rows)
            for rows in upper:
                self._upper_rows(p, hidden, rows)
        self.stats["batches"] += 1
        self.stats["requests"] += len(p.requests)

    def _passes(self, rows: list[int], lengths: list[int], entries: list[TenantEntry]) -> list[list[int]]:
        """``rows`` as the passes that run them: groups of similar length (``split_by_length``), each
        split by tenant where adapters are not batched (``entries``: the batch's, one per row)."""
        if not rows:
            return []
        groups = split_by_length(rows, lengths, PASS_OVERHEAD_TOKENS) if self.cfg.length_groups else [rows]
        if self.cfg.batched_adapters:
            return groups
        out = []
        for group in groups:
            by_tenant = defaultdict(list)
            for r in group:
                by_tenant[entries[r].name].append(r)
            out += list(by_tenant.values())
        return out

    def _rows_in(self, p: Prepared, hidden: torch.Tensor, rows: list[int]):
        """The pass's entries, inputs (n, T, H) and mask (n, T), T its longest row, on the device."""
        entries = [p.entries[r] for r in rows]
        if len(rows) == len(p.requests):
            x, mask = hidden, p.mask.to(self.device, non_blocking=True)
        else:
            idx = torch.tensor(rows)
            x = hidden.index_select(0, idx.to(hidden.device))
            mask = p.mask.index_select(0, idx).to(self.device, non_blocking=True)
        T = int(mask.sum(1).max())
        return entries, x[:, :T], mask[:, :T]

    def _acquire(self, p: Prepared, rows: list[int], entries: list[TenantEntry], whole_offset: int):
        """The pass's residency (``whole`` pools read from their layer ``whole_offset`` on), or None
        with its requests failed when the pools cannot hold its tenants."""
        with self.tracer.span("A:acquire", p.batch_id):
            try:
                res = self.residency.acquire(entries, p.weights, pipelined=self.cfg.pipeline_swap,
                                             whole_offset=whole_offset)
            except PoolExhaustedError as exc:
                for r in rows:
                    fail(p.requests[r], exc)
                return None
        self.stats["adapters_loaded"] += res.loaded
        return res

    def _lower_rows(self, p: Prepared, hidden: torch.Tensor, rows: list[int]) -> None:
        """The lower layers of the root, each ``whole`` tenant with its adapter, on those rows'
        embeddings; their states are written over their rows of ``hidden`` (B, T, H)."""
        entries, x, mask = self._rows_in(p, hidden, rows)
        res = self._acquire(p, rows, entries, 0)
        if res is None:
            return
        try:
            with self.tracer.span("C:lower", p.batch_id, size=len(rows), loaded=res.loaded):
                with torch.no_grad(), bf16_matmuls(self.cfg.bf16):
                    out = upper_forward(self.lower_layers, x, mask, res.groups, before_layer=res.wait_layer,
                                        relative_bias=self.relative_bias)
        finally:
            self.residency.release(res)
        hidden[torch.tensor(rows, device=hidden.device), :out.shape[1]] = out

    def _upper_rows(self, p: Prepared, hidden: torch.Tensor, rows: list[int]) -> None:
        entries, x, mask = self._rows_in(p, hidden, rows)
        res = self._acquire(p, rows, entries, self.l_low)
        if res is None:
            return
        embed = [p.requests[r].embed for r in rows]
        try:
            with self.tracer.span("C:upper", p.batch_id, size=len(rows), loaded=res.loaded):
                with torch.no_grad(), bf16_matmuls(self.cfg.bf16):
                    out = upper_forward(self.layers, x, mask, res.groups,
                                        before_layer=res.wait_layer,
                                        relative_bias=self.relative_bias)
                    res.wait_head()
                    logits = vectors = None
                    if not all(embed):
                        specs = [e.spec for e in entries]  # None: the root's rows, all embeddings
                        tagging = torch.tensor([s is not None and s.head == "tagging" for s in specs], device=self.device)
                        mean = torch.tensor([s is not None and s.pooling == "mean" for s in specs], device=self.device)
                        logits = batched_heads(out, res.groups, tagging, mask, mean).float().cpu()
                    if any(embed):
                        vectors = self.pooling(out, mask).float().cpu()
        finally:
            self.residency.release(res)
        n_tokens = mask.sum(1).tolist()
        for j, r in enumerate(rows):
            req = p.requests[r]
            if req.embed:
                _embedded(req, vectors[j], int(n_tokens[j]), p.truncated[r])
            else:
                _resolve(req, entries[j], logits[j], p.word_starts[r], p.truncated[r])


def split_by_pools(entries: list[TenantEntry], hidden: int, pool_slots: int) -> list[list[int]]:
    """The rows of a batch (one entry each) in consecutive subsets whose distinct tenants per
    adapter signature fit ``pool_slots``."""
    parts, current, seen = [], [], defaultdict(set)
    for r, e in enumerate(entries):
        if e.spec is None:  # the root: no slot
            current.append(r)
            continue
        sig = e.spec.pool_key(hidden)
        if e.name not in seen[sig] and len(seen[sig]) >= pool_slots:
            parts.append(current)
            current, seen = [], defaultdict(set)
        seen[sig].add(e.name)
        current.append(r)
    if current:
        parts.append(current)
    return parts


def split_by_length(rows: list[int], lengths: list[int], overhead: int) -> list[list[int]]:
    """``rows`` in groups of similar length, so that a batch of long and short texts is not padded
    to its longest: of the partitions of the rows sorted by length into consecutive runs, the one
    that computes the fewest token rows, each group costing ``overhead + size x its longest``
    (dynamic programming over the sorted rows, O(n^2)); ``[rows]`` unchanged when one group is best.
    ``lengths[r]`` is row r's token count."""
    order = sorted(rows, key=lambda r: lengths[r])
    best, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # best[j]: the first j sorted rows; the last group order[i:j]
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + overhead + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return [rows] if len(groups) <= 1 else groups[::-1]


def _resolve(req: InferRequest, entry: TenantEntry, logits: torch.Tensor, starts, truncated: bool) -> None:
    if not req.future.done():
        out = decode(entry.spec, logits, starts)
        req.future.set_result({**out, "truncated": True} if truncated else out)


def _embedded(req: InferRequest, vector: torch.Tensor, n_tokens: int, truncated: bool) -> None:
    if not req.future.done():
        req.future.set_result({"embedding": vector.numpy(), "tokens": n_tokens, "truncated": truncated})


