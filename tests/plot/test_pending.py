"""A PLOT served while it is built answers as the finished PLOT will, bit for bit: planned values
not written yet are computed on demand, keys outside the plan back off as they will then; and
a server started on such a PLOT says so in /healthz and reads the PLOT alone once it is done."""

import json
import time
import urllib.request

import numpy as np
import pytest
import torch

from hmi.model.hplm import WindowedEncoder
from hmi.model.root import default_spec, load_tokenizer
from hmi.plot.build import Selection, build, count_ngrams, plan_keys, tokenize_corpus
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.pending import PendingStore, plan_path, serving_store
from hmi.plot.store import PlotMeta, PlotStore
from tests.conftest import tiny_bert

H = 32
META = PlotMeta(root_artifact="tiny", l_low=2, hidden_size=H, dtype="int8", chunks=1)
CORPUS = ["Shares in the bank fell sharply after the results were published on Monday.",
          "A tender, funny film that never quite finds its footing.",
          "The jury said the election was conducted well.",
          "The prime minister defended the budget in parliament yesterday evening."] * 3
QUERIES = ["Shares in the bank rose after the results.", "A dull film about the jury and the budget.",
           "Completely unseen words: zebra quantum violin."]


def interrupted_build(store, encoder, plan, chunks_written: int) -> None:
    """Builds ``plan`` into ``store`` in chunks of 16 and stops after ``chunks_written`` of them,
    as a killed build leaves it."""
    written = {"n": 0}

    def stop(fraction, info):
        written["n"] += 1
        if written["n"] == chunks_written:
            raise KeyboardInterrupt("stopped")

    with pytest.raises(KeyboardInterrupt):
        build(store, encoder, plan, batch_windows=16, progress=False, on_progress=stop)


def partial_build(path, encoder, tok, chunks_written: int):
    """An encoder PLOT whose build stopped after ``chunks_written`` chunks of 16; (store, plan)."""
    keys, counts = count_ngrams(tokenize_corpus(tok, CORPUS, progress=False))
    plan = plan_keys(keys, counts, Selection("all"), vocab_size=400)
    store = PlotStore(path, meta=META, readonly=False)
    interrupted_build(store, encoder, plan, chunks_written)
    return store, plan


