"""compute+insert's kept misses (hmi.plot.kept): written off the request path, bounded by use
frequency, never at the cost of a built entry, persistent, and invisible in the answers."""

import numpy as np
import pytest

from hmi.model.hplm import WindowedEncoder
from hmi.plot.kept import Keeper
from hmi.plot.keys import pack
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from tests.conftest import tiny_bert

H = 32
META = PlotMeta(root_artifact="tiny-a", l_low=2, hidden_size=H, dtype="int8")


@pytest.fixture
def encoder():
    return WindowedEncoder(tiny_bert(hidden=H), 2).eval()


def windows(start, n):
    """``n`` distinct tri-grams of real tokens."""
    return np.stack([np.full(n, 7), np.arange(start, start + n), np.full(n, 9)], axis=1)


def budget_of(entries: int) -> float:
    return entries * META.value_bytes / 2**20


def test_a_missed_window_is_answered_at_once_and_written_by_the_keeper_not_the_request(tmp_path, encoder):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    keeper = Keeper(flush_s=0.3)
    lk = PlotLookup([PlotVersion("root", store, encoder)], "compute+insert", keeper=keeper)
    first, hits = lk.window_reps(windows(10, 5))
    assert hits["computed"] == 5 and len(store) == 0  # queued: the request did not wait for LMDB
    assert keeper.flush(10)
    assert len(store) == 5 and store.kept_count() == 5 and keeper.stats["added"] == 5
    again, hits = lk.window_reps(windows(10, 5))
    assert hits["trigram:root"] == 5 and hits["computed"] == 0
    np.testing.assert_array_equal(first, again)  # the answer does not depend on how warm the PLOT is


def test_past_its_budget_a_plot_keeps_its_most_used_windows_and_never_a_built_one(tmp_path, encoder):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    built = pack(windows(500, 20))
    store.put_many(built, np.ones((20, 3, H), dtype=np.float16))
    keeper = Keeper(budget_mb=budget_of(10), flush_s=0.01)
    lk = PlotLookup([PlotVersion("root", store, encoder)], "compute+insert", keeper=keeper)
    popular, unpopular, late = windows(10, 4), windows(20, 4), windows(30, 6)
    cold, _ = lk.window_reps(np.concatenate([popular, unpopular]))
    assert keeper.flush(10)
    for _ in range(3):
        lk.window_reps(popular)
        lk.window_reps(windows(500, 20))  # built entries read: never counted, never removed
    assert keeper.flush(10)
    lk.window_reps(late)  # 14 kept > 10: the least used go until 9 remain
    assert keeper.flush(10)
    kept = store.kept()
    assert len(kept) == 9 and keeper.stats["evicted"] == 5
    assert all(kept[k][0] == 4 for k in pack(popular).tolist())
    assert not set(pack(unpopular).tolist()) & set(kept)  # used once, and before the late ones
    assert len(set(pack(late).tolist()) & set(kept)) == 5
    assert store.get_many(built)[1].all() and len(store) == 20 + 9
    warm, hits = lk.window_reps(np.concatenate([popular, unpopular]))
    assert hits["computed"] == 4  # the evicted ones, computed again: the same values
    np.testing.assert_array_equal(cold, warm)


def test_kept_windows_and_their_uses_survive_a_restart(tmp_path, encoder):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    lk = PlotLookup([PlotVersion("root", store, encoder)], "compute+insert")
    before, _ = lk.window_reps(windows(10, 3))
    lk.window_reps(windows(10, 1))
    lk.keeper.close()
    kept = store.kept()
    store.close()
    reopened = PlotStore(tmp_path / "p", readonly=True)
    assert reopened.kept() == kept and sorted(u for u, _ in kept.values()) == [1, 1, 2]
    after, hits = PlotLookup([PlotVersion("root", reopened, encoder)], "compute").window_reps(windows(10, 3))
    assert hits["trigram:root"] == 3
    np.testing.assert_array_equal(before, after)


def test_compute_insert_refuses_a_plot_opened_read_only(tmp_path, encoder):
    PlotStore(tmp_path / "p", meta=META, readonly=False).close()
    with pytest.raises(ValueError, match="read-only"):
        PlotLookup([PlotVersion("root", PlotStore(tmp_path / "p"), encoder)], "compute+insert")


def test_a_write_that_fails_costs_no_answer(tmp_path, encoder, monkeypatch):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    lk = PlotLookup([PlotVersion("root", store, encoder)], "compute+insert", keeper=Keeper(flush_s=0.01))
    real = store.update_kept

    def disk_full(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "update_kept", disk_full)
    reps, hits = lk.window_reps(windows(10, 3))
    assert lk.keeper.flush(10) and lk.keeper.stats["failed"] == 3 and len(store) == 0
    monkeypatch.setattr(store, "update_kept", real)
    again, _ = lk.window_reps(windows(10, 3))  # computed again, kept this time
    np.testing.assert_array_equal(reps, again)
    assert lk.keeper.flush(10) and len(store) == 3


GROWTH = """
import sys, threading
import numpy as np
import hmi.plot.store as store_mod
from hmi.plot.keys import pack
from hmi.plot.store import PlotMeta, PlotStore

store_mod.INITIAL_MAP_SIZE = 1 << 20  # a map that the writer below outgrows many times
s = PlotStore(sys.argv[1], meta=PlotMeta("tiny-a", 2, 64), readonly=False)
read_keys = pack(np.stack([np.full(64, 7), np.arange(64), np.full(64, 9)], 1))
s.put_many(read_keys, np.ones((64, 3, 64), dtype=np.float16))
done, bad = threading.Event(), []

def read():
    while not done.is_set():
        vals, found = s.get_many(read_keys)
        if not found.all() or not (vals == 1).all():
            bad.append(1)

readers = [threading.Thread(target=read) for _ in range(3)]
for t in readers:
    t.start()
for i in range(60):
    keys = pack(np.stack([np.full(400, 8), np.arange(i * 400, (i + 1) * 400), np.full(400, 9)], 1))
    s.update_kept(keys, np.full((400, 3, 64), 0.5, dtype=np.float32), np.ones(400, dtype=int), keys[:0], [], None)
done.set()
for t in readers:
    t.join()
print("ok", len(s), s.env.info()["map_size"] >= 1 << 23, len(bad))
"""


def test_request_threads_read_a_plot_safely_while_the_keeper_grows_its_map(tmp_path):
    """LMDB remaps a growing environment; a read whose buffers point into the old map would crash
    the process (a segfault: run in a child so that it fails this test and nothing else)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", GROWTH, str(tmp_path / "p")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["ok", str(64 + 60 * 400), "True", "0"]
