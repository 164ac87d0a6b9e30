"""The hot tier of a PLOT against LMDB alone: the same values bit for bit, on every device; its
order against counting, window by window, which key serves each window."""

from collections import Counter

import numpy as np
import pytest
import torch

from hmi.model.hplm import WindowedEncoder, as_numpy_ids
from hmi.plot.build import Selection, build, count_ngrams, plan_keys
from hmi.plot.hot import HotTier, entry_bytes, serving_order
from hmi.plot.keys import encoder_windows, pack
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.pending import PendingStore
from hmi.plot.store import PlotMeta, PlotStore
from tests.conftest import DEVICES, tiny_bert

H = 32
RNG = np.random.default_rng(0)
# Token lists as a tokenizer frames them ([CLS]=1 ... [SEP]=2), over a small vocabulary so that
# windows repeat; the PLOT holds the tri-grams of the first half only, its bi-grams and uni-grams.
TEXTS = [[1, *RNG.integers(3, 40, size=RNG.integers(3, 20)).tolist(), 2] for _ in range(60)]
VOCAB = 40


@pytest.fixture(scope="module")
def plot(tmp_path_factory):
    encoder = WindowedEncoder(tiny_bert(hidden=H, vocab=VOCAB), 2).eval()
    store = PlotStore(tmp_path_factory.mktemp("hot") / "p", meta=PlotMeta("tiny", 2, H, dtype="int8"), readonly=False)
    keys, counts = count_ngrams(TEXTS[:30])
    build(store, encoder, plan_keys(keys, counts, Selection("all"), VOCAB), progress=False)
    return store, encoder


def reference_order(store: PlotStore, token_lists) -> list[int]:
    """Window by window: the key that serves it (tri-gram if held, else bi-gram, else uni-gram),
    counted; most read first, ties by key; then the keys never read, by key."""
    held = set(store.keys().tolist())
    reads = Counter()
    for t in token_lists:
        ids, mask = as_numpy_ids([t])
        for (a, b, c) in encoder_windows(ids, mask)[0][: len(t)].tolist():
            for key in (int(pack(np.array([a, b, c]))), int(pack(np.array([0, b, c]))), int(pack(np.array([0, b, 0])))):
                if key in held:
                    reads[key] += 1
                    break
    return [k for k, _ in sorted(reads.items(), key=lambda kv: (-kv[1], kv[0]))] + sorted(held - set(reads))


