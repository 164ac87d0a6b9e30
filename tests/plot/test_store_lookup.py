import numpy as np
import pytest
import torch

from hmi.model.hplm import WindowedEncoder
from hmi.plot.build import Selection, build, count_ngrams, plan_keys, select_trigrams
from hmi.plot.hot import HotTier
from hmi.plot.keys import encoder_windows, pack, unique_windows
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotMismatchError, PlotMissingError, PlotStore
from tests.conftest import tiny_bert

H = 32
META = PlotMeta(root_artifact="tiny-a", l_low=2, hidden_size=H)


@pytest.fixture
def encoder():
    return WindowedEncoder(tiny_bert(hidden=H), 2).eval()


def rows(n, fill):
    return np.full((n, 3, H), fill, dtype=np.float16)


def test_store_put_get_many_marks_missing(tmp_path):
    s = PlotStore(tmp_path / "p", meta=META, readonly=False)
    keys = pack(np.array([[1, 2, 3], [0, 2, 3]]))
    s.put_many(keys, np.stack([rows(1, 1.0)[0], rows(1, 2.0)[0]]))
    vals, found = s.get_many(pack(np.array([[0, 2, 3], [9, 9, 9], [1, 2, 3]])))
    assert found.tolist() == [True, False, True]
    assert vals[0, 0, 0] == 2.0 and (vals[1] == 0).all() and vals[2, 2, 5] == 1.0
    assert s.stats()["trigrams"] == 1 and s.stats()["bigrams"] == 1


def test_store_grows_map_when_full(tmp_path, monkeypatch):
    import hmi.plot.store as store_mod

    monkeypatch.setattr(store_mod, "INITIAL_MAP_SIZE", 1 << 16)
    s = PlotStore(tmp_path / "p", meta=META, readonly=False)
    keys = pack(np.stack([np.zeros(400, int), np.arange(1, 401), np.zeros(400, int)], 1))
    s.put_many(keys, rows(400, 0.5))
    assert len(s) == 400


def test_wrong_root_plot_is_refused_with_clear_error(tmp_path):
    PlotStore(tmp_path / "p", meta=META, readonly=False).close()
    with pytest.raises(PlotMismatchError, match="root_artifact: PLOT has 'tiny-a', expected 'tiny-b'"):
        PlotStore(tmp_path / "p", readonly=True, expect=PlotMeta("tiny-b", 2, H))
    with pytest.raises(PlotMismatchError, match="l_low"):
        PlotStore(tmp_path / "p", readonly=True, expect=PlotMeta("tiny-a", 3, H))
    with pytest.raises(PlotMissingError):
        PlotStore(tmp_path / "nothing", readonly=True)


def test_readonly_store_refuses_writes_and_serves_several_readers(tmp_path):
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    w = PlotStore(tmp_path / "p", meta=META, readonly=False)
    w.put_many(pack(np.array([[0, 5, 0]])), rows(1, 3.0))
    w.close()
    r = PlotStore(tmp_path / "p", readonly=True)
    key = pack(np.array([[0, 5, 0]]))
    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(lambda _: bool(r.get_many(key)[1].all()), range(16)))
    other = subprocess.run(
        [sys.executable, "-c", "import sys, numpy as np; from hmi.plot.store import PlotStore; "
         "from hmi.plot.keys import pack; s = PlotStore(sys.argv[1]); "
         "print(float(s.get_many(pack(np.array([[0, 5, 0]])))[0][0, 0, 0]))", str(tmp_path / "p")],
        capture_output=True, text=True, check=True)
    assert other.stdout.strip() == "3.0"
    with pytest.raises(PermissionError):
        r.put_many(pack(np.array([[0, 6, 0]])), rows(1, 3.0))


def test_lookup_falls_back_chain_then_bigram_then_unigram_then_zeros(tmp_path, encoder):
    branch = PlotStore(tmp_path / "b", meta=META, readonly=False)
    root = PlotStore(tmp_path / "r", meta=META, readonly=False)
    branch.put_many(pack(np.array([[1, 2, 3]])), rows(1, 1.0))
    root.put_many(pack(np.array([[1, 2, 3], [4, 2, 3], [0, 2, 3], [0, 7, 0], [0, 2, 0]])),
                  np.concatenate([rows(1, 9.0), rows(1, 2.0), rows(1, 3.0), rows(1, 4.0), rows(1, 8.0)]))
    lk = PlotLookup([PlotVersion("branch", branch, encoder), PlotVersion("root", root, encoder)])
    win = np.array([[1, 2, 3], [4, 2, 3], [5, 2, 3], [6, 7, 8], [9, 2, 9], [9, 11, 9]])
    reps, hits = lk.window_reps(win)
    assert reps[:, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 8.0, 0.0]
    assert hits == {"trigram:branch": 1, "trigram:root": 1, "bigram:branch": 0, "bigram:root": 1,
                    "unigram:branch": 0, "unigram:root": 2, "zeros": 1}


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_compute_policy_is_exact_and_compute_insert_is_idempotent(tmp_path, encoder, dtype):
    """The first lookup of a missing window answers what every later one reads (the stored format)."""
    from dataclasses import replace

    store = PlotStore(tmp_path / "p", meta=replace(META, dtype=dtype), readonly=False)
    win = np.array([[1, 2, 3], [0, 4, 5], [6, 7, 0]])
    lk = PlotLookup([PlotVersion("root", store, encoder)], policy="compute+insert")
    first, hits1 = lk.window_reps(win)
    assert lk.keeper.flush(10)
    assert hits1["computed"] == 3 and len(store) == 3
    second, hits2 = lk.window_reps(win)
    assert hits2["trigram:root"] == 3 and hits2["computed"] == 0 and len(store) == 3
    np.testing.assert_array_equal(first, second)
    exact = encoder.lower(torch.from_numpy(win)).detach().numpy()
    np.testing.assert_allclose(first.astype(np.float32), exact, atol=2e-3 if dtype == "float16" else 3e-2, rtol=2e-3)


