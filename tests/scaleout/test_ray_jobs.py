"""Jobs as Ray tasks (``hmi.scaleout.ray_jobs``, what ``hmi serve --ray`` replicas use): a tenant's
fine-tune job runs in a Ray task that reserves its own CPUs, reports progress, trains the same
adapter as a worker process of the server, can be cancelled, and a task that ends without a
result fails its job with the reason."""

import os
from pathlib import Path

import pytest

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.jobs import wait_state
from tests.helpers.servers import ADMIN, LONG_JOB, TRAIN, tiny_server

ray = pytest.importorskip("ray")
REPO = str(Path(__file__).resolve().parents[2])
TEXTS = ["a wonderful film", "a dull and boring story"]


@pytest.fixture(scope="module")
def on_ray(tmp_path_factory):
    """A tiny server whose jobs run as Ray tasks on a local Ray cluster of 2 CPUs."""
    from hmi.scaleout.ray_jobs import RayLauncher

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    os.environ.setdefault("PYTHONPATH", REPO)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    server = tiny_server(tmp_path_factory.mktemp("home"), job_launcher=RayLauncher(cpus=1))
    url, stop = run_in_thread(server)
    yield server, Client(url, ADMIN)
    stop()
    ray.shutdown()


def test_a_tenant_job_runs_as_a_ray_task_and_trains_what_a_worker_process_trains(on_ray, tmp_path):
    server, admin = on_ray
    out = admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2, "dev": TRAIN}, epochs=2)
    job = admin.wait_job(out["job"], 300)
    assert job["state"] == "succeeded" and job["worker"] == "ray task" and job["worker_pid"] is None, job
    got = server.scheduler.infer([("alpha", t) for t in TEXTS])

    local = tiny_server(tmp_path)  # the same job in a worker process of a server of its own
    url, stop = run_in_thread(local)
    try:
        admin_local = Client(url, ADMIN)
        ref = admin_local.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2, "dev": TRAIN}, epochs=2)
        assert admin_local.wait_job(ref["job"], 300)["worker"] == "process"
        want = local.scheduler.infer([("alpha", t) for t in TEXTS])
    finally:
        stop()
    for g, w in zip(got, want):
        assert g["label"] == w["label"]
        for k in g["scores"]:
            assert abs(g["scores"][k] - w["scores"][k]) < 1e-5, (g, w)


def test_a_ray_job_reports_progress_and_is_cancelled(on_ray):
    _, admin = on_ray
    out = admin.create_tenant("patient", ["neg", "pos"], **LONG_JOB)
    assert wait_state(admin, out["job"], ("running",))["progress"] > 0
    admin.cancel_job(out["job"])
    job = admin.wait_job(out["job"], 60, poll=0.2)
    assert job["state"] == "cancelled", job


def test_a_ray_task_that_ends_without_a_result_fails_its_job_with_the_reason(on_ray):
    server, admin = on_ray
    out = admin.create_tenant("doomed", ["neg", "pos"], **LONG_JOB)
    wait_state(admin, out["job"], ("running",))
    server.jobs._procs[out["job"]].kill()  # what the death of the task's node or worker looks like
    job = admin.wait_job(out["job"], 120)
    assert job["state"] == "failed" and "Ray task" in job["error"], job
    assert admin.tenant("doomed")["state"] == "failed"
