"""One tenant's bad adapter file, over-wide head or broken domain fails only its own requests; an
over-long text is refused before the tokenizer reads it."""

import torch

from hmi.adapters.spec import AdapterSpec
from hmi.errors import Kind, Refusal
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
from hmi.scheduler.types import FixedTenants, TenantEntry
from tests.helpers.worlds import L_LOW, TEXTS, make, same, world  # noqa: F401 - fixture


def scheduler_with(world, extra: dict, lookups=None, tokenizer=None, **cfg):
    bert, tok, adapters, tenants, lookup = world
    both = FixedTenants({**tenants.entries, **extra}, lookup)
    return Scheduler(bert, L_LOW, tokenizer or tok, adapters, both, lookups or both, SchedulerConfig(**cfg))


def mixed(bad: str) -> list[tuple[str, str]]:
    return [("t0", TEXTS[0]), (bad, TEXTS[1]), ("t1", TEXTS[2]), (bad, TEXTS[3]), ("t2", TEXTS[4])]


def reference(world, pairs):
    s = make(world)
    out = s.infer([p for p in pairs])
    s.shutdown()
    return out


def check_isolated(got, want, pairs, bad, code):
    for (t, _), g, w in zip(pairs, got, want):
        if t == bad:
            assert isinstance(g, Refusal) and g.code == code, g
        else:
            same(g, w)


def test_a_corrupt_adapter_file_fails_only_its_own_tenants_requests(world):
    _, _, adapters, _, _ = world
    spec = AdapterSpec("bottleneck", labels=("a", "b", "c"))
    adapters.save("broken", spec, adapters.load("t0"))
    adapters.file("broken").write_bytes(adapters.file("broken").read_bytes()[:100])  # truncated on disk
    adapters.invalidate("broken")
    pairs = mixed("broken")
    ok_pairs = [p if p[0] != "broken" else ("t0", p[1]) for p in pairs]
    s = scheduler_with(world, {"broken": TenantEntry("broken", spec)}, max_batch=8)
    got = s.infer(pairs)
    s.shutdown()
    check_isolated(got, reference(world, ok_pairs), pairs, "broken", "adapter_unreadable")
    assert got[1].kind == Kind.FAILED


def test_an_adapter_whose_head_is_wider_than_the_pools_fails_only_its_tenant(world):
    _, _, adapters, _, _ = world
    labels = tuple(f"l{i}" for i in range(40))
    spec = AdapterSpec("bottleneck", labels=labels)
    w = dict(adapters.load("t0"))
    w["head.w"], w["head.b"] = torch.zeros(32, 40), torch.zeros(40)
    adapters.save("wide", spec, w)
    pairs = mixed("wide")
    s = scheduler_with(world, {"wide": TenantEntry("wide", spec)}, max_batch=8)
    got = s.infer(pairs)
    s.shutdown()
    check_isolated(got, reference(world, [p if p[0] != "wide" else ("t0", p[1]) for p in pairs]), pairs, "wide",
                   "adapter_unreadable")
    assert "at most 32" in got[1].message


def test_a_domain_whose_plot_cannot_be_opened_fails_only_its_tenants(world):
    _, _, _, tenants, lookup = world

    class Lookups:
        def lookup_for(self, domain):
            if domain == "broken":
                raise OSError("No such file or directory: .../domains/broken/plot/data.mdb")
            return lookup

    entry = tenants.entry("t3")
    world[2].save("lawyer", entry.spec, world[2].load("t3"))
    pairs = mixed("lawyer")
    s = scheduler_with(world, {"lawyer": TenantEntry("lawyer", entry.spec, domain="broken")}, lookups=Lookups(), max_batch=8)
    got = s.infer(pairs)
    s.shutdown()
    check_isolated(got, reference(world, [p if p[0] != "lawyer" else ("t3", p[1]) for p in pairs]), pairs, "lawyer",
                   "domain_unavailable")


def test_over_long_texts_are_refused_before_the_tokenizer_reads_them(world):
    _, tok, _, _, _ = world
    seen = []

    class Recording:
        def __call__(self, texts, **kw):
            seen.extend(len(t) for t in texts)
            return tok(texts, **kw)

    s = scheduler_with(world, {}, tokenizer=Recording(), max_batch=64)
    long_text = "word " * 4000  # 20,000 characters, 4,000 words
    got = s.infer([("t0", long_text)] * 63 + [("t0", TEXTS[0])])
    s.shutdown()
    assert all(isinstance(g, Refusal) and g.code == "input_too_long" and g.kind == Kind.TOO_LARGE for g in got[:63])
    assert "label" in got[63]
    assert max(seen) < 200  # only the short text reached the tokenizer
