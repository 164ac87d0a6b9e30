"""Start-time fair queuing across tenants (hmi.scheduler.fair), the order both the encoder's
batcher and the decoder's generation service take requests in."""

from hmi.scheduler.fair import FairQueue


def test_a_flooding_tenant_waits_behind_itself_not_in_front_of_a_tenant_that_comes_later():
    q = FairQueue()
    q.push("noisy", [f"n{i}" for i in range(10)])
    first = q.pop()
    q.push("quiet", ["q0", "q1"])
    order = [first] + [q.pop() for _ in range(len(q))]
    assert order[:5] == ["n0", "n1", "q0", "n2", "q1"] and len(q) == 0 and q.tenants() == set()


def test_weights_share_the_takes_in_proportion_while_both_tenants_wait():
    q = FairQueue(weight={"heavy": 2.0, "light": 1.0}.__getitem__)
    q.push("light", list(range(30)))
    q.push("heavy", list(range(100, 130)))
    taken = [q.pop() for _ in range(30)]
    assert sum(x >= 100 for x in taken) == 20  # two of every three


def test_the_oldest_arrival_and_the_waiting_counts_follow_the_queue():
    q = FairQueue()
    assert q.oldest_arrival() is None and q.waiting("a") == 0
    q.push("a", [1, 2])
    q.push("b", [3])
    assert q.waiting("a") == 2 and len(q) == 3 and q.oldest_arrival() is not None
    assert q.share("a", 10) == 5.0 and q.share("c", 9) == 3.0
