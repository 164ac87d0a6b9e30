import random
import threading
import time

import pytest
import torch

from hmi.adapters.spec import AdapterSpec
from hmi.adapters.store import AdapterStore
from hmi.errors import Refusal
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import load_tokenizer
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from hmi.scheduler.compute import split_by_length
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
from hmi.scheduler.types import FixedTenants, InferRequest, SchedulerClosedError, TenantEntry
from hmi.training.finetune import tenant_model
from tests.conftest import DEVICES
from tests.helpers.worlds import L_LOW, TEXTS, H, make, same, workload, world  # noqa: F401


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("switches", [
    {}, {"pipeline_retrieval": False}, {"pipeline_swap": False}, {"batched_adapters": False},
    {"pool_slots": 2, "max_batch": 7},
])
def test_pipelined_results_equal_synchronized_results_for_many_tenants(world, switches, device):
    """On a GPU: upper layers, pools and heads there, adapters copied on their own stream; the
    reference is the synchronized path on the CPU."""
    pairs = workload()
    ref = make(world, pipeline_retrieval=False, pipeline_swap=False, batched_adapters=False, device="cpu")
    want = ref.infer(pairs)
    ref.shutdown()
    s = make(world, device=device, **switches)
    got = s.infer(pairs)
    s.shutdown()
    for a, b in zip(got, want):
        same(a, b)
    tagged = [g for g, (t, _) in zip(got, pairs) if int(t[1:]) % 4 == 3]
    assert tagged and all(len(g["tokens"]) > 3 for g in tagged)


def partitions(items):
    """Every partition of ``items`` into groups."""
    if not items:
        yield []
        return
    for p in partitions(items[1:]):
        for i in range(len(p)):
            yield p[:i] + [[items[0]] + p[i]] + p[i + 1:]
        yield [[items[0]]] + p


def cost(groups, lengths, overhead):
    return sum(overhead + len(g) * max(lengths[r] for r in g) for g in groups)


@pytest.mark.parametrize("overhead", [0, 3, 64, 10_000])
def test_length_groups_compute_the_fewest_token_rows_of_any_partition_of_the_batch(overhead):
    """The reference: every partition of the rows, not only runs of the rows sorted by length."""
    rng = random.Random(overhead)
    for _ in range(40):
        lengths = [rng.choice([2, 5, 9, 20, 64, 128]) for _ in range(9)]
        rows = rng.sample(range(9), rng.randint(1, 7))
        groups = split_by_length(rows, lengths, overhead)
        assert sorted(r for g in groups for r in g) == sorted(rows)
        assert cost(groups, lengths, overhead) == min(cost(p, lengths, overhead) for p in partitions(rows))
        if len(groups) == 1:
            assert groups == [rows]  # the batch's own order: the scheduler's no-copy path


def test_a_batch_of_short_and_long_texts_runs_in_length_groups_with_the_answers_of_one_padded_pass(world):
    long = " ".join(TEXTS[:5])
    pairs = [(f"t{i % 12}", long if i % 2 else "Good film.") for i in range(32)]
    grouped = make(world)
    got, groups = grouped.infer(pairs), grouped.stats["length_groups"]
    grouped.shutdown()
    padded = make(world, length_groups=False)
    want, none = padded.infer(pairs), padded.stats["length_groups"]
    padded.shutdown()
    assert groups >= 1 and none == 0
    for a, b in zip(got, want):
        same(a, b)


def test_results_stay_with_their_requests_under_random_stage_delays(world):
    bert, tok, adapters, tenants, lookup = world
    rng = random.Random(1)

    class SlowLookup:
        def merged(self, ids, mask):
            time.sleep(rng.random() * 0.02)
            return lookup.merged(ids, mask)

    pairs = workload(30, seed=2)
    ref = make(world)
    want = ref.infer(pairs)
    ref.shutdown()
    s = Scheduler(bert, L_LOW, tok, adapters, tenants, FixedTenants(tenants.entries, SlowLookup()), SchedulerConfig(max_batch=3))
    got = s.infer(pairs)
    s.shutdown()
    for a, b in zip(got, want):
        same(a, b)


def test_small_batches_queued_behind_a_busy_pipeline_run_coalesced_with_the_same_results(world):
    bert, tok, adapters, tenants, lookup = world
    gate = threading.Event()

    class GatedLookup:
        def merged(self, ids, mask):
            gate.wait(30)
            return lookup.merged(ids, mask)

    pairs = workload(24, seed=3)
    ref = make(world)
    want = ref.infer(pairs)
    ref.shutdown()
    s = Scheduler(bert, L_LOW, tok, adapters, tenants, FixedTenants(tenants.entries, GatedLookup()),
                  SchedulerConfig(max_batch=8, queue_depth=1, retrieval_threads=1))
    reqs = [InferRequest(t, x) for t, x in pairs]
    for r in reqs:  # one request per batch, as a batcher under light load would send them
        s.submit([r])
    gate.set()
    got = [r.future.result(60) for r in reqs]
    s.shutdown()
    assert s.stats["coalesced"] > 0
    assert s.stats["batches"] < len(reqs)
    for a, b in zip(got, want):
        same(a, b)


