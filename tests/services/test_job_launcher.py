"""Job workers forked from the server's fork server (``hmi.services.jobs.ProcessLauncher``) do what
workers spawned as new interpreters do: they receive the server's shared-memory weights however
many tensors they are, see the server's environment as it is when their job starts, and train
the same adapter.  (That a worker dies with its server is pinned down by
``tests/dispatcher/test_job_resume.py`` and ``tests/dispatcher/test_hostile.py``, which kill a
server mid-job.)"""

import os

import torch

from hmi.adapters.store import AdapterStore
from hmi.services.jobs import ProcessLauncher
from tests.helpers.servers import ADMIN, train_once
from tests.helpers.workers import environ_worker, sum_worker


def run_job(launcher: ProcessLauncher, target, job: dict, ctx=None) -> tuple:
    """(state, info) of the worker's last report."""
    progress, cancel = launcher.queue(), launcher.event()
    proc = launcher.start(target, ctx, job, progress, cancel)
    state, _, info = progress.get(timeout=120)
    proc.join(60)
    return state, info


def test_a_forked_worker_receives_more_shared_tensors_than_a_fork_server_hands_a_new_process():
    """The decoder's context is about 400 shared-memory tensors, a file descriptor each; a fork
    server passes at most 253 with a new process (``hmi.services.workers.start_worker``)."""
    tensors = [torch.full((3,), float(i)).share_memory_() for i in range(400)]
    state, info = run_job(ProcessLauncher(), sum_worker, {}, tensors)
    assert (state, info.get("sum")) == ("done", 3.0 * sum(range(400))), info


def test_a_forked_worker_sees_the_servers_environment_as_it_is_when_its_job_starts(monkeypatch):
    launcher = ProcessLauncher()
    monkeypatch.setenv("HMI_TEST_LAUNCHER", "before")
    state, info = run_job(launcher, environ_worker, {"variable": "HMI_TEST_LAUNCHER"})
    assert (state, info["value"]) == ("done", "before")
    monkeypatch.setenv("HMI_TEST_LAUNCHER", "after")  # the fork server started with "before"
    state, info = run_job(launcher, environ_worker, {"variable": "HMI_TEST_LAUNCHER"})
    assert (state, info["value"]) == ("done", "after")
    monkeypatch.delenv("HMI_TEST_LAUNCHER")
    state, info = run_job(launcher, environ_worker, {"variable": "HMI_TEST_LAUNCHER"})
    assert (state, info["value"]) == ("done", None)


def trained(home, launcher: ProcessLauncher) -> dict:
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    train_once(home, "same", epochs=2, job_launcher=launcher)
    return AdapterStore(home / "tenants").load("same")


def test_a_forked_worker_trains_the_adapter_a_spawned_worker_trains(tmp_path):
    forked, spawned = trained(tmp_path / "forked", ProcessLauncher()), trained(tmp_path / "spawned", ProcessLauncher("spawn"))
    assert forked.keys() == spawned.keys()
    for name in forked:  # the same code on the same machine, in another kind of process: the same bits
        assert torch.equal(forked[name], spawned[name]), name
