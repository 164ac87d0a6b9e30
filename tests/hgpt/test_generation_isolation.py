"""One generation request's failure, disconnect or hostile parameters never touch the others."""

import queue

import pytest
import torch

from hmi.errors import Kind
from hmi.hgpt.generation import EngineConfig, GenerationEngine, GenerationError, GenerationService, GenRequest
from tests.helpers.generation import PROMPTS, engine, world  # noqa: F401 - fixture


def with_tenants(world, extra, **kw):
    root, lookup, _, tenants = world
    load = lambda t: extra[t] if t in extra else tenants[t]  # noqa: E731
    return GenerationEngine(root, lookup, load, EngineConfig(rank=4, max_len=96, **kw))


def drive(e):
    while e.waiting or e.active:
        e.step()


@pytest.mark.parametrize("seed", [2**64, 2**63, -1, True])
def test_seeds_outside_the_generator_range_are_refused_up_front(world, seed):
    with pytest.raises(GenerationError) as err:
        engine(world).submit(GenRequest("t0", "hi", seed=seed, temperature=0.5))
    assert err.value.code == "bad_seed"


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, float("nan"), float("inf")])
def test_tiny_temperatures_decode_greedily_and_non_finite_ones_are_refused(world, temperature):
    e = engine(world)
    req = GenRequest("t0", "hello world", max_new_tokens=6, temperature=temperature, seed=3)
    if temperature != temperature or temperature == float("inf"):
        with pytest.raises(GenerationError):
            e.submit(req)
        return
    got = e.generate([req])[0]
    assert got == engine(world).generate([GenRequest("t0", "hello world", max_new_tokens=6)])[0]


def test_a_tenant_whose_adapter_yields_nan_fails_alone_and_frees_its_slot(world):
    _, _, _, tenants = world
    spec, w = tenants["t0"]
    e = with_tenants(world, {"poison": (spec, {k: torch.full_like(v, float("nan")) for k, v in w.items()})})
    reqs = [GenRequest(t, p, max_new_tokens=5) for t, p in PROMPTS[:3]]
    bad = GenRequest("poison", "hello", max_new_tokens=5)
    for r in reqs[:2] + [bad] + reqs[2:]:
        e.submit(r)
    drive(e)
    assert isinstance(bad.future.exception(), GenerationError) and bad.future.exception().code == "generation_failed"
    for r in reqs:
        solo = engine(world).generate([GenRequest(r.tenant, r.prompt, max_new_tokens=5)])[0]
        assert r.future.result() == solo
    assert not e.active and not e.pool._pins


def test_a_failing_stream_callback_fails_only_its_request(world):
    def boom(piece):
        raise ConnectionResetError("client went away")

    e = engine(world)
    bad = GenRequest("t1", "the cat sat on", max_new_tokens=6, on_text=boom)
    ok = GenRequest("t2", "abc", max_new_tokens=6)
    e.submit(bad)
    e.submit(ok)
    drive(e)
    assert isinstance(bad.future.exception(), ConnectionResetError)
    assert ok.future.result()["tokens"] == 6
    assert not e.pool._pins


def test_a_cancelled_request_leaves_within_one_step_and_frees_its_row_and_slot(world):
    e = engine(world)
    long = GenRequest("t0", "hello", max_new_tokens=60)
    other = GenRequest("t1", "abc", max_new_tokens=10)
    e.submit(long)
    e.submit(other)
    e.step()
    e.step()
    assert len(e.active) == 2
    long.cancel()
    e.step()
    assert [a.req for a in e.active] == [other]
    drive(e)
    assert other.future.result()["tokens"] == 10 and not e.pool._pins


def test_the_waiting_list_is_bounded_and_the_engine_takes_only_rows_it_has(world):
    root, lookup, _, tenants = world
    e = GenerationEngine(root, lookup, tenants.__getitem__, EngineConfig(rank=4, max_len=96, max_active=2))
    service = GenerationService(e, max_waiting=4)
    try:
        reqs, refused = [], 0
        for i in range(40):
            r = GenRequest("t0", f"prompt {i}", max_new_tokens=20)
            try:
                service.submit(r)
                reqs.append(r)
            except queue.Full:
                refused += 1
        assert refused > 0
        assert len(e.waiting) <= 2
        for r in reqs:
            assert r.future.result(120)["tokens"] == 20
    finally:
        service.shutdown()


def test_an_over_long_prompt_is_refused_before_tokenization(world):
    root, lookup, _, tenants = world
    calls = []
    real = root.tokenizer.__class__.__call__

    class Counting(root.tokenizer.__class__):
        def __call__(self, text, **kw):
            calls.append(len(text))
            return real(self, text, **kw)

    e = GenerationEngine(type(root)(root.model, Counting(), root.l_low), lookup, tenants.__getitem__,
                         EngineConfig(rank=4, max_len=96))
    with pytest.raises(GenerationError) as err:
        e.submit(GenRequest("t0", "word " * 4000))
    assert err.value.code == "input_too_long" and err.value.kind == Kind.TOO_LARGE
    assert calls == []


def test_an_evicted_tenants_slot_stays_reserved_while_running_requests_use_it():
    from hmi.adapters.pool import PoolExhaustedError, SlotPool

    pool = SlotPool(("lora", 2), 2, 1, 4, 8, max_labels=0, value_width=2)
    a = pool.acquire(["a"])[0]
    pool.evict("a")  # updated while a request still runs on slot a
    b = pool.acquire(["b"])[0]
    assert b["b"] != a["a"]
    with pytest.raises(PoolExhaustedError):
        pool.acquire(["c"])  # a's slot is not handed out under the running request
    pool.release(a)
    assert pool.acquire(["c"])[0]["c"] == a["a"]


def test_a_tiny_top_p_keeps_the_most_likely_token(world):
    got = engine(world).generate([GenRequest("t0", "hello world", max_new_tokens=6, temperature=2.2, top_p=1e-281, seed=3)])[0]
    greedy = engine(world).generate([GenRequest("t0", "hello world", max_new_tokens=6)])[0]
    assert got["text"] == greedy["text"]
