"""Several serving processes on one HMI_HOME (the replicas of ``hmi serve --ray``): what another
process writes into the shared registry and adapter store (a new tenant, a new version, a
deletion) is what this one serves at the next request; start-up recovery leaves the jobs of
live processes alone.  "Another process" is played by a second AdapterStore on the same folder
and writes to the registry (which keeps no copy in memory), as another process makes them."""

import os
import subprocess
import sys

import pytest
import torch

from hmi.adapters.spec import AdapterSpec
from hmi.adapters.store import AdapterStore
from hmi.client import ApiError, Client
from hmi.dispatcher.serve import run_in_thread
from hmi.services.auth import hash_token, new_token
from hmi.services.registry import Leases, Registry, owner_alive, process_owner
from hmi.training.finetune import tenant_model
from tests.helpers.servers import ADMIN, tiny_server

SPEC = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4)
TEXTS = ["a wonderful film", "a dull and boring story"]


def weights(server, seed: int) -> dict:
    w = tenant_model(server.root.bert, server.root.spec.l_low, SPEC, seed=seed).weights()
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in w.items()}


def publish_elsewhere(server, name: str, w: dict, token: str | None = None) -> None:
    """What another replica writes when it serves a new version of ``name`` (or creates it)."""
    AdapterStore(server.home / "tenants").save(name, SPEC, w)
    rec = server.registry.get("tenants", name)
    if rec is None:
        server.registry.create("tenants", name, {"state": "ready", "model": "encoder", "domain": "root",
                                                 "spec": SPEC.to_dict(), "truncate": False, "job": None, "version": 1,
                                                 "token_hash": hash_token(token), "root": server.served.root_fingerprint})
    else:
        server.registry.update("tenants", name, version=rec["version"] + 1)


@pytest.fixture
def live(tmp_path):
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path / "home", shared_home=True)
    url, stop = run_in_thread(server)
    yield server, url
    stop()


def scores(client: Client, name: str) -> list[list[float]]:
    return [[o["scores"][k] for k in ("neg", "pos")] for o in client.infer(name, TEXTS)]


def test_a_tenant_created_retrained_and_deleted_elsewhere_is_served_as_the_registry_says(live):
    server, url = live
    token = new_token("hmi_t")
    a, b = weights(server, 1), weights(server, 2)
    publish_elsewhere(server, "twin", b, new_token("hmi_t"))  # serves b from the start: the reference
    publish_elsewhere(server, "elsewhere", a, token)
    tenant = Client(url, token)  # a token this process never issued
    first = scores(tenant, "elsewhere")
    assert first != scores(Client(url, ADMIN), "twin")
    publish_elsewhere(server, "elsewhere", b)  # a new version, published by another process
    assert scores(tenant, "elsewhere") == scores(Client(url, ADMIN), "twin")
    server.registry.delete("tenants", "elsewhere")
    with pytest.raises(ApiError) as e:
        Client(url, ADMIN).infer("elsewhere", TEXTS)
    assert e.value.status == 404


def test_a_tenant_deleted_and_created_again_elsewhere_under_its_name_serves_its_new_weights(live):
    server, url = live
    admin = Client(url, ADMIN)
    a, b = weights(server, 1), weights(server, 2)
    publish_elsewhere(server, "twin", b, new_token("hmi_t"))
    publish_elsewhere(server, "reborn", a, new_token("hmi_t"))
    first = scores(admin, "reborn")  # version 1, weights a: now cached here
    server.registry.delete("tenants", "reborn")
    publish_elsewhere(server, "reborn", b, new_token("hmi_t"))  # version 1 again, another tenant
    assert scores(admin, "reborn") == scores(admin, "twin") != first


def test_without_a_shared_home_a_server_keeps_its_own_view(tmp_path):
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path / "home")
    url, stop = run_in_thread(server)
    try:
        publish_elsewhere(server, "elsewhere", weights(server, 1), new_token("hmi_t"))
        with pytest.raises(ApiError) as e:
            Client(url, ADMIN).infer("elsewhere", TEXTS)
        assert e.value.status == 409  # registered, but this process never loaded it
    finally:
        stop()


def test_recovery_fails_only_the_jobs_of_processes_that_are_gone(tmp_path):
    reg = Registry(tmp_path / "registry")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = process_owner().rpartition(":")[0]
    jobs = {"live": f"{host}:{os.getppid()}", "dead": f"{host}:{dead.stdout.strip()}", "unowned": None,
            "other-host": "another-host:1"}
    for jid, owner in jobs.items():
        reg.create("jobs", jid, {"id": jid, "state": "running", "owner": owner})
    assert owner_alive({"owner": jobs["live"]}) and not owner_alive({"owner": jobs["dead"]})
    failed, claimed = reg.recover(owner_alive)
    assert sorted(failed) == ["dead", "unowned"] and claimed == []
    assert reg.get("jobs", "live")["state"] == "running" and reg.get("jobs", "other-host")["state"] == "running"
    assert sorted(reg.recover()[0]) == ["live", "other-host"]  # a single process fails every unfinished job
    reg.close()


def test_a_job_of_another_host_is_taken_over_only_once_its_owners_lease_has_expired(tmp_path):
    import time

    reg = Registry(tmp_path / "registry")
    other = "another-host:7"
    reg.create("jobs", "far", {"id": "far", "state": "running", "owner": other})
    here, there = Leases(reg, ttl_s=0.5), Leases(reg, ttl_s=0.5, owner=other)
    assert not here.alive({"owner": other})  # no lease: the host never said it runs
    there.renew()
    assert here.alive({"owner": other}) and reg.recover(here.alive) == ([], [])
    time.sleep(0.6)  # not renewed for longer than its time to live
    assert not here.alive({"owner": other})
    assert reg.recover(here.alive)[0] == ["far"]
    there.renew()
    there.release()  # a clean stop ends the lease at once
    assert not here.alive({"owner": other})
    reg.close()


def test_a_job_running_in_another_process_is_cancelled_through_this_one(live):
    """A cancel request reaches whichever replica runs the job: it is recorded with the job, and the
    job's owner stops its worker.  The other replica is played by a second job manager on the
    registry, which does not run the job."""
    from hmi.services.jobs import JobManager
    from tests.helpers.jobs import wait_state
    from tests.helpers.servers import LONG_JOB

    server, url = live
    admin = Client(url, ADMIN)
    out = admin.create_tenant("patient", ["neg", "pos"], **LONG_JOB)
    wait_state(admin, out["job"], ("running",))
    elsewhere = JobManager(server.registry, server.jobs.ctx, lambda *a: None)
    try:
        assert elsewhere.cancel(out["job"])
    finally:
        elsewhere.shutdown()
    job = admin.wait_job(out["job"], 60, poll=0.2)
    assert job["state"] == "cancelled" and job["cancel_requested"], job


def test_the_ray_serve_config_file_is_valid_and_builds_the_application():
    from pathlib import Path

    import yaml
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    from hmi.scaleout.ray_serve import app_builder

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "ray-serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    (app,) = schema.applications
    assert app.import_path == "hmi.scaleout.ray_serve:app_builder"
    assert isinstance(app_builder(app.args), Application)
