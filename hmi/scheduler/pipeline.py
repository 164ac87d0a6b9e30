"""The scheduler: batches of infer requests through R -> A -> C, pipelined.

* R (retrieval, ``hmi.scheduler.retrieval``, a thread pool): tokenize, check, read adapters into host memory, PLOT lookup +
  merge per domain chain.  R of batch k+1 runs while C of batch k computes.
* A (residency, a staging worker or a CUDA copy stream): copy the batch's missing adapters into
  the device pools layer by layer; C of layer l starts once layer l has landed.
* C (compute, ``hmi.scheduler.compute``, one thread): the shared upper layers with batched adapters, then the heads (the rows
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
import queue
import sys
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hmi.adapters.store import AdapterStore
from hmi.model.kernels import NATIVE_BF16
from hmi.model.root import SentencePooling
from hmi.scheduler.compute import Compute, ComputeConfig
from hmi.scheduler.residency import ResidencyManager
from hmi.scheduler.retrieval import Retrieval
from hmi.scheduler.trace import Tracer
from hmi.scheduler.types import (
    InferRequest,
    LookupSource,
    Prepared,
    QueueFullError,
    SchedulerClosedError,
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
        every = torch.nn.ModuleList(bert.encoder.layer)
        all_layers = copy.deepcopy(every).to(self.device) if self.device.type != "cpu" else every
        bias = getattr(bert, "relative_bias", None)
        bias = copy.deepcopy(bias).to(self.device) if bias is not None and self.device.type != "cpu" else bias
        self.store = store
        self.hidden = bert.config.hidden_size
        self.residency = ResidencyManager(len(all_layers) - l_low, self.hidden, bert.config.intermediate_size,
                                          self.cfg.pool_slots, self.device, self.cfg.max_labels,
                                          all_layers=len(all_layers))
        self.tracer = Tracer(self.cfg.trace)
        self.retrieval = Retrieval(tokenizer, store, tenants, lookups, self.residency, self.hidden, self.cfg.max_len,
                                   self.device, self.tracer, bert.embeddings)
        self.stats = defaultdict(int)
        self.stage_c = Compute(all_layers, l_low, bias, self.residency, pooling, self.device, self.tracer, self.stats,
                               ComputeConfig(self.cfg.pool_slots, self.cfg.length_groups, self.cfg.batched_adapters,
                                             self.cfg.pipeline_swap, self.cfg.upper_precision == "bf16"))
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
        """Stages A and C for one prepared batch (``hmi.scheduler.compute.Compute.run``)."""
        self.stage_c.run(p)
