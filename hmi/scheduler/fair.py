"""A fair share of the server for every tenant: the tenants' waiting requests, taken in the order
of start-time fair queuing (a relative of deficit round robin).

Each request gets the tag ``max(V, tag of its tenant's previous request) + 1 / weight`` (V: the
tag of the last request taken), and requests are taken smallest tag first.  A tenant that sends
ten times its share therefore waits behind itself, not in front of the others; a tenant of weight
2 is taken twice as often as one of weight 1 while both have requests waiting.  The encoder's
batcher (``hmi.scheduler.batcher``) and the decoder's generation service
(``hmi.hgpt.generation``) both take their requests from one of these.  Not thread-safe: its
owner serializes the calls (the event loop; a lock).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from typing import Callable

from hmi.scheduler.types import QueueFullError


class TenantQueueFullError(QueueFullError):
    """One tenant's queue is full: its own requests are refused, nobody else's."""

    def __init__(self, tenant: str, waiting: int):
        super().__init__(f"tenant {tenant!r} has {waiting} requests waiting, its queue's limit")
        self.tenant, self.waiting = tenant, waiting


class FairQueue:
    """Waiting requests by tenant (module docstring); ``weight(tenant)`` is read when a tenant's
    requests are added."""

    def __init__(self, weight: Callable[[str], float] | None = None):
        self.weight = weight or (lambda tenant: 1.0)
        # tenant -> deque of (tag, arrival, request); a tenant without waiting requests has none
        self._queues: dict[str, deque] = {}
        self._heads: list[tuple[float, int, str]] = []  # (tag of a queue's first request, order, tenant)
        self._order = itertools.count()
        self._vtime = 0.0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def waiting(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q else 0

    def tenants(self) -> set[str]:
        """The tenants with requests waiting."""
        return set(self._queues)

    def push(self, tenant: str, items: list) -> None:
        """Queues ``items`` of ``tenant`` (one call's requests, tagged one after the other)."""
        if not items:
            return
        q = self._queues.setdefault(tenant, deque())
        step = 1.0 / max(self.weight(tenant), 1e-6)
        # Tags are taken in increasing order, so a tenant whose queue emptied has no tag above V.
        tag, now = (q[-1][0] if q else self._vtime), time.monotonic()
        was_empty = not q
        for item in items:
            tag += step
            q.append((tag, now, item))
        if was_empty:
            heapq.heappush(self._heads, (q[0][0], next(self._order), tenant))
        self._len += len(items)

    def pop(self):
        """The waiting request with the smallest tag (IndexError when none waits)."""
        tag, _, tenant = heapq.heappop(self._heads)
        q = self._queues[tenant]
        _, _, item = q.popleft()
        self._vtime = tag
        if q:
            heapq.heappush(self._heads, (q[0][0], next(self._order), tenant))
        else:
            del self._queues[tenant]
        self._len -= 1
        return item

    def take(self, n: int, limit: Callable[[str], int | None] = lambda tenant: None) -> list:
        """Up to ``n`` waiting requests in the order ``pop`` gives them, at most ``limit(tenant)`` of
        a tenant (None: no limit; read once a call); a tenant at its limit keeps the rest of its
        requests waiting, in front of later arrivals."""
        out, held, taken, limits = [], [], {}, {}
        while len(out) < n and self._heads:
            tenant = self._heads[0][2]
            if tenant not in limits:
                limits[tenant] = limit(tenant)
            if limits[tenant] is not None and taken.get(tenant, 0) >= limits[tenant]:
                held.append(heapq.heappop(self._heads))
                continue
            taken[tenant] = taken.get(tenant, 0) + 1
            out.append(self.pop())
        for head in held:
            heapq.heappush(self._heads, head)
        return out

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting request arrived (``time.monotonic``), or None."""
        return min((q[0][1] for q in self._queues.values()), default=None)

    def share(self, tenant: str, bound: float, also: frozenset | set = frozenset()) -> float:
        """A tenant's weighted share of ``bound`` among the tenants with requests waiting, those in
        ``also`` and it."""
        active = self.tenants() | set(also) | {tenant}
        return bound * self.weight(tenant) / sum(self.weight(t) for t in active)