def test_a_failing_request_fails_alone_with_a_clear_error(world):
    s = make(world, max_len=32)
    pairs = [("t0", TEXTS[0]), ("nobody", TEXTS[0]), ("t1", "word " * 100), ("ghost", TEXTS[1]), ("t2", TEXTS[2])]
    out = s.infer(pairs)
    s.shutdown()
    assert "label" in out[0] and "label" in out[4]
    assert isinstance(out[1], Refusal) and out[1].code == "unknown_tenant"
    assert isinstance(out[2], Refusal) and out[2].code == "input_too_long"
    assert isinstance(out[3], Refusal) and out[3].code == "adapter_missing"


def test_shutdown_with_cancel_fails_queued_work_and_does_not_hang(world):
    s = make(world, max_batch=2)
    reqs = [InferRequest(t, x) for t, x in workload(40)]
    s.submit(reqs)
    start = time.time()
    s.shutdown(cancel=True)
    assert time.time() - start < 60
    assert all(r.future.done() for r in reqs)
    assert any(isinstance(r.future.exception(), SchedulerClosedError) for r in reqs if r.future.exception())
    with pytest.raises(SchedulerClosedError):
        s.submit([InferRequest("t0", "x")])


def test_shutdown_without_cancel_finishes_queued_work(world):
    s = make(world, max_batch=4)
    reqs = [InferRequest(t, x) for t, x in workload(16)]
    s.submit(reqs)
    s.shutdown()
    assert all(r.future.done() and r.future.exception() is None for r in reqs)


def test_trace_records_overlapping_stages(world, tmp_path):
    s = make(world, trace=True, max_batch=4)
    s.infer(workload(24))
    s.shutdown()
    s.tracer.export(tmp_path / "trace.json")
    import json

    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["cat"] for e in events} >= {"R", "A", "C"}
    assert len({e["args"]["batch"] for e in events}) == 6


def test_scheduler_sets_the_configured_gil_switch_interval_and_none_keeps_it(world):
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        make(world, gil_switch_interval_s=None).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        make(world, gil_switch_interval_s=0.0005).shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_served_scores_equal_the_fine_tune_model_on_the_same_lookup(world, pooling, device):
    """Serving (batched pool, PLOT lookup, pooled head) computes what the fine-tune job trained."""
    from hmi.model.hplm import as_numpy_ids

    bert, tok, adapters, _, lookup = world
    spec = AdapterSpec("bottleneck", labels=("a", "b", "c"), pooling=pooling)
    name = f"pool-{pooling}"
    trainer = tenant_model(bert, L_LOW, spec, seed=5)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    adapters.save(name, spec, trainer.weights())
    trainer.load(adapters.load(name))  # the fp16 weights that serving reads
    s = Scheduler(bert, L_LOW, tok, adapters, *[FixedTenants({name: TenantEntry(name, spec)}, lookup)] * 2, SchedulerConfig(device=device))
    got = s.infer([(name, text) for text in TEXTS])
    s.shutdown()
    ids, mask = as_numpy_ids(tok(TEXTS)["input_ids"])
    with torch.no_grad():
        probs = torch.softmax(trainer.logits(lookup.merged(ids, mask), torch.from_numpy(mask), train=False), -1)
    for g, p in zip(got, probs):
        assert [g["scores"][c] for c in spec.labels] == pytest.approx(p.tolist(), abs=1e-4)


@pytest.mark.parametrize("kind", ["bottleneck", "lora", "ia3"])
def test_served_scores_equal_the_fine_tune_model_on_an_mpnet_root(tmp_path, kind):
    """The whole serving path on a converted MPNet root (relative position bias in the windows
    and in the shared upper layers) computes what the library-trained tenant computes."""
    from hmi.model.convert import convert_checkpoint
    from hmi.model.hplm import as_numpy_ids
    from hmi.model.root import load_bert
    from tests.helpers.checkpoints import TEXTS as WORD_TEXTS
    from tests.helpers.checkpoints import tiny_checkpoint

    convert_checkpoint(tiny_checkpoint(tmp_path, "mpnet"), tmp_path / "root")
    bert, tok = load_bert(str(tmp_path / "root")), load_tokenizer(str(tmp_path / "root"))
    enc = WindowedEncoder(bert, L_LOW).eval()
    store = PlotStore(tmp_path / "plot", meta=PlotMeta("tiny-mpnet", L_LOW, H, dtype="int8"), readonly=False)
    lookup = PlotLookup([PlotVersion("root", store, enc)], policy="compute+insert")
    adapters = AdapterStore(tmp_path / "tenants")
    spec = AdapterSpec(kind, labels=("a", "b", "c"), pooling="mean")
    trainer = tenant_model(bert, L_LOW, spec, seed=5)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    adapters.save("m", spec, trainer.weights())
    trainer.load(adapters.load("m"))
    s = Scheduler(bert, L_LOW, tok, adapters, *[FixedTenants({"m": TenantEntry("m", spec)}, lookup)] * 2, SchedulerConfig())
    got = s.infer([("m", text) for text in WORD_TEXTS])
    s.shutdown()
    ids, mask = as_numpy_ids(tok(WORD_TEXTS)["input_ids"])
    with torch.no_grad():
        probs = torch.softmax(trainer.logits(lookup.merged(ids, mask), torch.from_numpy(mask), train=False), -1)
    for g, p in zip(got, probs):
        assert [g["scores"][c] for c in spec.labels] == pytest.approx(p.tolist(), abs=1e-4)
    store.close()


