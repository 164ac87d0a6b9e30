"""The gate in front of Ray Serve (``hmi serve --ray --gate``): a tenant the replicas keep
refusing over its share is marked at the gate by the replica that refuses it and then refused by
HAProxy itself, before Ray Serve's ingress; other tenants pass."""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hmi.client import ROUTING_HEADER, Client
from hmi.dispatcher.gate import MARK_AFTER, REFUSED_BY, free_port, haproxy_binary
from hmi.plot.store import PlotMeta, PlotStore
from hmi.scaleout.ray_serve import start_behind_gate, stop
from tests.helpers.ray import REPO, call
from tests.helpers.servers import ADMIN, TRAIN, tiny_server

ray = pytest.importorskip("ray")


@dataclass
class QueueOfOne:
    """A replica's server on the tests' tiny root whose tenants may each have one text waiting:
    a request of two texts is refused over its share, every time."""

    home: str

    def __call__(self):
        from hmi.scaleout.ray_jobs import RayLauncher

        return tiny_server(Path(self.home), shared_home=True, job_launcher=RayLauncher(), tenant_queue=1)


def test_through_ray_a_tenant_the_replicas_keep_refusing_over_its_share_is_then_refused_at_the_gate(tmp_path):
    if haproxy_binary() is None:
        pytest.skip("no haproxy here (the ray extra ships one)")
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    home = tmp_path / "home"
    home.mkdir()
    PlotStore(home / "plot", meta=PlotMeta("tiny", 2, 32), readonly=False).close()
    env = {"HMI_ADMIN_TOKEN": ADMIN, "HMI_HOME": str(home), "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    gate, inner = start_behind_gate(QueueOfOne(str(home)), port=free_port(), replicas=2, env=env)
    try:
        admin = Client(gate.url, ADMIN)
        out = admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2, "dev": TRAIN}, epochs=2)
        assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
        routed = {ROUTING_HEADER: "alpha"}
        assert call(gate.url, "POST", "/v1/tenants/alpha/infer", {"inputs": ["one"]}, headers=routed)[0] == 200
        by_server = 0
        for _ in range(4 * MARK_AFTER):
            status, headers, body = call(gate.url, "POST", "/v1/tenants/alpha/infer", {"inputs": ["one", "two"]},
                                         headers=routed)
            assert status == 429 and body["error"]["code"] == "over_share", body
            if headers.get(REFUSED_BY) == "gate":
                break
            by_server += 1
        else:
            pytest.fail(f"the gate never refused alpha after {by_server} refusals by its replica")
        assert by_server >= MARK_AFTER - 1  # the replica refused it first, then marked it
        status, headers, _ = call(gate.url, "POST", "/v1/tenants/alpha/infer", {"inputs": ["one"]}, headers=routed)
        assert status == 429 and headers.get(REFUSED_BY) == "gate" and headers.get("Retry-After") == "1"
        status, headers, body = call(gate.url, "POST", "/v1/tenants/beta/infer", {"inputs": ["the others pass"]})
        assert status == 404 and headers.get(REFUSED_BY) is None, body  # answered by a replica: no such tenant
        # Ray Serve's own ingress, behind the gate, still serves alpha: it is held at the gate only.
        assert call(inner, "POST", "/v1/tenants/alpha/infer", {"inputs": ["one"]}, headers=routed)[0] == 200
        time.sleep(gate.hold_s + 0.5)  # alpha stops: the mark ends one hold later
        assert call(gate.url, "POST", "/v1/tenants/alpha/infer", {"inputs": ["one"]}, headers=routed)[0] == 200
    finally:
        stop()
        gate.close()
