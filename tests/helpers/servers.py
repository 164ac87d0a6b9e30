"""A tiny server for tests: the packaged tokenizer on a tiny BERT, a real LMDB PLOT, real jobs,
and the requests tests send it."""

import json
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from hmi.model.artifact import Root
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import RootSpec, default_spec, load_tokenizer
from hmi.plot.kept import Keeper
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from hmi.services.server import Server, ServerConfig
from tests.conftest import tiny_bert

ADMIN = "admin-secret-for-tests"
TRAIN = [{"text": t, "label": "pos"} for t in ("a great film", "wonderful acting", "great fun", "superb story")] + \
        [{"text": t, "label": "neg"} for t in ("a dull film", "awful acting", "boring mess", "terrible story")]
# A fine-tune that trains for minutes on the tiny config (without dev rows every one of its 50 epochs runs):
# long enough for a test to act on it while it runs (cancel it, kill its worker), however fast the machine.
LONG_JOB = {"training_data": {"train": TRAIN * 2000}, "epochs": 50}
TAGS = [{"tokens": ["the", "dog", "runs"], "tags": ["D", "N", "V"]}, {"tokens": ["a", "cat", "sleeps"], "tags": ["D", "N", "V"]}]


def tiny_server(home, seed=0, job_launcher=None, registry=None, source=None, l_low=2, **cfg):
    spec = RootSpec(default_spec().model_dir, l_low, source)
    bert = tiny_bert(layers=4, hidden=32, vocab=30522, seed=seed)
    artifact = "tiny" if l_low == 2 else f"tiny-l{l_low}"  # another split: another artifact, its own PLOT
    root = Root(spec, bert, load_tokenizer(spec.model_dir), WindowedEncoder(bert, l_low).eval(), artifact, {})
    meta = PlotMeta(artifact, l_low, 32)
    path = home / ("plot" if l_low == 2 else f"plot-l{l_low}")
    if not path.exists():
        PlotStore(path, meta=meta, readonly=False).close()
    policy = cfg.get("miss_policy", "compute")
    keeps = policy == "compute+insert"
    version = PlotVersion("root", PlotStore(path, readonly=not keeps, expect=meta), root.windowed)
    lookup = PlotLookup([version], policy, keeper=Keeper(cfg.get("plot_keep_mb", 512.0)) if keeps else None)
    cfg = {"max_inputs": 8, "max_input_chars": 2000, "max_body_mb": 1, **cfg}
    return Server(home, root, lookup, ServerConfig(**cfg), path, meta, job_launcher, registry)


@contextmanager
def running_tiny_server(home, **server):
    """A tiny server on ``home`` (``server``: ``tiny_server``'s options) with the tests' admin token,
    serving in a thread: its URL, the server stopped on exit."""
    from hmi.dispatcher.serve import run_in_thread

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HMI_ADMIN_TOKEN", ADMIN)
        built = tiny_server(home, **server)
    url, stop = run_in_thread(built)
    try:
        yield url
    finally:
        stop()


def train_once(home, name, epochs=1, **server):
    """Starts a tiny server on ``home`` (``server``: ``tiny_server``'s options), trains tenant
    ``name`` on ``TRAIN`` through the API, and stops the server (the admin token in HMI_ADMIN_TOKEN);
    returns the creation's answer (the tenant's ``token``, its ``job``)."""
    from hmi.client import Client
    from hmi.dispatcher.serve import run_in_thread

    url, stop = run_in_thread(tiny_server(home, **server))
    try:
        admin = Client(url, ADMIN)
        out = admin.create_tenant(name, ["neg", "pos"], training_data={"train": TRAIN}, epochs=epochs)
        assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    finally:
        stop()
    return out


def domain_corpus(n=700, seed=0):
    import numpy as np

    words = ("the license grants permission to copy modify merge publish distribute and sell copies of the "
             "software subject to the following conditions warranty liability damages").split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=rng.integers(30, 60))) for _ in range(n)]


def raw(url, method, path, body=None, token=ADMIN, ctype="application/json"):
    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method)
    if ctype and data is not None:
        req.add_header("Content-Type", ctype)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
