"""Job workers forked from the server's fork server (``hmi.services.jobs.ProcessLauncher``) do what
workers spawned as new interpreters do: they see the server's environment as it is when their
job starts, and they train the same adapter.  (That a worker dies with its server is pinned down
by ``tests/dispatcher/test_job_resume.py``, which kills a server mid-job.)"""

import os

import torch

from hmi.adapters.store import AdapterStore
from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from hmi.services.jobs import ProcessLauncher
from tests.helpers.servers import ADMIN, TRAIN, tiny_server
from tests.helpers.workers import environ_worker


def run_job(launcher: ProcessLauncher, target, job: dict) -> tuple:
    progress, cancel = launcher.queue(), launcher.event()
    proc = launcher.start(target, None, job, progress, cancel)
    state, _, info = progress.get(timeout=120)
    proc.join(60)
    return state, info


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
    url, stop = run_in_thread(tiny_server(home, job_launcher=launcher))
    try:
        admin = Client(url, ADMIN)
        out = admin.create_tenant("same", ["neg", "pos"], training_data={"train": TRAIN}, epochs=2)
        assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    finally:
        stop()
    return AdapterStore(home / "tenants").load("same")


def test_a_forked_worker_trains_the_adapter_a_spawned_worker_trains(tmp_path):
    forked, spawned = trained(tmp_path / "forked", ProcessLauncher()), trained(tmp_path / "spawned", ProcessLauncher("spawn"))
    assert forked.keys() == spawned.keys()
    for name in forked:  # the same code on the same machine, in another kind of process: the same bits
        assert torch.equal(forked[name], spawned[name]), name
