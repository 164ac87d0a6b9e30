"""HMI on a real local Ray Serve cluster (two replicas, one shared home, the tiny root): the same
HTTP API and answers as the single-process server, a tenant created through the cluster is served
by every replica, and a tenant's requests (naming it in the routing header, as hmi.client does)
stay on the replica that holds it.  Each test runs on two clusters: HAProxy's ingress with the
registry actor (replicas on any node), Ray Serve's proxy with the home's own registry."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hmi.client import ROUTING_HEADER, Client
from hmi.dispatcher.gate import free_port
from hmi.plot.store import PlotMeta, PlotStore
from hmi.scaleout.ray_serve import start, stop
from tests.helpers.ray import REPO, call  # noqa: F401
from tests.helpers.servers import ADMIN, LONG_JOB, TRAIN, tiny_server

ray = pytest.importorskip("ray")
TEXTS = ["a wonderful film", "a dull and boring story"]


@dataclass
class TinyReplica:
    """A replica's server: the tests' tiny root on the shared home, its jobs as Ray tasks (as
    ``ReplicaServer`` builds it)."""

    home: str
    registry: str = "home"

    def __call__(self):
        from hmi.scaleout.ray_jobs import RayLauncher
        from hmi.scaleout.ray_registry import RemoteRegistry

        return tiny_server(Path(self.home), shared_home=True, job_launcher=RayLauncher(),
                           registry=RemoteRegistry() if self.registry == "actor" else None)


@pytest.fixture(scope="module", params=[("haproxy", "actor"), ("proxy", "home")], ids=["haproxy-actor", "proxy-home"])
def cluster(request, tmp_path_factory):
    """A two-replica cluster behind each of Ray Serve's ingresses (HAProxy, the default; the Python
    proxy), with each of the registries (the registry actor; the home's LMDB)."""
    ingress, registry = request.param
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    home = tmp_path_factory.mktemp("home")
    PlotStore(home / "plot", meta=PlotMeta("tiny", 2, 32), readonly=False).close()
    env = {"HMI_ADMIN_TOKEN": ADMIN, "HMI_HOME": str(home), "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    url = start(TinyReplica(str(home), registry), port=free_port(), replicas=2, env=env, ingress=ingress)
    assert {call(url, "GET", "/healthz")[2]["registry"] for _ in range(8)} == {"ray actor" if registry == "actor" else "lmdb"}
    admin = Client(url, ADMIN)
    out = admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2, "dev": TRAIN}, epochs=2)
    job = admin.wait_job(out["job"], 300)
    assert job["state"] == "succeeded" and job["worker"] == "ray task", job
    yield {"url": url, "home": home, "admin": admin, "alpha_token": out["token"]}
    stop()


def test_answers_through_the_cluster_equal_the_single_process_servers(cluster):
    got = Client(cluster["url"], cluster["alpha_token"]).infer("alpha", TEXTS)
    single = tiny_server(cluster["home"], shared_home=True)  # the same home, served by one process
    try:
        ref = single.scheduler.infer([("alpha", t) for t in TEXTS])
    finally:
        single.shutdown()
    for g, r in zip(got, ref):
        assert g["label"] == r["label"]
        torch.testing.assert_close(torch.tensor(list(g["scores"].values())), torch.tensor(list(r["scores"].values())),
                                   atol=1e-5, rtol=0)


def test_a_tenant_created_through_the_cluster_is_served_by_every_replica(cluster):
    # Without the routing header Ray Serve's ingress may hand a request to either replica.
    answers = [call(cluster["url"], "POST", "/v1/tenants/alpha/infer", {"inputs": TEXTS}, token=cluster["alpha_token"])
               for _ in range(16)]
    assert {a[1]["X-HMI-Replica"] for a in answers} and len({a[1]["X-HMI-Replica"] for a in answers}) == 2
    assert all(a[0] == 200 for a in answers)
    assert len({json.dumps(a[2]["outputs"]) for a in answers}) == 1


def test_a_tenants_requests_stay_on_the_replica_that_holds_it(cluster):
    seen = [call(cluster["url"], "POST", "/v1/tenants/alpha/infer", {"inputs": TEXTS[:1]},
                 headers={ROUTING_HEADER: "alpha"})[1] for _ in range(12)]
    assert len({h["X-HMI-Replica"] for h in seen}) == 1
    assert [h["X-HMI-Affinity"] for h in seen[1:]] == ["hit"] * 11


def test_errors_are_the_single_process_servers(cluster):
    from hmi.dispatcher.serve import run_in_thread

    bad = [("POST", "/v1/tenants/nobody/infer", {"inputs": ["x"]}, ADMIN),
           ("POST", "/v1/tenants/alpha/infer", {"inputs": ["x"]}, "wrong"),
           ("POST", "/v1/tenants/alpha/infer", {"inputs": "not a list"}, ADMIN),
           ("POST", "/v1/tenants", {"name": "alpha", "task": {"labels": ["a", "b"]}, "training_data": {"train": TRAIN}}, ADMIN),
           ("DELETE", "/v1/domains/root", None, ADMIN),
           ("GET", "/v1/jobs/nope", None, ADMIN),
           ("GET", "/nowhere", None, ADMIN)]
    single = tiny_server(cluster["home"], shared_home=True)
    url, stop_single = run_in_thread(single)
    try:
        expected = [call(url, *b[:3], token=b[3]) for b in bad]
    finally:
        stop_single()
    got = [call(cluster["url"], *b[:3], token=b[3]) for b in bad]
    assert [(s, body) for s, _, body in got] == [(s, body) for s, _, body in expected]
    assert all(400 <= s < 500 for s, _, _ in got)
    status, _, body = call(cluster["url"], "GET", "/healthz", token=None)
    assert status == 200 and body["status"] == "ok"


