import os

import pytest
import torch
from transformers import BertConfig, BertModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# The tests this run collected and then left out (``-m``, ``-k``): with ``session.items``, what it collected.
DESELECTED = pytest.StashKey[list]()


def pytest_deselected(items):
    if items:
        items[0].config.stash.setdefault(DESELECTED, []).extend(items)


def pytest_configure(config):
    """Under pytest-xdist, each of N workers on C cores computes with C // N threads (at least one),
    and so do the servers and the commands its tests start (they inherit the environment): with
    more threads than cores, OpenMP's threads wait for a time slice at every parallel region (a tiny
    decoder's calibration test took 36 s beside another worker, 4 s with one thread each)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
        torch.set_num_threads(threads)


# The devices a test whose path differs on a GPU runs on: the CPU everywhere, CUDA where torch sees a
# GPU (``make gpu-check`` runs the ``cuda`` ones there; elsewhere they are collected and skipped).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here: make gpu-check runs this where torch sees one")])]


def tiny_bert(layers: int = 4, hidden: int = 32, vocab: int = 120, seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=hidden * 2, max_position_embeddings=512, attn_implementation="eager",
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.fixture
def bert():
    return tiny_bert()


@pytest.fixture(scope="session")
def real_root():
    """The packaged MiniLM-L6, uncalibrated (loaded once per test session)."""
    from hmi.model.artifact import uncalibrated_root

    return uncalibrated_root()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_HOME", str(tmp_path / "hmi_home"))


@pytest.fixture(scope="session")
def soak_home(tmp_path_factory, worker_id, decoder_copy_home):
    """The soak's home: the default root's artifact, the decoder's fp32 copy and shipped windows,
    small complete root PLOTs of both; prepared once per test run, read only
    (``tests.helpers.shared``)."""
    from functools import partial

    from tests.helpers.shared import prepare_soak_home, prepared, shared_folder

    return prepared(shared_folder(tmp_path_factory, worker_id), "soak-home",
                    partial(prepare_soak_home, decoder_copy=decoder_copy_home))


@pytest.fixture(scope="session")
def decoder_copy_home(tmp_path_factory, worker_id):
    """A home holding the decoder's fp32 copy, dequantized once per test run; read only."""
    pytest.importorskip("gguf")
    from hmi.model.decoder import DecoderNotFoundError
    from tests.helpers.shared import prepare_decoder_copy, prepared, shared_folder

    try:
        return prepared(shared_folder(tmp_path_factory, worker_id), "decoder-home", prepare_decoder_copy)
    except DecoderNotFoundError as exc:
        pytest.skip(str(exc))


# `make test` runs the tests in two pytest-xdist workers, the tests of one file on one worker
# (``--dist loadfile``: a module's fixtures, a live server with trained tenants, are set up once),
# then the files that start a Ray cluster (``ray_cluster``) on their own: a cluster starts proxies
# and ports of its own and must not compete with a second one.  (``--dist loadgroup`` with a group
# per file did the same until pytest 9.2, whose node ids pytest-xdist 3.8 can no longer suffix
# with the group: every test went its own way and each worker set up the module fixtures again.)
RAY_FILES = {"test_ray_jobs.py", "test_ray_multinode.py", "test_ray_registry.py", "test_ray_serve.py", "test_ray_gate.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in RAY_FILES:
            item.add_marker(pytest.mark.ray_cluster)
    # The soak's file first (the longest: its prepared home and its minute of load), then the
    # other files that hold a test marked slow (a minute or more), then the rest in collection
    # order (``make test`` passes --no-loadscope-reorder, which keeps this order): a long file
    # started last would run alone at the end while the other worker has nothing left to do.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path.name != "test_soak.py", item.path not in slow))
