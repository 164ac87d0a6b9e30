"""PLOT value formats: fp16 and int8 rows with scales, in one or several LMDB records."""

import numpy as np
import pytest

from hmi.plot import codec
from hmi.plot.store import PlotMeta, PlotStore


def values(n_entries=50, n=3, hidden=384, seed=0):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n_entries, n, hidden)).astype(np.float32)
    v[:, :, 7] *= 20  # an outlier dimension, as BERT's hidden states have
    v[3] = 0  # an all-zero value (a masked row's), whose scale must not divide by zero
    return v


def test_int8_rows_round_trip_within_half_a_step_of_each_rows_scale():
    v = values()
    got = codec.decode(codec.encode(v, "int8"), "int8", 3, 384).astype(np.float32)
    step = np.abs(v).max(axis=2, keepdims=True) / 127
    assert np.all(np.abs(got - v) <= step / 2 + 2e-3 * np.abs(v) + 1e-6)  # + fp16 rounding of the result
    assert (got[3] == 0).all()


def test_fp16_round_trip_is_fp16_rounding():
    v = values()
    got = codec.decode(codec.encode(v, "float16"), "float16", 3, 384)
    assert np.array_equal(got, v.astype(np.float16))


@pytest.mark.parametrize("size,chunks", [(2304, 2), (1164, 1), (2316, 2), (4608, 4), (768, 1)])
def test_leaf_chunks_keep_every_record_in_a_leaf_page_at_the_least_cost(size, chunks):
    assert codec.leaf_chunks(size) == chunks
    record = -(-size // chunks) + 8 + (chunks > 1) + 8
    assert record <= codec.MAX_NODE


@pytest.mark.parametrize("dtype,chunks", [("float16", 1), ("float16", 3), ("int8", 1), ("int8", 3)])
def test_store_round_trips_values_in_every_format_and_layout(tmp_path, dtype, chunks):
    meta = PlotMeta("a", 3, 384, dtype=dtype, chunks=chunks)
    store = PlotStore(tmp_path / "p", meta=meta, readonly=False)
    v = values()
    keys = np.arange(1000, 1000 + len(v) * 7, 7, dtype=np.uint64)
    store.put_many(keys, v)
    assert len(store) == len(keys)
    assert np.array_equal(store.keys(), keys)
    query = np.array([keys[5], 3, keys[0], keys[5], 10**9], dtype=np.uint64)  # repeats and misses
    store.put_many(keys[[1, 1]], v[[2, 4]])  # out of order now: a repeated key, the last value wins
    got, found = store.get_many(query)
    assert found.tolist() == [True, False, True, True, False]
    want = codec.decode(codec.encode(v[[5, 0, 5]], dtype), dtype, 3, 384)
    assert np.array_equal(got[found], want)
    assert np.array_equal(store.get_many(keys[[1]])[0][0], codec.decode(codec.encode(v[[4]], dtype), dtype, 3, 384)[0])
    assert (got[~found] == 0).all() and got.dtype == np.float16
    store.close()


def test_leaf_records_take_less_disk_than_overflow_pages(tmp_path):
    v = np.repeat(values(200), 5, axis=0)
    keys = np.arange(len(v), dtype=np.uint64) * 3 + 1
    size = {}
    for dtype, chunks in (("float16", 1), ("float16", 3), ("int8", 1)):
        store = PlotStore(tmp_path / f"{dtype}{chunks}", meta=PlotMeta("a", 3, 384, dtype=dtype, chunks=chunks),
                          readonly=False)
        store.put_many(keys, v)
        size[(dtype, chunks)] = store.stats()["file_bytes"] / len(keys)
        store.close()
    assert size[("float16", 3)] < 1.15 * 2304 < 0.7 * size[("float16", 1)]  # leaf pages, packed by appending
    assert size[("int8", 1)] < 1.25 * 1164


def test_a_plot_keeps_its_value_format_and_is_checked_on_what_its_values_mean(tmp_path):
    from hmi.plot.store import PlotMismatchError

    old = PlotStore(tmp_path / "p", meta=PlotMeta("a", 3, 384), readonly=False)  # fp16, one record
    old.put_many(np.array([5], dtype=np.uint64), values()[:1])
    old.close()
    newer = PlotMeta("a", 3, 384, dtype="int8", chunks=3)
    store = PlotStore(tmp_path / "p", readonly=True, expect=newer)
    assert (store.meta.dtype, store.meta.chunks) == ("float16", 1)
    assert store.get_many(np.array([5], dtype=np.uint64))[1].all()
    store.close()
    with pytest.raises(PlotMismatchError, match="root_artifact"):
        PlotStore(tmp_path / "p", readonly=True, expect=PlotMeta("b", 3, 384, dtype="int8", chunks=3))