def test_unknown_miss_policy_is_refused(tmp_path, encoder):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    with pytest.raises(ValueError, match="miss policy"):
        PlotLookup([PlotVersion("root", store, encoder)], policy="guess")


def test_alpha_selection_on_known_counter():
    keys = np.arange(1, 7, dtype=np.uint64)
    counts = np.array([50, 20, 10, 10, 5, 5])  # total 100
    assert select_trigrams(keys, counts, Selection("alpha", alpha=0.5)).tolist() == [1]
    assert select_trigrams(keys, counts, Selection("alpha", alpha=0.7)).tolist() == [1, 2]
    assert select_trigrams(keys, counts, Selection("alpha", alpha=0.75)).tolist() == [1, 2, 3]
    assert select_trigrams(keys, counts, Selection("alpha", alpha=0.0)).tolist() == []
    assert select_trigrams(keys, counts, Selection("alpha", alpha=1.0)).tolist() == [1, 2, 3, 4, 5, 6]
    assert select_trigrams(keys, counts, Selection("top_k", top_k=2)).tolist() == [1, 2]
    with pytest.raises(ValueError):
        Selection("alpha", alpha=1.5)


def test_plan_always_has_vocabulary_unigrams_and_corpus_bigrams():
    keys, counts = count_ngrams([[1, 5, 6, 2], [1, 5, 2]])
    assert counts.sum() == 7
    plan = plan_keys(keys, counts, Selection("alpha", alpha=0.0), vocab_size=10)
    from hmi.plot.keys import ngram_order, unpack

    order = ngram_order(plan)
    assert (order == 3).sum() == 0
    assert sorted(map(tuple, unpack(plan[order == 1]))) == [(0, c, 0) for c in range(1, 10)]
    assert (0, 5, 6) in set(map(tuple, unpack(plan)))


def test_interrupted_build_then_resume_equals_clean_build(tmp_path, encoder):
    keys, counts = count_ngrams([[1, 5, 6, 7, 8, 9, 2], [1, 9, 8, 7, 2], [1, 3, 4, 5, 2]])
    plan = plan_keys(keys, counts, Selection("all"), vocab_size=40)
    clean = PlotStore(tmp_path / "clean", meta=META, readonly=False)
    s1 = build(clean, encoder, plan, batch_windows=8, progress=False)
    assert s1["written"] == len(plan)

    broken = PlotStore(tmp_path / "broken", meta=META, readonly=False)
    calls = {"n": 0}
    real_put = broken.put_many

    def dying_put(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real_put(*a, **kw)

    broken.put_many = dying_put
    with pytest.raises(KeyboardInterrupt):
        build(broken, encoder, plan, batch_windows=8, progress=False)
    broken.put_many = real_put
    assert 0 < len(broken) < len(plan)
    s2 = build(broken, encoder, plan, batch_windows=8, progress=False)
    assert s2["resumed_from"] == 16
    a, fa = clean.get_many(plan)
    b, fb = broken.get_many(plan)
    assert fa.all() and fb.all()
    np.testing.assert_array_equal(a, b)
    assert build(broken, encoder, plan, batch_windows=8, progress=False)["up_to_date"]


def test_a_build_interrupted_with_one_encoders_weights_is_not_resumed_with_anothers(tmp_path, encoder):
    """A branch's encoder changes with its training: the weights' fingerprint is part of what a
    resume must match, so the stored values all come from one encoder."""
    import copy

    keys, counts = count_ngrams([[1, 5, 6, 7, 8, 9, 2], [1, 9, 8, 7, 2], [1, 3, 4, 5, 2]])
    plan = plan_keys(keys, counts, Selection("all"), vocab_size=40)
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)

    def killed(fraction, info):
        if info["entries"] >= 16:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        build(store, encoder, plan, batch_windows=8, progress=False, on_progress=killed, weights="trained-a")
    other = copy.deepcopy(encoder)
    with torch.no_grad():
        for w in other.parameters():
            w.add_(0.1)
    assert build(store, other, plan, batch_windows=8, progress=False, weights="trained-b")["resumed_from"] == 0
    clean = PlotStore(tmp_path / "clean", meta=META, readonly=False)
    build(clean, other, plan, batch_windows=8, progress=False)
    np.testing.assert_array_equal(store.get_many(plan)[0], clean.get_many(plan)[0])
    assert build(store, other, plan, progress=False, weights="trained-b")["up_to_date"]


