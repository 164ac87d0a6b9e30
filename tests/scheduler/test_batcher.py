"""Fair shares in the batcher: a tenant that floods the server waits behind its own requests, not
in front of the others'; weights divide the batches; a tenant over its queue's bound is refused
alone; batches still close when full or after max_wait."""

import asyncio

import pytest

from hmi.scheduler.batcher import FLOOD_FACTOR, FLOOD_WINDOW, MIN_SHARE, Batcher
from hmi.scheduler.fair import TenantQueueFullError
from hmi.scheduler.types import InferRequest, QueueFullError


class Scheduler:
    """Records the batches it is given; answers them when told (as the real one does, from its thread)."""

    def __init__(self):
        self.batches: list[list[InferRequest]] = []

    def submit(self, batch):
        self.batches.append(batch)

    def answer(self, i: int = 0):
        for r in self.batches[i]:
            r.future.set_result({"ok": True})


def reqs(tenant, n):
    return [InferRequest(tenant, f"{tenant} {i}") for i in range(n)]


def run(coro):
    return asyncio.run(coro)


def test_a_tenant_that_floods_waits_behind_itself_and_the_others_are_served_next():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=8, max_wait=10, in_flight=1)
        b.add(reqs("noisy", 100))  # a full batch starts at once
        b.add(reqs("quiet", 4))
        assert len(s.batches) == 1 and {r.tenant for r in s.batches[0]} == {"noisy"}
        s.answer(0)
        await asyncio.sleep(0.01)  # the answer reaches the loop; the next batch forms
        second = [r.tenant for r in s.batches[1]]
        assert second.count("quiet") == 4 and second.count("noisy") == 4  # shares, not arrival order
        # The slow, obvious reference: one request of each waiting tenant in turn.
        assert second == ["noisy", "quiet"] * 4

    run(go())


def test_weights_divide_the_batches():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=8, max_wait=10, in_flight=1, weight=lambda t: {"gold": 3.0}.get(t, 1.0))
        b.add(reqs("blocker", 8))  # occupies the scheduler while both queue
        b.add(reqs("gold", 40))
        b.add(reqs("plain", 40))
        for i in range(4):
            s.answer(i)
            await asyncio.sleep(0.01)
        taken = [r.tenant for batch in s.batches[1:5] for r in batch]
        assert taken.count("gold") == 3 * taken.count("plain") == 24

    run(go())


def test_a_tenant_over_its_queue_bound_is_refused_alone_and_nothing_of_its_call_is_queued():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=8, max_wait=10, in_flight=1, tenant_queue=10, max_pending=25)
        b.add(reqs("blocker", 8))
        b.add(reqs("noisy", 10))
        with pytest.raises(TenantQueueFullError) as err:
            b.add(reqs("noisy", 1))
        assert err.value.tenant == "noisy" and b.waiting("noisy") == 10
        b.add(reqs("quiet", 10))  # the others are still taken
        with pytest.raises(QueueFullError):
            b.add(reqs("third", 10))  # the batcher's own bound
        assert b.pending == 20

    run(go())


def test_a_batch_closes_after_max_wait_and_at_most_in_flight_batches_run():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=8, max_wait=0.02, in_flight=2)
        b.add(reqs("a", 3))
        assert s.batches == []
        await asyncio.sleep(0.06)
        assert [len(x) for x in s.batches] == [3]
        b.add(reqs("a", 20))  # two full batches may run; the rest waits for an answer
        await asyncio.sleep(0.06)
        assert [len(x) for x in s.batches] == [3, 8] and b.pending == 12
        s.answer(0)
        await asyncio.sleep(0.06)
        assert [len(x) for x in s.batches] == [3, 8, 8] and b.pending == 4

    run(go())


def test_a_failed_submit_fails_that_batch_and_frees_its_place():
    async def go():
        calls = []

        def submit(batch):
            calls.append(batch)
            if len(calls) == 1:
                raise QueueFullError("scheduler full")

        b = Batcher(submit, max_batch=4, max_wait=10, in_flight=1)
        with pytest.raises(QueueFullError):
            b.add(reqs("a", 4))
        assert all(isinstance(r.future.exception(), QueueFullError) for r in calls[0])
        await asyncio.sleep(0.01)
        b.add(reqs("a", 4))
        assert len(calls) == 2

    run(go())


def test_past_its_measured_bound_the_batcher_refuses_the_tenant_over_its_share_and_admits_the_others():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1, queue_delay=0.05)
        assert b.bound() is None  # nothing answered yet: no rate to hold a delay against
        for _ in range(10):  # answered batches measure the rate
            b.add(reqs("warm", 4))
            s.answer(len(s.batches) - 1)
            await asyncio.sleep(0.01)
        bound = b.bound()
        assert bound is not None and bound >= 4
        b.add(reqs("noisy", 4))  # a batch in flight, unanswered: the rest waits
        b.add(reqs("noisy", bound))
        with pytest.raises(QueueFullError) as full:
            b.add(reqs("noisy", 1))  # nobody else waits: the server is full
        assert not isinstance(full.value, TenantQueueFullError)
        b.add(reqs("quiet", 1))  # within its share: admitted past the bound
        with pytest.raises(TenantQueueFullError):
            b.add(reqs("noisy", 1))  # others wait, and it holds far more than its half
        assert b.waiting("quiet") == 1 and b.waiting("noisy") == bound

    run(go())


