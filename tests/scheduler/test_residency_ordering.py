"""The GPU copy path's ordering, tested on the CPU with a fake stream and event: the compute stream
never waits on an event before the staging thread recorded it, and it is the pool's device's
stream that waits; and on a GPU with real streams and events (``make gpu-check`` runs it under
torch's CUDA sanitizer, which reports a read of a pool that no event ordered after its copy)."""

import threading
import time

import pytest
import torch

from hmi.adapters.spec import AdapterSpec
from hmi.scheduler.residency import CopyStreams, ResidencyManager
from hmi.scheduler.types import TenantEntry

H, I, LAYERS = 16, 32, 3


class FakeEvent:
    def __init__(self):
        self.recorded = False

    def record(self, stream=None):
        assert stream is not None and stream.name == "copy"
        time.sleep(0.001)
        self.recorded = True


class FakeStream:
    def __init__(self, name):
        self.name, self.waits = name, []

    def wait_stream(self, other):
        assert self.name == "copy" and other.name == "compute"

    def wait_event(self, ev):
        assert ev.recorded, "the compute stream waited on an event that was not recorded yet (a no-op on CUDA)"
        self.waits.append(ev)


def weights(spec, value):
    r = spec.bottleneck_dim(H)
    w = {"head.w": torch.full((H, 2), value), "head.b": torch.full((2,), value)}
    for li in range(LAYERS):
        w.update({f"layers.{li}.bn.down_w": torch.full((H, r), value), f"layers.{li}.bn.down_b": torch.full((r,), value),
                  f"layers.{li}.bn.up_w": torch.full((r, H), value), f"layers.{li}.bn.up_b": torch.full((H,), value)})
    return w


def test_compute_waits_only_on_recorded_events_of_the_copy_stream_and_reads_landed_weights():
    copy, compute = FakeStream("copy"), FakeStream("compute")
    devices = []
    streams = CopyStreams(copy, FakeEvent, lambda: devices.append("pool-device") or compute,
                          lambda s: __import__("contextlib").nullcontext())
    res_mgr = ResidencyManager(LAYERS, H, I, slots=4, device=torch.device("cpu"), streams=streams)
    spec = AdapterSpec("bottleneck", labels=("a", "b"))
    pool = res_mgr.pool(TenantEntry("t", spec))
    real_write = pool.write_layer

    def slow_write(*a, **kw):  # the copies land late: the compute thread must not run ahead
        time.sleep(0.01)
        return real_write(*a, **kw)

    pool.write_layer = slow_write
    for round_ in range(3):
        entries = [TenantEntry(f"t{round_}{i}", spec) for i in range(3)]
        w = {e.name: weights(spec, float(i + 1)) for i, e in enumerate(entries)}
        res = res_mgr.acquire(entries, w, pipelined=True)
        for li in range(LAYERS):
            res.wait_layer(li)
            for i, e in enumerate(entries):
                slot = pool.slot_of(e.name)
                assert float(pool.layer(li)["down_w"][slot].mean()) == float(i + 1)
        res.wait_head()
        res_mgr.release(res)
    assert len(compute.waits) == 3 * (LAYERS + 1) and devices
    res_mgr.shutdown()


def test_a_failed_copy_still_signals_every_layer_and_reports_the_error():
    streams = CopyStreams(FakeStream("copy"), FakeEvent, lambda: FakeStream("compute"),
                          lambda s: __import__("contextlib").nullcontext())
    res_mgr = ResidencyManager(LAYERS, H, I, slots=4, device=torch.device("cpu"), streams=streams)
    spec = AdapterSpec("bottleneck", labels=("a", "b"))
    entry = TenantEntry("t", spec)
    w = weights(spec, 1.0)
    del w["layers.1.bn.up_w"]
    res = res_mgr.acquire([entry], {"t": w}, pipelined=True)
    done = threading.Event()

    def waiter():
        try:
            res.wait_layer(2)
        except RuntimeError:
            done.set()

    t = threading.Thread(target=waiter)
    t.start()
    t.join(10)
    assert done.is_set()
    res_mgr.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: make gpu-check runs this where torch sees one")
def test_on_a_gpu_every_layer_read_on_the_compute_stream_sees_the_weights_its_copy_stream_landed():
    res_mgr = ResidencyManager(LAYERS, H, I, slots=4, device=torch.device("cuda"))
    assert res_mgr.cuda
    spec = AdapterSpec("bottleneck", labels=("a", "b"))
    for round_ in range(4):  # slots reused: later rounds overwrite what earlier rounds' compute read
        entries = [TenantEntry(f"t{round_}{i}", spec) for i in range(3)]
        w = {e.name: {k: v.pin_memory() for k, v in weights(spec, float(10 * round_ + i + 1)).items()}
             for i, e in enumerate(entries)}
        res = res_mgr.acquire(entries, w, pipelined=True)
        pool = res_mgr.pool(entries[0])
        for li in range(LAYERS):
            res.wait_layer(li)
            slots = torch.tensor([pool.slot_of(e.name) for e in entries], device="cuda")
            got = pool.layer(li)["down_w"].index_select(0, slots).mean((1, 2)).tolist()
            assert got == [float(10 * round_ + i + 1) for i in range(3)]
        res.wait_head()
        assert pool.head_w.index_select(0, slots)[:, 0, 0].tolist() == [float(10 * round_ + i + 1) for i in range(3)]
        res_mgr.release(res)
    res_mgr.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: make gpu-check runs this where torch sees one")
def test_the_cuda_sanitizer_the_gpu_tests_run_under_reports_a_read_no_event_orders_after_its_copy():
    from torch.cuda import _sanitizer

    if not _sanitizer.cuda_sanitizer.enabled:
        pytest.skip("torch's CUDA sanitizer is off: make gpu-check runs this with TORCH_CUDA_SANITIZER=1")
    pool = torch.zeros(1 << 16, device="cuda")
    weights = torch.ones(1 << 16).pin_memory()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        pool.copy_(weights, non_blocking=True)  # landed on the copy stream, no event recorded
    with pytest.raises(_sanitizer.CUDASanitizerErrors):
        pool.sum()  # read on the compute stream
    torch.cuda.synchronize()
