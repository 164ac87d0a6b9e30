"""Cross-tenant batching on the event loop, with a fair share of the batches for every tenant.

Requests wait in their tenant's own queue.  A batch is formed when the scheduler can start one
(fewer than ``in_flight`` batches submitted and unanswered) and either ``max_batch`` requests wait
or the oldest has waited ``max_wait`` seconds, as the paper's batcher closes a batch.  It takes
requests across the tenants' queues by start-time fair queuing (``hmi.scheduler.fair``): a tenant
that sends ten times its share waits behind itself, not in front of the others.

Admission keeps the wait short instead of queueing without end: the batcher holds about
``queue_delay`` seconds of work (the answered requests per second, measured over the last
seconds, times ``queue_delay``; at least a batch per place in flight).  Past that, a request is
refused at once (429) when its tenant already has its weighted share of that bound waiting
(``TenantQueueFullError``; at least a batch; the tenants within their share are still
admitted), and in any case when its tenant has ``tenant_queue`` waiting or the batcher
``max_pending`` (``QueueFullError``).  A tenant that floods (sends more than four times its fair
rate, ``flooding``) is refused sooner: past its weighted share of the bound among the tenants
waiting or served lately (at least ``MIN_SHARE``), though the batcher is far from full, so that
its backlog never fills the batches that everyone else's requests then wait behind (a batch is
not preempted).  What a flooding tenant still has waiting goes out in slices: a batch takes at
most its weighted share of ``max_batch`` rows among the tenants waiting or served lately (at
least one), so that a batch stays short while the others' next requests arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from hmi.scheduler.fair import FairQueue, TenantQueueFullError
from hmi.scheduler.types import InferRequest, QueueFullError

RATE_WINDOW = 5.0  # seconds of answered batches that measure the rate the admission bound follows
FLOOD_WINDOW = 1.0  # seconds over which a tenant's requests are counted to tell a flood (Batcher.flooding)
FLOOD_FACTOR = 4  # a tenant floods past this many times its fair rate (well clear of a rate depressed by load)
MIN_SHARE = 2  # requests a flooding tenant may have waiting whatever its share


class Batcher:
    def __init__(self, submit: Callable[[list[InferRequest]], None], max_batch: int = 32, max_wait: float = 0.005,
                 on_close: Callable[[int], None] | None = None, in_flight: int = 2, tenant_queue: int = 256,
                 max_pending: int = 8192, weight: Callable[[str], float] | None = None,
                 queue_delay: float | None = 0.25):
        self.submit = submit
        self.max_batch, self.max_wait, self.on_close = max_batch, max_wait, on_close
        self.in_flight, self.tenant_queue, self.max_pending = in_flight, tenant_queue, max_pending
        self.queue_delay = queue_delay
        # (time, requests, their tenants) of the batches answered in the last RATE_WINDOW s
        self._answered: deque = deque()
        self._queue = FairQueue(weight)
        # tenant -> (start of its window, requests sent in the window before, in this one), oldest first
        self._sending: dict[str, tuple[float, int, int]] = {}
        self._running = 0  # batches submitted and not answered yet
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        """No request waits and no batch is in flight."""
        return not self._queue and self._running == 0

    def waiting(self, tenant: str) -> int:
        return self._queue.waiting(tenant)

    def add(self, requests: list[InferRequest]) -> None:
        """Queues the requests of one HTTP call (one model) and forms what batches can start.
        Raises TenantQueueFullError (that tenant's queue is full) or QueueFullError (the batcher
        is full) before queueing any of them, or what ``submit`` raises for a batch formed now."""
        if not requests:
            return
        self._loop = asyncio.get_running_loop()
        tenant = requests[0].tenant or ""
        self.admit(tenant, len(requests))
        self._sent(tenant, len(requests))
        self._queue.push(tenant, requests)
        self._form(raise_errors=True)

    def admit(self, tenant: str, n: int = 1) -> None:
        """Raises what ``add`` would raise for ``n`` more requests of ``tenant`` (``""``: the root's
        own), so that a route can refuse before it reads a body; a refusal counts as sent."""
        try:
            self._admissible(tenant, n)
        except QueueFullError:
            self._sent(tenant, n)
            raise

    def flooding(self, tenant: str, n: int = 0) -> bool:
        """Whether ``tenant`` sends (admitted or refused, ``n`` more now) more than FLOOD_FACTOR
        times its fair rate: its requests of the last FLOOD_WINDOW seconds, the previous window's
        weighted by how much of it the last FLOOD_WINDOW seconds still cover, as HAProxy
        estimates a rate."""
        return self._floods(tenant, n, self.fair_rate(tenant))

    def _floods(self, tenant: str, n: int, fair_rate: float) -> bool:
        now = time.monotonic()
        start, previous, current = self._window(tenant, now)
        sent = current + n + previous * (1.0 - (now - start) / FLOOD_WINDOW)
        return sent > FLOOD_FACTOR * fair_rate * FLOOD_WINDOW + MIN_SHARE

    def _admissible(self, tenant: str, n: int) -> None:
        mine, pending = self._queue.waiting(tenant), len(self._queue)
        if mine + n > self.tenant_queue:
            raise TenantQueueFullError(tenant or "root", mine)
        if pending + n > self.max_pending:
            raise QueueFullError(f"{pending} requests are waiting, the server's limit")
        bound = self.bound()
        if bound is None:
            return
        if mine and mine + n > MIN_SHARE and self.flooding(tenant, n) \
                and mine + n > self._queue.share(tenant, bound, self._lately()):
            raise TenantQueueFullError(tenant or "root", mine)  # a flood waits in a short queue of its own
        if pending + n > bound:
            if not self._queue.tenants() - {tenant}:  # nobody else waits: the server is simply full
                raise QueueFullError(f"{pending} requests are waiting: about {self.queue_delay:g} s of work")
            if mine + n > max(self.max_batch, self._queue.share(tenant, bound)):  # others wait; it has its share
                raise TenantQueueFullError(tenant or "root", mine)

    def bound(self) -> int | None:
        """Requests the batcher holds before refusing: ``queue_delay`` seconds at the answered rate
        of the last RATE_WINDOW seconds (at least a batch per place in flight); None before any
        answer, or without a ``queue_delay``."""
        rate = self.rate()
        if self.queue_delay is None or rate is None:
            return None
        return max(self.max_batch * self.in_flight, int(rate * self.queue_delay))

    def rate(self) -> float | None:
        """Requests answered per second over the last RATE_WINDOW seconds (None before two batches)."""
        if len(self._answered) < 2:
            return None
        span = self._answered[-1][0] - self._answered[0][0]
        return sum(n for _, n, _ in list(self._answered)[1:]) / span if span > 0 else None

    def fair_rate(self, tenant: str) -> float:
        """The requests per second that are ``tenant``'s weighted share of the answered rate among
        the tenants answered in the last RATE_WINDOW seconds or waiting now (and it); 0 before a rate."""
        return self._queue.share(tenant, self.rate() or 0.0, self._lately())

    def close(self) -> None:
        """Forms a batch now from whatever waits (if the scheduler can take one)."""
        self._form(raise_errors=True, force=True)

    # -- internals -----------------------------------------------------------------------------
    def _form(self, raise_errors: bool = False, force: bool = False) -> None:
        """Submits batches while the scheduler can take one and one is due; arms the timer for
        the oldest request otherwise."""
        while self._queue and self._running < self.in_flight:
            if not (force or len(self._queue) >= self.max_batch or self._oldest_wait() >= self.max_wait):
                break
            force = False
            self._submit(self._queue.take(self.max_batch, self._row_limit()), raise_errors)
        self._arm()

    def _row_limit(self) -> Callable[[str], int | None]:
        """The rows of one batch a tenant may take: a flooding tenant its weighted share of
        ``max_batch`` among the tenants waiting or served lately (at least one), any other as many
        as wait (None)."""
        rate = self.rate()
        if rate is None:
            return lambda tenant: None
        lately = self._lately()

        def limit(tenant: str) -> int | None:
            if not self._floods(tenant, 0, self._queue.share(tenant, rate, lately)):
                return None
            return max(1, int(self._queue.share(tenant, self.max_batch, lately)))
        return limit

    def _submit(self, batch: list[InferRequest], raise_errors: bool) -> None:
        if self.on_close:
            self.on_close(len(batch))
        self._running += 1
        left = [len(batch)]
        loop = self._loop

        def answered(_future) -> None:  # any thread: the scheduler's, or the loop's on failure
            left[0] -= 1
            if left[0] == 0:
                loop.call_soon_threadsafe(self._finished, len(batch), frozenset(r.tenant or "" for r in batch))

        for r in batch:
            r.future.add_done_callback(answered)
        try:
            self.submit(batch)
        except Exception as exc:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
            if raise_errors:
                raise

    def _finished(self, n: int, tenants: frozenset) -> None:
        self._running -= 1
        now = time.monotonic()
        self._answered.append((now, n, tenants))
        while self._answered and now - self._answered[0][0] > RATE_WINDOW:
            self._answered.popleft()
        self._form()

    def _sent(self, tenant: str, n: int) -> None:
        """Counts ``n`` requests of ``tenant`` sent now (``flooding``); forgets the tenants that
        sent nothing for two windows (the dict holds the least recently counted first)."""
        now = time.monotonic()
        start, previous, current = self._window(tenant, now)
        self._sending.pop(tenant, None)
        self._sending[tenant] = (start, previous, current + n)
        while now - next(iter(self._sending.values()))[0] >= 2 * FLOOD_WINDOW:
            del self._sending[next(iter(self._sending))]

    def _window(self, tenant: str, now: float) -> tuple[float, int, int]:
        """``tenant``'s (window start, requests in the window before, in this one) at ``now``: a
        window over a FLOOD_WINDOW old starts again at ``now``, the one before it kept only if it
        ended less than a window ago."""
        start, previous, current = self._sending.get(tenant, (now, 0, 0))
        if now - start >= FLOOD_WINDOW:
            start, previous, current = now, current if now - start < 2 * FLOOD_WINDOW else 0, 0
        return start, previous, current

    def _lately(self) -> set[str]:
        """The tenants of the batches answered in the last RATE_WINDOW seconds."""
        return set().union(*(tenants for _, _, tenants in self._answered))

    def _oldest_wait(self) -> float:
        oldest = self._queue.oldest_arrival()
        return 0.0 if oldest is None else time.monotonic() - oldest

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._queue and self._running < self.in_flight and self._loop is not None:
            delay = max(0.0, self.max_wait - self._oldest_wait())
            self._timer = self._loop.call_later(delay, self._form)