def test_a_replica_killed_while_training_loses_no_job_and_no_answer(cluster):
    """kill -9 of the replica running a tenant's job: the job runs again from its kept inputs (in
    the replica Ray Serve starts in its place, or taken over by the other one) and succeeds;
    requests meanwhile get the answers they got before, or a clear error, never other outputs."""
    import signal
    import time

    from hmi.services.registry import Registry

    admin, url = cluster["admin"], cluster["url"]
    before = call(url, "POST", "/v1/tenants/alpha/infer", {"inputs": TEXTS}, token=cluster["alpha_token"])[2]["outputs"]
    out = admin.create_tenant("phoenix", ["neg", "pos"], training_data={"train": TRAIN * 100, "dev": TRAIN}, epochs=8)
    deadline = time.time() + 120
    while (job := admin.job(out["job"]))["state"] != "running":
        assert time.time() < deadline and job["state"] == "queued", {k: job.get(k) for k in ("state", "progress", "error")}
        time.sleep(0.1)
    reg = Registry(cluster["home"] / "registry")
    owner = reg.get("jobs", out["job"])["owner"]
    reg.close()
    os.kill(int(owner.rpartition(":")[2]), signal.SIGKILL)
    answers = []
    deadline = time.time() + 300
    while (job := admin.job(out["job"]))["state"] not in ("succeeded", "failed"):
        assert time.time() < deadline, job
        answers.append(call(url, "POST", "/v1/tenants/alpha/infer", {"inputs": TEXTS}, token=cluster["alpha_token"]))
        time.sleep(0.5)
    assert job["state"] == "succeeded" and job["attempt"] == 2 and job["owner"] != owner, job
    ok = [a for a in answers if a[0] == 200]
    assert ok and all(a[2]["outputs"] == before for a in ok)
    # An error is a 5xx with its reason, or (0) the connection closed without an answer: what
    # HAProxy does with a request in flight on the killed replica (hmi.client asks such a safe
    # request again).
    assert all(a[0] in (0, 200) or a[0] >= 500 and "error" in a[2] for a in answers)
    status, _, body = call(url, "POST", "/v1/tenants/phoenix/infer", {"inputs": TEXTS}, token=out["token"])
    assert status == 200 and len(body["outputs"]) == 2, body


def test_the_haproxy_ingress_keeps_a_tenant_on_one_replica_by_its_header_resends_what_a_dead_one_lost_and_drains_briefly():
    from hmi.scaleout.ray_serve import ingress_env

    assert ingress_env("haproxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                                      "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": f"hdr({ROUTING_HEADER})",
                                      "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                                      "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response junk-response 502 503 504",
                                      "RAY_SERVE_HAPROXY_RETRIES": "3",
                                      "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3"}
    assert ingress_env("proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    assert ingress_env("proxy").keys() == ingress_env("haproxy").keys() - {
        "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "RAY_SERVE_HAPROXY_RETRY_ON", "RAY_SERVE_HAPROXY_RETRIES",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"}
    with pytest.raises(ValueError, match="unknown ingress 'nginx'; use one of haproxy, proxy"):
        ingress_env("nginx")


def test_behind_haproxy_a_replica_holds_its_most_recently_used_tenants_loading_each_once(tmp_path, monkeypatch):
    import asyncio

    from hmi.scaleout.ray_serve import ReplicaCore, routes_by_header

    for value, expected in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", value)
        assert routes_by_header() is expected
    core = ReplicaCore(lambda: tiny_server(tmp_path, shared_home=True), tenants=2)
    try:
        async def run() -> None:
            await asyncio.gather(*(core.hold("a") for _ in range(5)))  # five requests waiting on one load
            assert core.loads == {"a": 1}
            for t in ("b", "a", "c"):  # b is now the least recently used of three: let go
                await core.hold(t)
            assert list(core._lru) == ["a", "c"] and core.loads == {"a": 1, "b": 1, "c": 1}
            await core.hold("b")  # loaded again; a goes
            assert list(core._lru) == ["c", "b"] and core.loads["b"] == 2 and not core._loading
            first = asyncio.ensure_future(core.hold("d"))
            while "d" not in core.loads:  # until its load has begun
                await asyncio.sleep(0)
            first.cancel()  # the request that began it goes away: the load goes on for the next one
            await core.hold("d")
            assert core.loads["d"] == 1 and list(core._lru) == ["b", "d"]

        asyncio.run(run())
    finally:
        core.close()


def test_a_job_is_cancelled_through_any_replica(cluster):
    from tests.helpers.jobs import wait_state

    admin, url = cluster["admin"], cluster["url"]
    out = admin.create_tenant("quitter", ["neg", "pos"], **LONG_JOB)
    wait_state(admin, out["job"], ("running",))
    # Without the routing header either replica takes the request: both must stop the job.
    status, _, body = call(url, "DELETE", f"/v1/jobs/{out['job']}")
    assert status == 202, body
    job = admin.wait_job(out["job"], 60, poll=0.2)
    assert job["state"] == "cancelled", job