def test_lookup_merge_equals_windowed_computation(tmp_path, encoder):
    ids = np.array([[1, 5, 6, 7, 2, 0], [1, 9, 8, 2, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    keys, counts = count_ngrams([list(r[m.astype(bool)]) for r, m in zip(ids, mask)])
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    build(store, encoder, plan_keys(keys, counts, Selection("all"), 40), progress=False)
    lk = PlotLookup([PlotVersion("root", store, encoder)])
    got = lk.merged(ids, mask)
    with torch.no_grad():
        want = encoder(torch.from_numpy(ids), torch.from_numpy(mask))
    m = mask.astype(bool)
    torch.testing.assert_close(got[m], want[m], atol=2e-2, rtol=0)
    uniq, _ = unique_windows(encoder_windows(ids, mask), mask)
    assert lk.hits["trigram:root"] == len(uniq)


def test_merge_from_distinct_windows_equals_merge_of_the_full_window_tensor(tmp_path, encoder):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 60, size=(4, 9))
    ids[:, 0] = 1
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    mask[3, 3:] = 0
    ids = ids * mask
    keys, counts = count_ngrams([list(ids[0]), list(ids[2][:5])])
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    build(store, encoder, plan_keys(keys, counts, Selection("all"), 60), progress=False)
    lk = PlotLookup([PlotVersion("root", store, encoder)])  # some hits, some back-off
    with torch.no_grad():
        want = encoder.merge(lk.represent(ids, mask).reps)
    assert torch.equal(lk.merged(ids, mask), want)


def test_build_of_a_different_plan_replaces_the_old_content(tmp_path, encoder):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    k1, c1 = count_ngrams([[1, 5, 6, 7, 2]])
    k2, c2 = count_ngrams([[1, 9, 8, 2]])
    build(store, encoder, plan_keys(k1, c1, Selection("all"), 0, with_backoff=False), progress=False)
    plan2 = plan_keys(k2, c2, Selection("all"), 0, with_backoff=False)
    build(store, encoder, plan2, progress=False)
    np.testing.assert_array_equal(store.keys(), np.sort(plan2))


@pytest.mark.parametrize("hot", [False, True])
def test_windows_no_level_holds_read_as_zeros_whatever_memory_held_before(tmp_path, encoder, hot):
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    keys, counts = count_ngrams([[1, 5, 6, 2]])
    build(store, encoder, plan_keys(keys, counts, Selection("all"), 0, with_backoff=False), progress=False)
    tier = HotTier.whole(store) if hot else None
    lk = PlotLookup([PlotVersion("root", store, encoder, hot=tier)])
    windows = np.array([[1, 5, 6], [7, 8, 9], [0, 9, 0], [9, 9, 9]])  # one held, three held at no level
    for _ in range(20):  # what the allocator hands out next was just full of non-zeros
        junk = torch.full((len(windows), META.n, H), 7.0, dtype=torch.float16)
        del junk
        reps, hits = lk.window_reps(windows)
        assert hits["zeros"] == 3
        assert not reps[1:].any() and reps[0].any()


def test_a_plot_records_the_corpus_it_was_built_from_and_one_built_before_reads_as_general(tmp_path):
    from hmi.model.root import default_spec, load_tokenizer
    from hmi.plot.build import CORPUS_RECORD, build_from_corpus, plot_corpus

    tok = load_tokenizer(default_spec().model_dir)
    encoder = WindowedEncoder(tiny_bert(hidden=H, vocab=len(tok)), 2).eval()
    store = PlotStore(tmp_path / "p", meta=META, readonly=False)
    lines = ["the cat sat on the mat", "a dog ran"]
    summary = build_from_corpus(store, encoder, tok, lines, Selection("all"), with_backoff=False, progress=False,
                                corpus="reviews,news")
    assert (plot_corpus(store), summary["corpus"]) == ("reviews,news", "reviews,news")
    # built again from other text: the record follows the last build
    build_from_corpus(store, encoder, tok, lines[:1], Selection("all"), with_backoff=False, progress=False, corpus="all")
    assert plot_corpus(store) == "all"
    store.put_record(CORPUS_RECORD, None)  # a store from before the record
    assert plot_corpus(store) == "general"