async def served_slowly(b: Batcher, s: Scheduler, tenant: str) -> None:
    """Three batches of four of ``tenant``'s, answered 0.2 s apart: a rate of about 20 a second."""
    for _ in range(3):
        b.add(reqs(tenant, 4))
        s.answer(len(s.batches) - 1)
        await asyncio.sleep(0.2)


def test_a_flooding_tenant_is_refused_past_its_share_of_the_bound_while_another_was_served_lately_though_none_waits():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1, queue_delay=5.0)
        await served_slowly(b, s, "quiet")  # served lately, nothing waiting now
        bound, fair = b.bound(), b.fair_rate("noisy")
        assert fair == pytest.approx(b.rate() / 2) and FLOOD_FACTOR * fair + MIN_SHARE < bound / 2  # quiet and noisy
        b.add(reqs("noisy", 4))  # a batch in flight, unanswered: the rest waits
        admitted = 0
        with pytest.raises(TenantQueueFullError):
            while True:
                b.add(reqs("noisy", 1))  # one call after another, far past its fair rate
                admitted += 1
        assert admitted == b.waiting("noisy") == int(bound / 2)  # its share of the bound, half the bound
        assert b.flooding("noisy") and not b.flooding("quiet")
        b.add(reqs("quiet", 3))  # not flooding: admitted
        b.add(reqs("quiet", 1))

    run(go())


def test_a_tenant_sending_within_a_few_times_its_fair_rate_may_hold_more_than_its_share_below_the_bound():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1, queue_delay=1.0)
        await served_slowly(b, s, "quiet")
        bound, fair = b.bound(), b.fair_rate("bursty")
        share = bound / 2
        assert share + 6 < FLOOD_FACTOR * fair + MIN_SHARE  # room to send past its share without flooding
        b.add(reqs("bursty", 4))  # a batch in flight, unanswered: the rest waits
        b.add(reqs("bursty", int(share) + 1))
        b.add(reqs("bursty", 1))  # past its share, below the bound, not flooding: admitted
        assert b.waiting("bursty") == int(share) + 2 and not b.flooding("bursty")

    run(go())


def test_a_flooding_tenants_backlog_goes_out_in_slices_of_its_share_of_a_batch_though_nobody_else_waits():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1, queue_delay=50.0)
        await served_slowly(b, s, "quiet")  # served lately (about 20 a second), nothing waiting now
        threshold = FLOOD_FACTOR * b.fair_rate("noisy") * FLOOD_WINDOW + MIN_SHARE
        for _ in range(3 * int(threshold)):  # one call after another, three times past four times its fair rate
            b.add(reqs("noisy", 1))
        assert b.flooding("noisy")
        first = len(s.batches) - 1  # formed while it had sent less: a whole batch
        s.answer(first)
        await asyncio.sleep(0.01)
        assert [r.tenant for r in s.batches[first + 1]] == ["noisy"] * 2  # its half of a batch, not all 4
        b.add(reqs("quiet", 1))
        s.answer(first + 1)
        await asyncio.sleep(0.01)
        assert [r.tenant for r in s.batches[first + 2]] == ["noisy", "quiet", "noisy"]

    run(go())


def test_a_tenant_that_does_not_flood_fills_whole_batches_beside_a_tenant_served_lately():
    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1, queue_delay=5.0)
        await served_slowly(b, s, "quiet")
        b.add(reqs("bulk", 20))  # one call of 20 texts: within four times its fair rate
        assert not b.flooding("bulk")
        s.answer(len(s.batches) - 1)
        await asyncio.sleep(0.01)
        assert [len(x) for x in s.batches[-2:]] == [4, 4]

    run(go())


def test_what_a_tenant_sent_is_forgotten_two_windows_after_it_stopped(monkeypatch):
    import hmi.scheduler.batcher as batcher

    monkeypatch.setattr(batcher, "FLOOD_WINDOW", 0.05)

    async def go():
        s = Scheduler()
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1)
        for i in range(100):
            b.admit(f"t{i}")
            b.add(reqs(f"t{i}", 1))
        assert len(b._sending) == 100
        await asyncio.sleep(0.11)
        b.add(reqs("last", 1))
        assert list(b._sending) == ["last"]

    run(go())


def test_a_tenants_fair_rate_is_its_weighted_share_of_the_answered_rate_among_the_tenants_served_lately():
    async def go():
        s = Scheduler()
        weights = {"heavy": 2.0}
        b = Batcher(s.submit, max_batch=4, max_wait=0.001, in_flight=1, weight=lambda t: weights.get(t, 1.0))
        assert b.rate() is None and b.fair_rate("a") == 0.0  # nothing answered yet
        started = None
        for tenant in ("a", "b", "heavy") * 3:  # nine batches of four, answered one after the other
            b.add(reqs(tenant, 4))
            s.answer(len(s.batches) - 1)
            await asyncio.sleep(0.01)
            started = started or asyncio.get_running_loop().time()
        elapsed = asyncio.get_running_loop().time() - started
        rate = b.rate()
        assert rate == pytest.approx(8 * 4 / elapsed, rel=0.3)  # the first batch starts the clock
        assert b.fair_rate("a") == pytest.approx(rate / 4)  # weights a 1, b 1, heavy 2
        assert b.fair_rate("heavy") == pytest.approx(rate / 2)
        assert b.fair_rate("newcomer") == pytest.approx(rate / 5)  # it counts itself among the active

    run(go())
