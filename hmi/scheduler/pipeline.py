"""The scheduler: batches of infer requests through R -> A -> C, pipelined.

* R (retrieval, ``hmi.scheduler.retrieval``, a thread pool): tokenize, check, read adapters into host memory, PLOT lookup +
  merge per domain chain.  R of batch k+1 runs while C of batch k computes.
* A (residency, a staging worker or a CUDA copy stream): copy the batch's missing adapters into
  the device pools layer by layer; C of layer l starts once layer l has landed.
* C (compute, one thread): the shared upper layers with batched adapters, then the heads (the rows
  of ``whole`` tenants, which stage R gave the root's embeddings, first run the lower layers of the
  root with their adapters, in passes of their own, then join the other rows in the upper layers);
  their linear layers' products in bf16 with fp32 accumulation when ``upper_precision`` is ``bf16``
  (CPUs that multiply bf16 natively; everything else, the PLOT values included, stays fp32).
  A batch of long and short texts runs in groups of similar length (``split_by_length``).

Contract: ``submit`` is called by the dispatcher (any thread) and returns one future per request;
a failing request fails alone.  ``shutdown`` finishes queued work (or fails it with
``cancel=True``) and never hangs.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import queue
import sys
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hmi.adapters.batched import batched_heads, upper_forward
from hmi.adapters.heads import decode
from hmi.adapters.pool import PoolExhaustedError
from hmi.adapters.store import AdapterStore
from hmi.model.kernels import NATIVE_BF16, bf16_matmuls
from hmi.model.root import SentencePooling
from hmi.scheduler.residency import ResidencyManager
from hmi.scheduler.retrieval import Retrieval
from hmi.scheduler.trace import Tracer
from hmi.scheduler.types import (
    InferRequest,
    LookupSource,
    Prepared,
    QueueFullError,
    SchedulerClosedError,
    TenantEntry,
    TenantView,
    fail,
)

_STOP = object()
log = logging.getLogger("hmi.scheduler")


@dataclass
class SchedulerConfig:
    max_batch: int = 32
    max_len: int = 128
    pool_slots: int = 64
    pipeline_retrieval: bool = True
    pipeline_swap: bool = True
    batched_adapters: bool = True
    retrieval_threads: int = 2
    queue_depth: int = 2  # prepared batches waiting for compute
    max_pending: int = 256  # submitted batches waiting for retrieval
    device: str = "auto"
    max_labels: int = 32  # the widest head the pools hold
    trace: bool = False
    # Python's GIL hand-over interval (process-wide) while a scheduler runs.  Stage C releases the
    # GIL inside every kernel and needs it back between kernels; with the default 5 ms a stage-R
    # thread running Python (PLOT reads, merging) keeps C waiting for up to 5 ms at each hand-over.
    gil_switch_interval_s: float | None = 0.0005
    # The shared upper layers' linear products: fp32, or bf16 with fp32 accumulation (about 1.4x
    # the rows/s where the CPU multiplies bf16 natively; scores differ from fp32 by up to about 5e-3).
    upper_precision: str = "fp32"
    # A batch of long and short texts runs as groups of similar length instead of padded to its
    # longest, where that computes fewer token rows counting each further pass as
    # PASS_OVERHEAD_TOKENS (``split_by_length``); off: one pass per pool split.
    length_groups: bool = True


PRECISIONS = ("fp32", "bf16")
# What one more pass through the upper layers costs beyond its token rows, in token rows: the
# layers and heads alone cost 34 on the default root, 2 cores (docs/results/bench_lengths.md); twice that
# for the residency work and the gathers of a pass that the fit leaves out.
PASS_OVERHEAD_TOKENS = 64


def check_precision(name: str, device: torch.device) -> None:
    """Refuses, with the reason, an upper-layer precision this device would not run faster."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown upper-layer precision {name!r}; use one of {', '.join(PRECISIONS)}")
    if name == "bf16" and (device.type != "cpu" or not NATIVE_BF16):
        where = "a CPU without native bf16 (no avx512_bf16 or amx_bf16 flag)" if device.type == "cpu" else device.type
        raise ValueError(f"upper-layer precision bf16 runs on CPUs that multiply bf16 natively; this is {where}: "
                         "use fp32")


