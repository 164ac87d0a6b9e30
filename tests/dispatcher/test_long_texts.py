"""Texts over the server's token limit are read the same way in training and inference: refused
(413, naming the text) unless the tenant or the request truncates, and then cut exactly as the
tokenizer's own truncation cuts them."""

import pytest

from hmi.adapters.spec import AdapterSpec
from hmi.client import ApiError, Client
from hmi.dispatcher.serve import run_in_thread
from hmi.model.root import default_spec, load_tokenizer
from hmi.textlimit import TooLongError, fit_ids
from hmi.training.examples import encode
from tests.helpers.servers import ADMIN, TAGS, TRAIN, tiny_server

LIMIT = 16
LONG = "good " * 40  # 40 one-token words: 42 tokens with [CLS] and [SEP]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_spec().model_dir)


def test_fit_ids_keeps_the_closing_token_refuses_or_cuts():
    assert fit_ids([1, 2, 3], 3, False) == ([1, 2, 3], False)
    assert fit_ids([1, 2, 3, 4, 9], 4, True) == ([1, 2, 3, 9], True)
    with pytest.raises(TooLongError, match="5 tokens; the limit is 4"):
        fit_ids([1, 2, 3, 4, 9], 4, False)


def test_training_cuts_texts_exactly_as_the_tokenizers_own_truncation(tok):
    texts = ["a " * n + "wonderfully unforgettable film" for n in (0, 5, 13, 30)]
    spec = AdapterSpec(labels=("neg", "pos"))
    got = encode(tok, [{"text": t, "label": "pos"} for t in texts], spec, LIMIT, truncate=True)
    want = tok(texts, truncation=True, max_length=LIMIT)["input_ids"]
    assert [e.ids for e in got] == want


def test_tagging_targets_are_cut_with_their_tokens(tok):
    spec = AdapterSpec(head="tagging", labels=("D", "N", "V"))
    rows = [{"tokens": ["the", "dog", "runs"] * 8, "tags": ["D", "N", "V"] * 8}]
    ex = encode(tok, rows, spec, LIMIT, truncate=True)[0]
    ref = tok(rows[0]["tokens"], is_split_into_words=True, truncation=True, max_length=LIMIT)
    assert ex.ids == ref["input_ids"] and len(ex.target) == LIMIT
    assert ex.target[-1] == -100 and ex.target[1:4] == [0, 1, 2]


def test_training_refuses_an_over_long_row_by_default_and_names_it(tok):
    rows = [{"text": "short", "label": "pos"}, {"text": LONG, "label": "neg"}]
    with pytest.raises(TooLongError) as err:
        encode(tok, rows, AdapterSpec(labels=("neg", "pos")), LIMIT, truncate=False)
    assert err.value.row == 1 and err.value.n_tokens == 42


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import os

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path_factory.mktemp("home"), max_len=LIMIT)
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    cut = admin.create_tenant("cutter", ["neg", "pos"], training_data={"train": TRAIN + [{"text": LONG, "label": "pos"}]},
                              epochs=1, truncate=True)
    keep = admin.create_tenant("keeper", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
    tags = admin.create_tenant("tagger", ["D", "N", "V"], task_type="tagging", training_data={"train": TAGS}, epochs=1,
                               truncate=True)
    for out in (cut, keep, tags):
        assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    yield {"admin": admin, "url": url}
    stop()


def test_a_tenant_that_does_not_truncate_refuses_long_training_texts_at_creation(live):
    with pytest.raises(ApiError) as err:
        live["admin"].create_tenant("strict", ["neg", "pos"], training_data={"train": TRAIN + [{"text": LONG, "label": "pos"}]})
    assert err.value.status == 413 and err.value.code == "input_too_long"
    assert "training_data.train, row 8: 42 tokens; the limit is 16" in err.value.message and "truncate" in err.value.message
    with pytest.raises(ApiError):
        live["admin"].tenant("strict")  # nothing was created


def test_the_tenant_states_its_limit_and_choice(live):
    assert {k: live["admin"].tenant("cutter")[k] for k in ("max_tokens", "truncate")} == {"max_tokens": LIMIT, "truncate": True}
    assert live["admin"].tenant("keeper")["truncate"] is False


def test_inference_follows_the_tenant_and_a_request_may_override_it(live):
    admin = live["admin"]
    with pytest.raises(ApiError) as err:
        admin.infer("keeper", [LONG])
    assert err.value.status == 413 and "the limit is 16" in err.value.message and "truncate" in err.value.message
    cut = admin.infer("keeper", [LONG], truncate=True)[0]
    assert cut["truncated"] is True
    exact = admin.infer("keeper", ["good " * (LIMIT - 2)])[0]  # the same 16 tokens, sent whole
    assert "truncated" not in exact and cut["scores"] == exact["scores"]
    assert admin.infer("cutter", [LONG])[0]["truncated"] is True
    with pytest.raises(ApiError):
        admin.infer("cutter", [LONG], truncate=False)


def test_a_cut_tagging_text_is_tagged_up_to_the_limit(live):
    out = live["admin"].infer("tagger", [" ".join(["the", "dog", "runs"] * 10)])[0]
    assert out["truncated"] is True and len(out["tokens"]) == LIMIT - 2


def test_a_job_worker_reads_texts_over_the_model_limit_without_the_tokenizer_warning():
    """A fine-tune job tokenizes whole texts and then cuts or refuses them itself; the tokenizer's
    'longer than the specified maximum sequence length' warning would only mislead an operator."""
    import logging
    import queue
    import threading

    import torch
    from transformers.utils import logging as hf_logging

    from hmi.services.workers import _run

    fresh = load_tokenizer(default_spec().model_dir)  # the warning is given once per tokenizer object
    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append
    hf_logging.get_logger("transformers").addHandler(catch)
    hf_logging.set_verbosity_warning()  # as a newly spawned process starts
    progress = queue.Queue()
    try:
        _run({"threads": torch.get_num_threads()}, progress, threading.Event(),
             lambda report: {"n_tokens": len(fresh("word " * 900, truncation=False)["input_ids"])})
    finally:
        hf_logging.get_logger("transformers").removeHandler(catch)
    assert progress.get_nowait()[2]["n_tokens"] == 902
    assert not [r for r in records if "sequence length is longer" in r.getMessage()]
