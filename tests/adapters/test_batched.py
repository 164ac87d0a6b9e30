"""The batched multi-tenant forward against the ``adapters`` library run one tenant at a time."""

import copy

import numpy as np
import pytest
import torch

from hmi.adapters.batched import Group, batched_heads, segment_bmm, upper_forward
from hmi.adapters.interop import attach, from_library, library_model
from hmi.adapters.pool import PoolExhaustedError, SlotPool
from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.model.hplm import UpperLayers
from tests.conftest import DEVICES, tiny_bert

L_LOW, H = 2, 32


def ref_segment_bmm(x, slots, w, b=None):
    return torch.stack([x[n] @ w[s] + (0 if b is None else b[s]) for n, s in enumerate(slots.tolist())])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d_out", [3, 7], ids=["thin-output-transposed", "wide-output"])
@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [2, 2, 2, 2], [1, 0, 1, 3], [3, 1, 3, 1]])
def test_segment_bmm_matches_per_request_loop(slots, d_out, device):
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 5, 6), torch.randn(4, 6, d_out), torch.randn(4, d_out)
    s = torch.tensor(slots)
    on = lambda *ts: [t.to(device) for t in ts]
    torch.testing.assert_close(segment_bmm(*on(x, s, w, b)).cpu(), ref_segment_bmm(x, s, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(segment_bmm(*on(x, s, w)).cpu(), ref_segment_bmm(x, s, w), atol=1e-5, rtol=1e-5)


TENANTS = {  # name -> spec; mixed kinds, sizes, label counts and pooling
    "t0": AdapterSpec("bottleneck", labels=("a", "b")),
    "t1": AdapterSpec("bottleneck", labels=("a", "b", "c"), pooling="mean"),
    "t2": AdapterSpec("lora", rank=4, alpha=8, labels=("x", "y")),
    "t3": AdapterSpec("lora", rank=4, alpha=8, head="tagging", labels=("N", "V", "D")),
    "t4": AdapterSpec("ia3", labels=("p", "q", "r", "s"), pooling="mean"),
    "t5": AdapterSpec("bottleneck", head="tagging", labels=("N", "V")),
    "t6": AdapterSpec("ia3", head="tagging", labels=("N", "V", "D", "X", "Y")),
    "t7": AdapterSpec("bottleneck", reduction_factor=8, labels=("a", "b")),
    "t8": AdapterSpec("lora", rank=4, alpha=8, targets="all", labels=("x", "y"), pooling="mean"),
    "t9": AdapterSpec("lora", rank=2, alpha=4, targets=("k", "ffn_out"), head="tagging", labels=("N", "V")),
}


def tiny_root_model(family: str, tmp_path_factory):
    """A tiny BERT, or a tiny random MPNet converted to HMI's layout (relative position bias included)."""
    if family == "bert":
        return tiny_bert(layers=4, hidden=H)
    from hmi.model.convert import convert_checkpoint
    from hmi.model.root import load_bert
    from tests.helpers.checkpoints import tiny_checkpoint

    tmp = tmp_path_factory.mktemp(family)
    convert_checkpoint(tiny_checkpoint(tmp, family), tmp / "bert")
    bert = load_bert(str(tmp / "bert"))
    assert bert.relative_bias is not None
    return bert


@pytest.fixture(scope="module", params=["bert", "mpnet"])
def setup(request, tmp_path_factory):
    """A library model with every tenant's adapter (random, non-trivial weights) and canonical copies."""
    bert = tiny_root_model(request.param, tmp_path_factory)
    lib = library_model(bert)
    weights = {}
    g = torch.Generator().manual_seed(1)
    for name, spec in TENANTS.items():
        attach(lib, name, spec, L_LOW)
        with torch.no_grad():
            for pname, p in lib.named_parameters():
                if f".{name}." in pname:
                    base = 1.0 if spec.kind == "ia3" else 0.0
                    p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
        w = from_library(lib, name, spec, L_LOW)
        w["head.w"] = torch.randn(H, spec.num_labels, generator=g)
        w["head.b"] = torch.randn(spec.num_labels, generator=g)
        weights[name] = w
    lib.eval()
    return bert, lib, weights


def reference(lib, name, spec, weights, hidden, mask):
    lib.set_active_adapters(name)
    out = UpperLayers(lib, L_LOW)(hidden, mask)
    lib.set_active_adapters(None)
    if spec.head == "tagging":
        return out, out @ weights["head.w"] + weights["head.b"]
    vec = out.mean(1, keepdim=True) if spec.pooling == "mean" else out[:, :1]  # one unpadded request
    return out, vec @ weights["head.w"] + weights["head.b"]


def pools_for(bert, specs, n_slots=4, device="cpu"):
    pools = {}
    for spec in specs:
        sig = spec.signature(H)
        if sig not in pools:
            pools[sig] = SlotPool(sig, n_slots, 2, H, bert.config.intermediate_size, max_labels=6,
                                  scaling=spec.scaling, device=device)
    return pools


def run_batched(bert, weights, batch, hidden, mask, pools, device="cpu"):
    """The serving path's batched forward on ``device`` (the pools' device); outputs on the CPU."""
    groups, acquired = [], []
    by_sig = {}
    for row, name in enumerate(batch):
        by_sig.setdefault(TENANTS[name].signature(H), []).append((row, name))
    for sig, members in by_sig.items():
        pool = pools[sig]
        slots, missing = pool.acquire([n for _, n in members])
        for n in missing:
            pool.write(slots[n], weights[n])
        acquired.append((pool, slots))
        rows = torch.tensor([r for r, _ in members], device=device)
        groups.append(Group(rows, torch.tensor([slots[n] for _, n in members], device=device), pool,
                            all_rows=len(by_sig) == 1))
    tagging = torch.tensor([TENANTS[n].head == "tagging" for n in batch], device=device)
    mean = torch.tensor([TENANTS[n].pooling == "mean" for n in batch], device=device)
    layers, bias = UpperLayers(bert, L_LOW).layers, getattr(bert, "relative_bias", None)
    if device != "cpu":
        layers, bias = copy.deepcopy(layers).to(device), None if bias is None else copy.deepcopy(bias).to(device)
    hidden, mask = hidden.to(device), mask.to(device)
    with torch.no_grad():
        out = upper_forward(layers, hidden, mask, groups, relative_bias=bias)
        logits = batched_heads(out, groups, tagging, mask, mean)
    for pool, slots in acquired:
        pool.release(slots)
    return out.cpu(), logits.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_batched_forward_of_mixed_tenants_equals_library_one_at_a_time(setup, device):
    bert, lib, weights = setup
    batch = ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8", "t9", "t2", "t0", "t6", "t8", "t0"]  # repeats included
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 9, size=len(batch))
    T = int(lengths.max())
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    torch.manual_seed(3)
    hidden = torch.randn(len(batch), T, H)
    out, logits = run_batched(bert, weights, batch, hidden, mask, pools_for(bert, TENANTS.values(), device=device), device)
    with torch.no_grad():
        for i, name in enumerate(batch):
            n = int(lengths[i])
            ref_out, ref_logits = reference(lib, name, TENANTS[name], weights[name], hidden[i:i + 1, :n], mask[i:i + 1, :n])
            torch.testing.assert_close(out[i, :n], ref_out[0], atol=1e-4, rtol=0)
            c = TENANTS[name].num_labels
            want = ref_logits[0] if TENANTS[name].head == "tagging" else ref_logits[0, :1]
            torch.testing.assert_close(logits[i, : want.shape[0], :c], want, atol=1e-4, rtol=0)


def test_single_kind_batch_uses_whole_batch_path(setup):
    bert, lib, weights = setup
    batch = ["t0", "t1", "t0", "t5"]
    mask = torch.ones(4, 6, dtype=torch.long)
    hidden = torch.randn(4, 6, H)
    out, _ = run_batched(bert, weights, batch, hidden, mask, pools_for(bert, [TENANTS[n] for n in batch]))
    with torch.no_grad():
        for i, name in enumerate(batch):
            ref_out, _ = reference(lib, name, TENANTS[name], weights[name], hidden[i:i + 1], mask[i:i + 1])
            torch.testing.assert_close(out[i], ref_out[0], atol=1e-4, rtol=0)


def test_pool_evicts_lru_and_never_evicts_pinned_slots():
    pool = SlotPool(("ia3",), 2, 1, 4, 8)
    s1, miss1 = pool.acquire(["a"])
    assert miss1 == ["a"]
    s2, _ = pool.acquire(["b"])
    pool.release(s2)
    s3, miss3 = pool.acquire(["c"])  # evicts b (a is pinned)
    assert miss3 == ["c"] and pool.slot_of("b") is None and pool.slot_of("a") == s1["a"]
    with pytest.raises(PoolExhaustedError):
        pool.acquire(["d"])  # a and c pinned, no slot can be freed
    assert pool.slot_of("a") == s1["a"] and pool.slot_of("c") == s3["c"]
    pool.release(s1)
    pool.release(s3)
    s4, miss4 = pool.acquire(["a", "d"])
    assert miss4 == ["d"] and s4["a"] == s1["a"] and pool.stats["device_hits"] >= 1


def test_batch_needing_more_slots_than_pool_is_refused_not_wrong():
    pool = SlotPool(("ia3",), 3, 1, 4, 8)
    with pytest.raises(PoolExhaustedError, match="4 distinct tenants"):
        pool.acquire(["a", "b", "c", "d"])
    assert pool.resident() == []


def test_evicting_a_pinned_tenant_frees_its_slot_only_after_release():
    pool = SlotPool(("ia3",), 1, 1, 4, 8)
    s, _ = pool.acquire(["a"])
    pool.evict("a")
    with pytest.raises(PoolExhaustedError):
        pool.acquire(["b"])
    pool.release(s)
    assert pool.acquire(["b"])[1] == ["b"]


@pytest.mark.parametrize("kw, msg", [
    ({"kind": "prefix"}, "unknown adapter kind"),
    ({"kind": "lora", "rank": 0}, "rank"),
    ({"labels": ()}, "at least 2 labels"),
    ({"labels": ("a", "a")}, "distinct"),
    ({"head": "span"}, "unknown head"),
    ({"reduction_factor": 0}, "reduction_factor"),
    ({"pooling": "max"}, "unknown pooling"),
    ({"head": "tagging", "pooling": "mean"}, "pooling applies to classification"),
    ({"kind": "lora", "targets": ("q", "o")}, "unknown LoRA target 'o'"),
    ({"kind": "lora", "targets": ()}, "at least one target"),
    ({"kind": "lora", "targets": ("v", "v")}, "distinct"),
    ({"targets": "all"}, "targets apply to LoRA adapters, not bottleneck"),
])
def test_spec_validation_gives_clear_errors(kw, msg):
    args = {"labels": ("a", "b"), **kw}
    with pytest.raises(SpecError, match=msg):
        AdapterSpec(**args)


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [2, 2, 2], [3, 1, 3, 0, 1, 3], [5]])
def test_segment_bmm_with_a_host_plan_matches_the_loop_and_never_reads_the_device(slots, monkeypatch):
    from hmi.adapters.batched import segment_plan

    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(len(slots), 5, 8, generator=g), torch.randn(6, 8, 4, generator=g), torch.randn(6, 4, generator=g)
    s = torch.tensor(slots)
    plan = segment_plan(slots)

    def no_sync(*a, **kw):
        raise AssertionError("a host-device synchronization inside the layer loop")

    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    monkeypatch.setattr(torch, "unique", no_sync)
    got, got_nb = segment_bmm(x, s, w, b, plan=plan), segment_bmm(x, s, w, plan=plan)
    monkeypatch.undo()
    torch.testing.assert_close(got, ref_segment_bmm(x, s, w, b))
    torch.testing.assert_close(got_nb, ref_segment_bmm(x, s, w))


