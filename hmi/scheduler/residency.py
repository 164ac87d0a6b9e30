"""Stage A: making a batch's adapters resident in the device slot pools, layer by layer.

A staging thread issues the copies layer by layer and signals each layer's ``Ready``.  On a GPU
the copies run on their own CUDA stream from pinned host memory: ``Ready.signal`` records a CUDA
event on that stream and only then sets a host flag; ``Ready.wait`` waits for the flag before it
makes the compute stream wait on the event.  (A CUDA wait on an event that was not recorded yet
is a no-op: without the flag, layer l could read a slot that still holds zeros or the previous
tenant's weights.)  On the CPU the copies are plain and the flag alone orders them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from hmi.adapters.batched import Group, segment_plan
from hmi.adapters.pool import SlotPool
from hmi.scheduler.types import TenantEntry


@dataclass
class CopyStreams:
    """What the copy path needs of CUDA, injectable so the ordering can be tested without a GPU."""

    copy: object  # the copy stream (torch.cuda.Stream)
    new_event: Callable[[], object]  # torch.cuda.Event
    compute: Callable[[], object]  # the compute stream of the pool's device
    use: Callable[[object], object]  # context manager making a stream current (torch.cuda.stream)

    @classmethod
    def for_device(cls, device: torch.device) -> "CopyStreams":
        return cls(torch.cuda.Stream(device), torch.cuda.Event, lambda: torch.cuda.current_stream(device),
                   torch.cuda.stream)


class Ready:
    """One layer's (or the heads') weights have landed in the pools.

    Contract: the staging thread calls ``signal`` after issuing the copies; the compute thread
    calls ``wait`` before its kernels read them.  ``event`` is None on the CPU."""

    def __init__(self, event=None):
        self.flag = threading.Event()
        self.event = event
        self.waited = False  # the compute stream is ordered after the copies already

    def signal(self, stream=None) -> None:
        if self.event is not None:
            self.event.record(stream)
        self.flag.set()  # after record(): a waiter never sees an unrecorded event

    def wait(self, compute_stream: Callable[[], object] | None = None) -> None:
        if self.waited:
            return
        self.flag.wait()
        if self.event is not None:  # the compute stream waits on the device; the host does not block
            compute_stream().wait_event(self.event)
        self.waited = True


@dataclass
class Residency:
    """The slots a batch holds and how to wait for each layer's weights."""

    groups: list[Group]
    acquired: list[tuple[SlotPool, dict[str, int]]]
    layer_ready: list[Ready]
    head_ready: Ready
    loaded: int  # tenants copied host -> device for this batch
    compute_stream: Callable[[], object] | None = None
    error: BaseException | None = None  # set by the staging worker when a copy failed
    # layer li of the pass reads layer li + offset of a pool (the groups' largest ``Group.offset``):
    # it waits for that layer's copies, which land after those of every layer before it
    offset: int = 0

    def wait_layer(self, li: int) -> None:
        """Waits until the pools' weights that layer ``li`` of the pass reads have landed."""
        self.layer_ready[li + self.offset].wait(self.compute_stream)
        if self.error is not None:
            raise RuntimeError(f"adapter copy failed: {self.error}") from self.error

    def wait_head(self) -> None:
        self.head_ready.wait(self.compute_stream)
        if self.error is not None:
            raise RuntimeError(f"adapter copy failed: {self.error}") from self.error

    def settle(self) -> None:
        """Waits until every copy this batch started has landed or failed (what a pass that read
        fewer layers than were copied, or stopped early, left in flight)."""
        for ready in self.layer_ready + [self.head_ready]:
            ready.wait(self.compute_stream)


