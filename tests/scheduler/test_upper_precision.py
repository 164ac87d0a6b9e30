"""The shared upper layers served in bf16 (``SchedulerConfig.upper_precision``): each tenant's
answer in a mixed batch is its answer alone, close to fp32's and not fp32's, and refused with its
reason where the CPU would not run it faster."""

import pytest

from hmi.model import kernels
from hmi.scheduler import pipeline
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
from tests.conftest import tiny_bert
from tests.helpers.worlds import L_LOW, TEXTS, tenant_world, workload

native = pytest.mark.skipif(not kernels.NATIVE_BF16, reason="the CPU has no native bf16 (avx512_bf16 or amx_bf16)")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tenant_world(tmp_path_factory.mktemp("precision"),
                        kernels.use_onednn_linear(tiny_bert(layers=4, hidden=64, vocab=30522)))


def serve(world, pairs, **cfg):
    bert, tok, adapters, tenants, lookup = world
    s = Scheduler(bert, L_LOW, tok, adapters, tenants, tenants, SchedulerConfig(device="cpu", **cfg))
    try:
        return s.infer(pairs)
    finally:
        s.shutdown()


@native
def test_bf16_upper_layers_answer_each_tenant_of_a_mixed_batch_as_when_it_is_served_alone(world):
    """The reference: every tenant's rows computed on their own, synchronized; the fast path:
    mixed batches through the pipelined, batched pools. Both in bf16."""
    pairs = workload(40, seed=1)
    alone = serve(world, pairs, upper_precision="bf16", pipeline_retrieval=False, pipeline_swap=False,
                  batched_adapters=False)
    mixed = serve(world, pairs, upper_precision="bf16")
    for a, b in zip(mixed, alone):
        if "scores" in a:
            assert a["label"] == b["label"]
            # The adapters' fp32 products sum in another order in a mixed batch (a thin product is
            # computed transposed); a bf16 rounding downstream can then land one step apart: 1e-4,
            # fifty times under bf16's own distance to fp32 (test below), is that and no more.
            assert a["scores"] == pytest.approx(b["scores"], abs=1e-4)
        else:
            assert [t["tag"] for t in a["tokens"]] == [t["tag"] for t in b["tokens"]]


@native
def test_bf16_upper_layers_score_within_bf16_rounding_of_fp32_and_not_as_fp32(world):
    pairs = workload(24, seed=3)
    fp32 = serve(world, pairs)
    bf16 = serve(world, pairs, upper_precision="bf16")
    diffs = [abs(a["scores"][k] - b["scores"][k]) for a, b in zip(bf16, fp32) if "scores" in a for k in a["scores"]]
    assert max(diffs) < 2e-2  # a few bf16 roundings of the activations, not another tenant's answer
    assert max(diffs) > 1e-6  # the products did run in bf16


def test_bf16_is_refused_with_its_reason_where_the_cpu_does_not_multiply_it_natively(world, monkeypatch):
    monkeypatch.setattr(pipeline, "NATIVE_BF16", False)
    with pytest.raises(ValueError, match="natively.*use fp32"):
        serve(world, [("t0", TEXTS[0])], upper_precision="bf16")
    with pytest.raises(ValueError, match="unknown upper-layer precision 'fp16'"):
        serve(world, [("t0", TEXTS[0])], upper_precision="fp16")
