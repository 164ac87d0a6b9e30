"""Start-time fair queuing across tenants (hmi.scheduler.fair), the order both the encoder's
batcher and the decoder's generation service take requests in."""

import random

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


def _filled(pushes, weights):
    q = FairQueue(weight=weights.__getitem__)
    for tenant, items in pushes:
        q.push(tenant, items)
    return q


def test_take_with_limits_equals_the_pop_order_with_the_tenants_at_their_limit_skipped():
    rng = random.Random(0)
    for case in range(200):
        tenants = [f"t{i}" for i in range(rng.randint(1, 6))]
        weights = {t: rng.choice([1.0, 1.0, 2.0, 0.5, rng.uniform(0.3, 3.0)]) for t in tenants}
        pushes = [(t, [f"{t}-{case}-{k}-{j}" for j in range(rng.randint(1, 8))])
                  for k, t in enumerate(rng.choices(tenants, k=rng.randint(1, 12)))]
        limits = {t: rng.choice([None, 0, 1, 2, 5]) for t in tenants}
        n = rng.randint(0, 40)
        # The slow, obvious reference: every request in pop order, then the first n allowed.
        ref_q = _filled(pushes, weights)
        order = [ref_q.pop() for _ in range(len(ref_q))]
        taken_ref, count = [], {}
        for item in order:
            t = item.split("-")[0]
            if len(taken_ref) < n and (limits[t] is None or count.get(t, 0) < limits[t]):
                taken_ref.append(item)
                count[t] = count.get(t, 0) + 1
        q = _filled(pushes, weights)
        assert q.take(n, limits.__getitem__) == taken_ref
        left = [q.pop() for _ in range(len(q))]
        assert sorted(left) == sorted(set(order) - set(taken_ref))
        for t in tenants:  # each tenant's requests still wait in their own order
            assert [x for x in left if x.startswith(t + "-")] == [x for x in order if x.startswith(t + "-") and x not in taken_ref]


def test_a_tenant_held_at_its_limit_is_taken_first_next_time():
    q = FairQueue()
    q.push("noisy", [f"n{i}" for i in range(10)])
    assert q.take(4, {"noisy": 2}.get) == ["n0", "n1"]
    q.push("quiet", ["q0"])
    assert q.take(4, {"noisy": 2}.get) == ["n2", "q0", "n3"]