def test_lora_targets_are_kept_in_canonical_order_and_name_their_pool():
    every = AdapterSpec("lora", labels=("a", "b"), targets="all")
    assert every.targets == ("q", "k", "v", "ffn_in", "ffn_out")
    assert AdapterSpec("lora", labels=("a", "b"), targets="ffn_out,q").targets == ("q", "ffn_out")
    assert AdapterSpec.from_dict(every.to_dict()) == every
    assert AdapterSpec.from_dict({"kind": "lora", "labels": ["a", "b"]}).targets == ("q", "v")  # specs saved before targets
    assert every.signature(H) != AdapterSpec("lora", labels=("a", "b")).signature(H)
    pool = SlotPool(every.signature(H), 2, 1, H, 4 * H, scaling=every.scaling)
    assert {k: tuple(v.shape[1:]) for k, v in pool.layer(0).items() if k.startswith("ffn")} == {
        "ffn_in_A": (H, 8), "ffn_in_B": (8, 4 * H), "ffn_out_A": (4 * H, 8), "ffn_out_B": (8, H)}


def test_a_task_without_a_kind_gets_its_heads_default_adapter_and_foreign_options_are_refused():
    tagger = AdapterSpec.for_task("tagging", ("N", "V"))
    assert (tagger.kind, tagger.rank, tagger.alpha, tagger.targets) == ("lora", 16, 16.0, ("q", "k", "v", "ffn_in", "ffn_out"))
    assert AdapterSpec.for_task("tagging", ("N", "V"), rank=4).rank == 4
    assert AdapterSpec.for_task("tagging", ("N", "V"), "lora").targets == ("q", "v")  # a named kind: its own defaults
    assert AdapterSpec.for_task("classification", ("a", "b"), pooling="mean") == AdapterSpec(labels=("a", "b"), pooling="mean")
    with pytest.raises(SpecError, match="reduction_factor applies to bottleneck adapters, not lora .the default adapter of a tagging"):
        AdapterSpec.for_task("tagging", ("N", "V"), reduction_factor=4)
    with pytest.raises(SpecError, match="rank applies to lora adapters, not bottleneck$"):
        AdapterSpec.for_task("classification", ("a", "b"), "bottleneck", rank=8)
    with pytest.raises(SpecError, match="targets applies to lora adapters, not ia3"):
        AdapterSpec.for_task("classification", ("a", "b"), "ia3", targets=["q"])


def test_pool_refuses_an_adapter_with_weights_beyond_its_upper_layers():
    """An adapter trained at a lower split has more upper layers than the pool: served in part it
    would answer wrongly without a word, so the check refuses it."""
    pool = SlotPool(("ia3",), 1, 1, 4, 8, max_labels=0)
    one_layer = pool.read(0, 0)
    pool.check(one_layer, 0)
    two_layers = {**one_layer, **{key.replace("layers.0.", "layers.1."): t for key, t in one_layer.items()}}
    with pytest.raises(ValueError, match="beyond the 1 upper layer"):
        pool.check(two_layers, 0)