@pytest.mark.parametrize("device", DEVICES)
def test_embeddings_of_the_root_and_of_tenants_batched_with_scoring_equal_their_pooled_upper_layers(world, device):
    """One batch mixes root embeddings, tenant embeddings and scoring; each embedding is the root's
    sentence pooling (mean over real tokens, L2-normalized) of the upper layers as the root's own
    Hugging Face layers compute them (no adapter) or as the tenant's fine-tune model does (with
    its adapter), and the scores are those of a batch without embeddings."""
    from hmi.model.hplm import as_numpy_ids
    from hmi.model.root import SentencePooling, extended_mask

    bert, tok, adapters, tenants, lookup = world
    s = Scheduler(bert, L_LOW, tok, adapters, tenants, tenants, SchedulerConfig(device=device))
    texts = TEXTS[:5]
    reqs = [InferRequest(None, t, embed=True) for t in texts] + [InferRequest("t1", t, embed=True) for t in texts] \
        + [InferRequest("t0", t) for t in texts]
    s.submit(reqs)
    got = [r.future.result(60) for r in reqs]
    alone = s.infer([("t0", t) for t in texts])
    s.shutdown()
    ids, mask = as_numpy_ids(tok(texts)["input_ids"])
    mask_t = torch.from_numpy(mask)
    with torch.no_grad():
        h = lookup.merged(ids, mask)
        plain = h
        for layer in bert.encoder.layer[L_LOW:]:
            plain = layer(plain, extended_mask(mask_t))[0]
        tenant = tenant_model(bert, L_LOW, tenants.entry("t1").spec, seed=0)
        tenant.load(adapters.load("t1"))
        adapted = tenant.upper(h, mask_t)
    pool = SentencePooling("mean", normalize=True)
    for want, out in zip([*pool(plain, mask_t), *pool(adapted, mask_t)], got[:10]):
        assert out["embedding"].shape == (H,) and not out["truncated"]
        assert torch.from_numpy(out["embedding"]) == pytest.approx(want, abs=2e-5)
        assert float(torch.linalg.vector_norm(torch.from_numpy(out["embedding"]))) == pytest.approx(1.0, abs=1e-5)
    assert [g["tokens"] for g in got[:5]] == mask.sum(1).tolist()
    assert not torch.allclose(torch.from_numpy(got[0]["embedding"]), torch.from_numpy(got[5]["embedding"]), atol=1e-3)
    for a, b in zip(got[10:], alone):
        same(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [AdapterSpec("bottleneck", labels=("a", "b", "c"), pooling="mean", whole=True),
                                  AdapterSpec("lora", rank=4, labels=("x", "y"), whole=True),
                                  AdapterSpec("ia3", labels=("p", "q"), whole=True),
                                  AdapterSpec("lora", rank=4, head="tagging", labels=("N", "V"), whole=True)],
                         ids=["bottleneck", "lora", "ia3", "tagging"])