def test_the_serving_order_counts_every_window_at_the_key_that_serves_it(plot):
    store, _ = plot
    assert serving_order(store, TEXTS).tolist() == reference_order(store, TEXTS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget_entries", [0, 1, 25, 10_000])
def test_a_lookup_through_the_hot_tier_equals_lmdb_alone_bit_for_bit(plot, budget_entries, device):
    store, encoder = plot
    order = serving_order(store, TEXTS[:40])
    hot = HotTier.from_store(store, order, budget_entries * entry_bytes(3, H) / 2**20, device)
    assert len(hot) == min(budget_entries, len(order)) and len(order) == len(store)
    cold = PlotLookup([PlotVersion("root", store, encoder)])
    warm = PlotLookup([PlotVersion("root", store, encoder, hot=hot)])
    ids, mask = as_numpy_ids(TEXTS)
    windows = np.unique(encoder_windows(ids, mask)[mask.astype(bool)], axis=0)
    (want, want_hits), (got, got_hits) = cold.window_reps(windows), warm.window_reps(windows)
    assert np.array_equal(got, want)
    from_hot = got_hits.pop("hot", 0)
    served = sum(n for level, n in want_hits.items() if level != "zeros")
    assert (from_hot > 0) == (budget_entries > 0)
    assert from_hot == served if budget_entries >= len(store) else from_hot < served  # the rest from LMDB
    assert got_hits == want_hits
    torch.testing.assert_close(warm.merged(ids, mask), cold.merged(ids, mask), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_tier_answers_as_the_store_for_held_and_missing_keys(plot, device):
    store, _ = plot
    order = serving_order(store, TEXTS)
    hot = HotTier.from_store(store, order, 10 * entry_bytes(3, H) / 2**20, device)
    assert hot.nbytes == 10 * entry_bytes(3, H) and hot.keys.device.type == device
    query = np.concatenate([order[:10][::-1], pack(np.array([[39, 39, 39], [0, 0, 0]])), order[10:15]])
    vals, found = hot.get_many(query)
    assert found.tolist() == [True] * 10 + [False] * 7
    want, _ = store.get_many(query[:10])
    assert np.array_equal(vals[:10], want) and not vals[10:].any()


def test_a_tier_attached_to_a_serving_version_changes_no_lookup_and_serves_the_texts_it_was_ordered_by(plot, tmp_path):
    from hmi.plot.hot import attach_hot_tier

    store, encoder = plot

    class Tokens:  # the texts as a tokenizer frames them
        def __call__(self, lines, truncation=True, max_length=128):
            return {"input_ids": [TEXTS[int(line)] for line in lines]}

    version = PlotVersion("root", store, encoder)
    lookup = PlotLookup([version])
    ids, mask = as_numpy_ids(TEXTS)
    want = lookup.merged(ids, mask)
    tier = attach_hot_tier(version, Tokens(), [str(i) for i in range(len(TEXTS))], 40 * entry_bytes(3, H) / 2**20)
    assert version.hot is tier and len(tier) == 40
    lookup.hits.clear()
    torch.testing.assert_close(lookup.merged(ids, mask), want, rtol=0, atol=0)
    assert lookup.hits["hot"] > 0


def test_a_tier_holding_the_whole_plot_stands_for_lmdb_until_the_plot_is_written_then_lmdb_serves_the_new_entry(tmp_path):
    encoder = WindowedEncoder(tiny_bert(hidden=H, vocab=VOCAB), 2).eval()
    store = PlotStore(tmp_path / "p", meta=PlotMeta("tiny", 2, H, dtype="int8"), readonly=False)
    keys, counts = count_ngrams(TEXTS[:30])
    build(store, encoder, plan_keys(keys, counts, Selection("all"), VOCAB), progress=False)
    order = serving_order(store, TEXTS)
    whole = HotTier.from_store(store, order, 2 * len(store) * entry_bytes(3, H) / 2**20)
    part = HotTier.from_store(store, order, 5 * entry_bytes(3, H) / 2**20)
    assert whole.covers(store) and not part.covers(store)
    window = np.array([[39, 38, 37]])  # a tri-gram the PLOT does not hold: served by back-off
    assert not whole.find(pack(window))[0].any()
    lookup = PlotLookup([PlotVersion("root", store, encoder, hot=whole)])
    _, hits = lookup.window_reps(window)
    assert hits["trigram:root"] == 0 and hits["hot"] == 1
    store.put_many(pack(window), RNG.normal(size=(1, 3, H)))  # written after the tier was filled
    assert not whole.covers(store)
    got, hits = lookup.window_reps(window)
    assert hits["trigram:root"] == 1 and hits["hot"] == 0
    assert np.array_equal(got, store.get_many(pack(window))[0])


@pytest.mark.parametrize("device", DEVICES)
def test_find_gives_the_found_keys_values_in_query_order_as_get_many_does(plot, device):
    store, _ = plot
    order = serving_order(store, TEXTS)
    hot = HotTier.from_store(store, order, 10 * entry_bytes(3, H) / 2**20, device)
    query = np.concatenate([order[12:14], order[:10][::-1], pack(np.array([[39, 39, 39]])), order[3:5]])
    found, vals = hot.find(query)
    want, want_found = hot.get_many(query)
    assert np.array_equal(found, want_found) and np.array_equal(vals, want[want_found])
    assert np.array_equal(vals, store.get_many(query[found])[0])


def test_a_tier_over_a_plot_being_built_never_stands_for_it_so_a_planned_key_not_written_yet_is_still_computed(tmp_path):
    encoder = WindowedEncoder(tiny_bert(hidden=H, vocab=VOCAB), 2).eval()
    store = PlotStore(tmp_path / "p", meta=PlotMeta("tiny", 2, H, dtype="int8"), readonly=False)
    keys, counts = count_ngrams(TEXTS[:30])
    build(store, encoder, plan_keys(keys, counts, Selection("all"), VOCAB), progress=False)
    window = np.array([[39, 38, 37]])  # planned, not written: the build stopped before it
    pending = PendingStore(store, np.concatenate([store.keys(), pack(window)]), encoder)
    tier = HotTier.from_store(pending, serving_order(store, TEXTS), 2 * len(store) * entry_bytes(3, H) / 2**20)
    assert len(tier) == len(store) and not tier.covers(pending)
    got, hits = PlotLookup([PlotVersion("root", pending, encoder, hot=tier)]).window_reps(window)
    assert hits["trigram:root"] == 1 and pending.computed == 1
    assert np.array_equal(got, pending.get_many(pack(window))[0])