class ResidencyManager:
    """Pools per adapter signature, created on first use; one staging worker.  A pool holds
    ``n_layers`` layers (the upper ones), or ``all_layers`` for ``whole`` specs (default: the same)."""

    def __init__(self, n_layers: int, hidden: int, intermediate: int, slots: int, device: torch.device,
                 max_labels: int = 32, streams: CopyStreams | None = None, all_layers: int | None = None):
        self.n_layers, self.hidden, self.intermediate = n_layers, hidden, intermediate
        self.all_layers = n_layers if all_layers is None else all_layers
        self.slots, self.device, self.max_labels = slots, torch.device(device), max_labels
        self.pools: dict[tuple, SlotPool] = {}
        if streams is None and self.device.type == "cuda":
            streams = CopyStreams.for_device(self.device)
        self.streams = streams
        self.cuda = streams is not None
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="stage-A")
        self._versions: dict[str, int] = {}
        self._lock = threading.Lock()

    def pool(self, entry: TenantEntry) -> SlotPool:
        sig = entry.spec.pool_key(self.hidden)
        with self._lock:
            if sig not in self.pools:
                layers = self.all_layers if entry.whole else self.n_layers
                self.pools[sig] = SlotPool.for_spec(entry.spec, self.slots, layers, self.hidden, self.intermediate,
                                                    self.max_labels, self.device)
                if self.cuda:  # the copy stream writes the new pool only after the compute stream zeroed it
                    self.streams.copy.wait_stream(self.streams.compute())
            return self.pools[sig]

    def check(self, entry: TenantEntry, weights: dict[str, torch.Tensor]) -> None:
        """Raises ValueError when a tenant's stored weights do not fit its spec and pool (a
        damaged or foreign file): refused before its batch, so it fails only its own requests."""
        self.pool(entry).check(weights, entry.spec.num_labels)

    def resident(self, tenant: str) -> bool:
        """Whether the tenant's weights occupy a device slot now."""
        return any(p.slot_of(tenant) is not None for p in list(self.pools.values()))

    def evict(self, tenant: str) -> None:
        for p in list(self.pools.values()):
            p.evict(tenant)

    def acquire(self, rows_entries: list[TenantEntry], weights: dict, pipelined: bool,
                whole_offset: int = 0) -> Residency:
        """Pins slots for the batch's tenants and starts copying what is not resident.

        With ``pipelined`` the copies proceed layer by layer in the background; otherwise they
        finish before this returns.  Rows of the root itself (``ROOT``: no spec) join no group:
        the upper layers run on them without an adapter.  The groups of ``whole`` tenants' pools
        (every layer of the root) read their layers from ``whole_offset`` on (``Group.offset``: the
        split, in a pass of the upper layers); ``layer_ready`` counts the pools' layers, the most
        of any, and ``wait_layer(li)`` waits for layer li + that offset."""
        by_pool: dict[int, tuple[SlotPool, list[int]]] = {}
        for row, e in enumerate(rows_entries):
            if e.spec is None:
                continue
            p = self.pool(e)
            # A tenant whose weights changed since they were copied in gets a fresh copy.
            if self._versions.get(e.name, e.version) != e.version:
                p.evict(e.name)
            by_pool.setdefault(id(p), (p, []))[1].append(row)
        groups, acquired, to_copy = [], [], []
        try:
            for p, rows in by_pool.values():
                names = [rows_entries[r].name for r in rows]
                slots, missing = p.acquire(names)
                acquired.append((p, slots))
                for t in missing:
                    to_copy.append((p, slots[t], weights[t]))
                    self._versions[t] = next(e.version for e in rows_entries if e.name == t)
                slot_list = [slots[n] for n in names]
                groups.append(Group(torch.tensor(rows, device=self.device),
                                    torch.tensor(slot_list, device=self.device), p,
                                    all_rows=len(rows) == len(rows_entries), plan=segment_plan(slot_list),
                                    offset=whole_offset if rows_entries[rows[0]].whole else 0))
        except Exception:
            for p, slots in acquired:
                p.release(slots)
            raise
        new = (lambda: Ready(self.streams.new_event())) if self.cuda else Ready
        n_layers = max((len(p.layers) for p, _ in acquired), default=self.n_layers)
        res = Residency(groups, acquired, [new() for _ in range(n_layers)], new(), len(to_copy),
                        self.streams.compute if self.cuda else None, offset=max((g.offset for g in groups), default=0))
        if pipelined and to_copy:
            self._stager.submit(self._copy, to_copy, res)
        else:
            self._copy(to_copy, res)
        return res

    def _copy(self, to_copy, res: Residency) -> None:
        stream = self.streams.copy if self.cuda else None
        done = 0
        try:
            with self.streams.use(stream) if self.cuda else nullcontext():
                for li in range(len(res.layer_ready)):
                    for pool, slot, w in to_copy:
                        if li < len(pool.layers):
                            pool.write_layer(slot, li, w, non_blocking=self.cuda)
                    res.layer_ready[li].signal(stream)
                    done += 1
                for pool, slot, w in to_copy:
                    pool.write_head(slot, w, non_blocking=self.cuda)
                res.head_ready.signal(stream)
        except BaseException as exc:  # never leave the compute stage waiting
            res.error = exc
            for ready in res.layer_ready[done:] + [res.head_ready]:
                ready.signal(stream)
            for pool, slot, _ in to_copy:
                pool.evict_slot(slot)

    def release(self, res: Residency) -> None:
        """Unpins the batch's slots once its copies have landed: a later batch that finds a tenant
        resident reads its weights without waiting for this batch's copies."""
        res.settle()
        for p, slots in res.acquired:
            p.release(slots)

    def stats(self) -> dict:
        out = {"device_hits": 0, "device_misses": 0, "evictions": 0}
        for p in self.pools.values():
            for k in out:
                out[k] += p.stats[k]
        return out

    def shutdown(self) -> None:
        self._stager.shutdown(wait=True)