def test_a_whole_tenant_in_a_mixed_batch_answers_as_the_full_root_with_its_library_adapter_in_every_layer(
        world, spec, device):
    """A ``whole`` tenant's rows skip the PLOT and run every layer of the root with its adapter:
    its answers are the ``adapters`` library model's (the teacher a fine-tune trains), while the
    windowed tenants batched with it answer as they do alone."""
    from dataclasses import replace

    from hmi.adapters.heads import decode, word_starts
    from hmi.adapters.interop import to_library
    from hmi.model.hplm import as_numpy_ids
    from hmi.training.full_context import FullContextModel

    bert, tok, adapters, tenants, lookup = world
    teacher = FullContextModel(bert, replace(spec, whole=False), "adapter", 0, seed=3)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.2 * torch.randn(p.shape))
    name = f"whole-{spec.kind}-{spec.head}"
    adapters.save(name, spec, teacher.upper_weights(0))
    stored = adapters.load(name)  # the fp16 weights that serving reads, back in the reference
    to_library(teacher.model, "t", spec, L_LOW, stored)
    with torch.no_grad():
        teacher.head.weight.copy_(stored["head.w"].t())
        teacher.head.bias.copy_(stored["head.b"])
    mixed = FixedTenants({**tenants.entries, name: TenantEntry(name, spec)}, lookup)
    s = Scheduler(bert, L_LOW, tok, adapters, mixed, mixed, SchedulerConfig(device=device))
    others = workload(16, seed=4)
    alone = s.infer(others)
    got = s.infer([(name, t) for t in TEXTS] + others)
    s.shutdown()
    for a, b in zip(alone, got[len(TEXTS):]):
        same(a, b)
    enc = tok(TEXTS, return_offsets_mapping=True)
    ids, mask = (torch.from_numpy(a) for a in as_numpy_ids(enc["input_ids"]))
    with torch.no_grad():
        logits = teacher.logits(None, ids, mask, False)
    for i, g in enumerate(got[:len(TEXTS)]):
        if spec.head == "tagging":
            same(decode(spec, logits[i], word_starts(enc, i, TEXTS[i])), g)
        else:
            probs = torch.softmax(logits[i], -1)
            assert [g["scores"][c] for c in spec.labels] == pytest.approx(probs.tolist(), abs=1e-4)


def test_a_whole_tenants_rows_run_the_lower_layers_alone_and_the_upper_layers_in_the_pass_of_the_others(world):
    """Its lower layers (with its adapter) in a pass of their own, then one pass of the upper layers
    for every row of the batch: the upper layers are not run twice. Answers: as alone."""
    from hmi.training.finetune import initial_weights

    bert, tok, adapters, tenants, lookup = world
    spec = AdapterSpec("lora", rank=4, labels=("x", "y"), whole=True)
    g = torch.Generator().manual_seed(5)
    adapters.save("whole", spec, {k: v + 0.2 * torch.randn(v.shape, generator=g)
                                  for k, v in initial_weights(bert.config, L_LOW, spec, 5).items()})
    mixed = FixedTenants({**tenants.entries, "whole": TenantEntry("whole", spec)}, lookup)
    s = Scheduler(bert, L_LOW, tok, adapters, mixed, mixed, SchedulerConfig(length_groups=False, trace=True))
    pairs = [("whole", TEXTS[0]), ("t1", TEXTS[1]), ("whole", TEXTS[2]), ("t2", TEXTS[3])]
    alone = [s.infer([pair])[0] for pair in pairs]
    s.tracer.events.clear()
    got = s.infer(pairs)
    s.shutdown()
    passes = [(e["name"], e["args"]["size"]) for e in s.tracer.events if e["cat"] == "C"]
    assert passes == [("C:lower", 2), ("C:upper", 4)]
    for a, b in zip(got, alone):
        same(a, b)


def test_a_whole_tenants_upper_layers_wait_for_the_copies_its_lower_pass_started(world, monkeypatch):
    """The lower pass reads the first layers of a newly loaded whole tenant while the staging
    thread still copies the others; the upper pass, which finds the tenant resident, must read
    those layers only once they have landed. Slow copies of the upper layers make the race certain."""
    from hmi.adapters.pool import SlotPool
    from hmi.training.finetune import initial_weights

    bert, tok, adapters, tenants, lookup = world
    spec = AdapterSpec("bottleneck", labels=("x", "y"), whole=True)
    g = torch.Generator().manual_seed(6)
    adapters.save("slow", spec, {k: v + 0.2 * torch.randn(v.shape, generator=g)
                                 for k, v in initial_weights(bert.config, L_LOW, spec, 6).items()})
    mixed = FixedTenants({**tenants.entries, "slow": TenantEntry("slow", spec)}, lookup)
    pairs = [("slow", TEXTS[0]), ("t1", TEXTS[1])]
    sync = Scheduler(bert, L_LOW, tok, adapters, mixed, mixed, SchedulerConfig(pipeline_swap=False))
    want = sync.infer(pairs)
    sync.shutdown()
    write = SlotPool.write_layer

    def slow(self, slot, li, w, non_blocking=False):
        if li >= L_LOW and len(self.layers) > L_LOW:
            time.sleep(0.3)
        return write(self, slot, li, w, non_blocking)

    monkeypatch.setattr(SlotPool, "write_layer", slow)
    s = Scheduler(bert, L_LOW, tok, adapters, mixed, mixed, SchedulerConfig(pipeline_swap=True))
    s.infer(pairs[1:])  # the windowed tenant resident: the upper pass has nothing to copy of its own
    got = s.infer(pairs)
    s.shutdown()
    for a, b in zip(got, want):
        same(a, b)