def pick_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` (refused with a clear error when no GPU is usable) or ``auto``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or auto")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no usable GPU")
    return torch.device(name)


class Scheduler:
    def __init__(self, bert, l_low: int, tokenizer, store: AdapterStore,
                 tenants: TenantView, lookups: LookupSource,
                 cfg: SchedulerConfig | None = None, pooling: SentencePooling = SentencePooling()):
        self.cfg = cfg or SchedulerConfig()
        self.pooling = pooling  # the root's sentence embedding (embedding requests)
        if self.cfg.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.cfg.gil_switch_interval_s)
        self.device = pick_device(self.cfg.device)
        check_precision(self.cfg.upper_precision, self.device)
        self._bf16 = self.cfg.upper_precision == "bf16"
        every = torch.nn.ModuleList(bert.encoder.layer)
        self.all_layers = copy.deepcopy(every).to(self.device) if self.device.type != "cpu" else every
        self.l_low = l_low
        self.lower_layers = self.all_layers[:l_low]  # what a whole tenant's rows run first
        self.layers = self.all_layers[l_low:]  # what every row runs
        bias = getattr(bert, "relative_bias", None)
        self.relative_bias = copy.deepcopy(bias).to(self.device) if bias is not None and self.device.type != "cpu" else bias
        self.store = store
        self.hidden = bert.config.hidden_size
        self.residency = ResidencyManager(len(self.layers), self.hidden, bert.config.intermediate_size,
                                          self.cfg.pool_slots, self.device, self.cfg.max_labels,
                                          all_layers=len(self.all_layers))
        self.tracer = Tracer(self.cfg.trace)
        self.retrieval = Retrieval(tokenizer, store, tenants, lookups, self.residency, self.hidden, self.cfg.max_len,
                                   self.device, self.tracer, bert.embeddings)
        self.stats = defaultdict(int)
        self._ids = itertools.count()
        self._in: queue.Queue = queue.Queue(maxsize=self.cfg.max_pending)
        self._ready: queue.Queue = queue.Queue(maxsize=self.cfg.queue_depth)
        self._retrievers = ThreadPoolExecutor(self.cfg.retrieval_threads, thread_name_prefix="stage-R")
        self._closed = False
        self._feeder = threading.Thread(target=self._feed, name="feeder", daemon=True)
        self._computer = threading.Thread(target=self._compute_loop, name="stage-C", daemon=True)
        self._feeder.start()
        self._computer.start()

    # -- public ----------------------------------------------------------------------------------
    def submit(self, requests: list[InferRequest]) -> list[Future]:
        """Queues one batch; returns its futures. Raises QueueFullError when the queue is full."""
        if self._closed:
            raise SchedulerClosedError("the scheduler is shut down")
        for i in range(0, len(requests), self.cfg.max_batch):
            part = requests[i:i + self.cfg.max_batch]
            try:
                self._in.put_nowait((next(self._ids), part))
            except queue.Full:
                raise QueueFullError("too many batches waiting") from None
        return [r.future for r in requests]

    def infer(self, pairs: list[tuple[str, str]], timeout: float | None = 120) -> list:
        """Convenience: run (tenant, text) pairs and wait; exceptions are returned in place."""
        reqs = [InferRequest(t, x) for t, x in pairs]
        self.submit(reqs)
        out = []
        for r in reqs:
            try:
                out.append(r.future.result(timeout))
            except Exception as exc:  # noqa: BLE001 - returned to the caller as the result
                out.append(exc)
        return out

    def forget(self, tenant: str) -> None:
        """Drops a tenant's cached copies (after an update or delete)."""
        self.store.invalidate(tenant)
        self.residency.evict(tenant)

    def queue_depth(self) -> int:
        return self._in.qsize() + self._ready.qsize()

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` was called (no work is taken any more)."""
        return self._closed

    def shutdown(self, cancel: bool = False, timeout: float = 60.0) -> None:
        """Stops taking work; finishes what is queued (or fails it with ``cancel``)."""
        if self._closed:
            return
        self._closed = True
        if cancel:
            while True:
                try:
                    item = self._in.get_nowait()
                except queue.Empty:
                    break
                for r in item[1]:
                    fail(r, SchedulerClosedError("the scheduler shut down before this request ran"))
        self._in.put(_STOP)
        self._feeder.join(timeout)
        self._computer.join(timeout)
        self._retrievers.shutdown(wait=True)
        self.residency.shutdown()

    # -- stage R ---------------------------------------------------------------------------------
    def _next_batch(self, carry):
        """The next batch for stage R: queued batches are coalesced up to ``max_batch`` requests, so
        that small batches that piled up while the pipeline was busy run as one."""
        item = carry if carry is not None else self._in.get()
        if item is _STOP:
            return _STOP, None
        batch_id, reqs = item
        while len(reqs) < self.cfg.max_batch:
            try:
                nxt = self._in.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP or len(reqs) + len(nxt[1]) > self.cfg.max_batch:
                return (batch_id, reqs), nxt
            reqs = reqs + nxt[1]
            self.stats["coalesced"] += 1
        return (batch_id, reqs), None

    def _feed(self) -> None:
        carry = None
        while True:
            item, carry = self._next_batch(carry)
            if item is _STOP:
                self._ready.put(_STOP)
                return
            batch_id, reqs = item
            if self.cfg.pipeline_retrieval:
                self._ready.put(self._retrievers.submit(self._retrieve_safe, batch_id, reqs))
            else:
                self._ready.put((batch_id, reqs))

    def _retrieve_safe(self, batch_id: int, reqs: list[InferRequest]) -> Prepared | None:
        try:
            return self.retrieve(batch_id, reqs)
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the batch, not the server
            for r in reqs:
                fail(r, exc)
            return None

    def retrieve(self, batch_id: int, reqs: list[InferRequest]) -> Prepared | None:
        """Stage R of one batch (``hmi.scheduler.retrieval.Retrieval.prepare``)."""
        return self.retrieval.prepare(batch_id, reqs)

    def _compute_loop(self) -> None:
        while True:
            item = self._ready.get()
            if item is _STOP:
                return
            if isinstance(item, Future):
                prepared = item.result()
            else:
                prepared = self._retrieve_safe(*item)
            if prepared is None:
                continue
            try:
                self.compute(prepared)
            except Exception as exc:  # noqa: BLE001
                for r in prepared.requests:
                    fail(r, exc)

    def compute(self, p: Prepared) -> None:
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
                self._compute_rows(p, hidden, rows)
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
                with torch.no_grad(), bf16_matmuls(self._bf16):
                    out = upper_forward(self.lower_layers, x, mask, res.groups, before_layer=res.wait_layer,
                                        relative_bias=self.relative_bias)
        finally:
            self.residency.release(res)
        hidden[torch.tensor(rows, device=hidden.device), :out.shape[1]] = out

    def _compute_rows(self, p: Prepared, hidden: torch.Tensor, rows: list[int]) -> None:
        entries, x, mask = self._rows_in(p, hidden, rows)
        res = self._acquire(p, rows, entries, self.l_low)
        if res is None:
            return
        embed = [p.requests[r].embed for r in rows]
        # a whole tenant's pool holds every layer: upper layer li waits for its layer li + the split
        shift = self.l_low if any(e.whole for e in entries) else 0
        try:
            with self.tracer.span("C:upper", p.batch_id, size=len(rows), loaded=res.loaded):
                with torch.no_grad(), bf16_matmuls(self._bf16):
                    out = upper_forward(self.layers, x, mask, res.groups,
                                        before_layer=lambda li: res.wait_layer(li + shift),
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