def test_a_plot_served_while_it_is_built_answers_as_the_finished_plot_bit_for_bit(tmp_path):
    tok = load_tokenizer(default_spec().model_dir)
    encoder = WindowedEncoder(tiny_bert(hidden=H, vocab=30522), 2).eval()
    store, plan = partial_build(tmp_path / "plot", encoder, tok, chunks_written=3)
    assert 0 < len(store) < len(plan)
    reader = store  # (the server reads from another process; LMDB opens an environment once per process)
    pending = serving_store(reader, encoder)
    assert isinstance(pending, PendingStore)
    enc = tok(QUERIES, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    during = PlotLookup([PlotVersion("root", pending, encoder)], "backoff")
    got = during.merged(ids, mask)
    assert pending.computed > 0 and during.hits["bigram:root"] > 0  # computed on demand, and backed off outside the plan
    build(store, encoder, plan, batch_windows=16, progress=False)  # the build finishes
    assert not plan_path(tmp_path / "plot", pending.store.get_record("build")["fingerprint"]).exists()
    after = PlotLookup([PlotVersion("root", reader, encoder)], "backoff")
    assert torch.equal(got, after.merged(ids, mask))
    assert serving_store(reader, encoder) is reader  # complete: read alone


def test_a_plot_without_a_published_plan_or_complete_is_served_as_it_is(tmp_path):
    encoder = WindowedEncoder(tiny_bert(hidden=H), 2).eval()
    store = PlotStore(tmp_path / "plot", meta=META, readonly=False)
    assert serving_store(store, encoder) is store  # no build record
    store.put_record("build", {"fingerprint": "f", "done": 0, "total": 5, "complete": False})
    assert serving_store(store, encoder) is store  # a build from before plans were published


def test_planned_keys_are_found_by_a_sorted_search():
    pending = PendingStore(None, np.array([9, 3, 7], dtype=np.uint64), None)
    assert pending.planned(np.array([3, 4, 9, 10, 0], dtype=np.uint64)).tolist() == [True, False, True, False, False]
    assert PendingStore(None, np.array([], dtype=np.uint64), None).planned(np.array([1], dtype=np.uint64)).tolist() == [False]


def test_a_server_on_a_plot_being_built_says_so_and_reads_it_alone_once_built(tmp_path):
    import os

    from hmi.dispatcher.serve import run_in_thread
    from hmi.model.artifact import Root
    from hmi.model.root import RootSpec
    from hmi.services.server import Server, ServerConfig
    from tests.helpers.servers import ADMIN

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    spec = RootSpec(default_spec().model_dir, 2)
    bert = tiny_bert(layers=4, hidden=H, vocab=30522)
    root = Root(spec, bert, load_tokenizer(spec.model_dir), WindowedEncoder(bert, 2).eval(), "tiny", {})
    store, plan = partial_build(tmp_path / "plot", root.windowed, root.tokenizer, chunks_written=2)
    version = PlotVersion("root", serving_store(store, root.windowed), root.windowed)
    server = Server(tmp_path / "home", root, PlotLookup([version], "backoff"), ServerConfig(), tmp_path / "plot", META)
    url, stop = run_in_thread(server)
    try:
        def health():
            with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
                return json.loads(r.read())

        during = health()["preparing"]["root_plot"]
        assert during["total"] == len(plan) and 0 < during["done"] < len(plan)
        build(store, root.windowed, plan, batch_windows=16, progress=False)
        deadline = time.time() + 30
        while health()["preparing"] and time.time() < deadline:
            time.sleep(0.2)
        assert health()["preparing"] == {} and version.store is not None and not isinstance(version.store, PendingStore)
    finally:
        stop()


CAUSAL_CORPUS = [[5, 6, 7, 8, 9, 10, 11], [7, 8, 9, 10, 11, 12], [40, 41, 42, 43], [20, 21, 22, 23, 24, 25, 26, 27]]


def partial_causal_build(path, root, chunks_written: int):
    """A decoder's causal PLOT whose build stopped after ``chunks_written`` chunks of 16; (store, plan, lower)."""
    from hmi.model.decoder import CausalLower

    lower = CausalLower(root)
    keys, counts = count_ngrams(CAUSAL_CORPUS, causal=True)
    plan = plan_keys(keys, counts, Selection("all"), 90, causal=True)
    store = PlotStore(path, meta=PlotMeta(root.artifact_id, 2, 32, n=1, kind="causal"), readonly=False)
    interrupted_build(store, lower, plan, chunks_written)
    return store, plan, lower


def test_a_decoders_causal_plot_served_while_it_is_built_answers_as_the_finished_plot_bit_for_bit(tmp_path):
    from tests.helpers.decoders import tiny_decoder_root

    store, plan, lower = partial_causal_build(tmp_path / "plot", tiny_decoder_root(), chunks_written=2)
    assert 0 < len(store) < len(plan)
    pending = serving_store(store, lower)
    assert isinstance(pending, PendingStore)
    ids = np.array([[7, 8, 9, 10, 11, 12, 13], [30, 8, 9, 60, 61, 0, 0]])
    mask = (np.arange(7) < np.array([[7], [5]])).astype(np.int64)
    during = PlotLookup([PlotVersion("root", pending, lower)], "backoff")
    got = during.merged(ids, mask)
    assert pending.computed > 0  # computed on demand; and outside the plan, backed off as after the build:
    assert during.hits["bigram:root"] > 0 and during.hits["unigram:root"] > 0
    build(store, lower, plan, batch_windows=16, progress=False)
    assert torch.equal(got, PlotLookup([PlotVersion("root", store, lower)], "backoff").merged(ids, mask))


def test_a_server_on_a_decoder_plot_being_built_says_so_and_reads_it_alone_once_built(tmp_path):
    import os

    from hmi.dispatcher.serve import run_in_thread
    from hmi.hgpt.generation import EngineConfig
    from hmi.hgpt.runtime import HgptRuntime
    from tests.helpers.decoders import tiny_decoder_root
    from tests.helpers.servers import ADMIN, tiny_server

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    root = tiny_decoder_root()
    store, plan, lower = partial_causal_build(tmp_path / "gpt-plot", root, chunks_written=2)
    server = tiny_server(tmp_path / "home")
    runtime = HgptRuntime(root, serving_store(store, lower), server.transfer.load_decoder_tenant,
                          cfg=EngineConfig(rank=4, max_len=128, max_active=4))
    server.enable_hgpt(runtime)
    url, stop = run_in_thread(server)
    try:
        def health():
            with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
                return json.loads(r.read())

        during = health()["preparing"]
        assert list(during) == ["decoder_plot"] and during["decoder_plot"]["total"] == len(plan)
        assert 0 < during["decoder_plot"]["done"] < len(plan)
        build(store, lower, plan, batch_windows=16, progress=False)
        deadline = time.time() + 30
        while health()["preparing"] and time.time() < deadline:
            time.sleep(0.2)
        assert health()["preparing"] == {} and runtime.lookup.chain[0].store is store
    finally:
        stop()
