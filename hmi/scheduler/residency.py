"""Stage A: making a batch's adapters resident in the device slot pools, layer by layer.

On a GPU the copies run on their own CUDA stream from pinned host memory, and a CUDA event per
layer lets the compute stream start layer l as soon as its weights have landed.  On the CPU a
staging thread does the copies and a threading.Event per layer gives the same ordering.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hmi.adapters.batched import Group
from hmi.adapters.pool import SlotPool, lora_scaling
from hmi.scheduler.types import TenantEntry


@dataclass
class Residency:
    """The slots a batch holds and how to wait for each layer's weights."""

    groups: list[Group]
    acquired: list[tuple[SlotPool, dict[str, int]]]
    layer_ready: list  # per layer: threading.Event or torch.cuda.Event
    head_ready: object
    loaded: int  # tenants copied host -> device for this batch
    error: BaseException | None = None  # set by the staging worker when a copy failed

    def wait_layer(self, li: int) -> None:
        _wait(self.layer_ready[li])
        if self.error is not None:
            raise RuntimeError(f"adapter copy failed: {self.error}") from self.error

    def wait_head(self) -> None:
        _wait(self.head_ready)
        if self.error is not None:
            raise RuntimeError(f"adapter copy failed: {self.error}") from self.error


def _wait(ev) -> None:
    if isinstance(ev, threading.Event):
        ev.wait()
    else:  # a CUDA event: the compute stream waits on the device, the host does not block
        torch.cuda.current_stream().wait_event(ev)


class ResidencyManager:
    """Pools per adapter signature, created on first use; one staging worker."""

    def __init__(self, n_layers: int, hidden: int, intermediate: int, slots: int, device: torch.device,
                 max_labels: int = 32):
        self.n_layers, self.hidden, self.intermediate = n_layers, hidden, intermediate
        self.slots, self.device, self.max_labels = slots, device, max_labels
        self.pools: dict[tuple, SlotPool] = {}
        self.cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="stage-A")
        self._versions: dict[str, int] = {}
        self._lock = threading.Lock()

    def pool(self, entry: TenantEntry) -> SlotPool:
        sig = entry.spec.signature(self.hidden)
        with self._lock:
            if sig not in self.pools:
                self.pools[sig] = SlotPool(sig, self.slots, self.n_layers, self.hidden, self.intermediate,
                                           self.max_labels, self.device, scaling=lora_scaling(entry.spec))
            return self.pools[sig]

    def evict(self, tenant: str) -> None:
        for p in list(self.pools.values()):
            p.evict(tenant)

    def acquire(self, rows_entries: list[TenantEntry], weights: dict, pipelined: bool, whole_batch_group: bool = True) -> Residency:
        """Pins slots for the batch's tenants and starts copying what is not resident.

        With ``pipelined`` the copies proceed layer by layer in the background; otherwise they
        finish before this returns.
        """
        by_pool: dict[int, tuple[SlotPool, list[int]]] = {}
        for row, e in enumerate(rows_entries):
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
                groups.append(Group(torch.tensor(rows, device=self.device),
                                    torch.tensor([slots[n] for n in names], device=self.device), p,
                                    all_rows=whole_batch_group and len(by_pool) == 1))
        except Exception:
            for p, slots in acquired:
                p.release(slots)
            raise
        if self.cuda:
            layer_ready = [torch.cuda.Event() for _ in range(self.n_layers)]
            head_ready = torch.cuda.Event()
        else:
            layer_ready = [threading.Event() for _ in range(self.n_layers)]
            head_ready = threading.Event()
        res = Residency(groups, acquired, layer_ready, head_ready, len(to_copy))
        if pipelined and to_copy:
            self._stager.submit(self._copy, to_copy, res)
        else:
            self._copy(to_copy, res)
            if self.cuda:
                torch.cuda.synchronize(self.device)
        return res

    def _copy(self, to_copy, res: Residency) -> None:
        ctx = torch.cuda.stream(self._copy_stream) if self.cuda else _null()
        done = 0
        try:
            with ctx:
                for li in range(self.n_layers):
                    for pool, slot, w in to_copy:
                        pool.write_layer(slot, li, w, non_blocking=self.cuda)
                    _signal(res.layer_ready[li], self._copy_stream)
                    done += 1
                for pool, slot, w in to_copy:
                    pool.write_head(slot, w, non_blocking=self.cuda)
                _signal(res.head_ready, self._copy_stream)
        except BaseException as exc:  # never leave the compute stage waiting
            res.error = exc
            for ev in res.layer_ready[done:] + [res.head_ready]:
                _signal(ev, self._copy_stream)
            for pool, slot, _ in to_copy:
                pool.evict_slot(slot)

    def release(self, res: Residency) -> None:
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


def _signal(ev, stream) -> None:
    if isinstance(ev, threading.Event):
        ev.set()
    else:
        ev.record(stream)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
