"""Serving processes on two nodes of one Ray cluster sharing the registry actor (``hmi serve --ray
--registry actor``): a tenant trained through a server on the second node is served by one on the
head node with the same answers, and when the second node's server dies mid-job (on what it
reports as another host, so only its lease tells that it is gone) the head's server takes the job
over once the lease has expired and finishes it.

The cluster is ``ray.cluster_utils.Cluster`` on this machine: two raylets, each a Ray node; the
home is one folder both see, as an NFS mount would be."""

import os
import socket
import time
from pathlib import Path

import pytest

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import ADMIN, LONG_JOB, TRAIN, tiny_server

ray = pytest.importorskip("ray")
REPO = str(Path(__file__).resolve().parents[2])
TEXTS = ["a wonderful film", "a dull and boring story"]
FAST_LEASES = {"lease_s": 3.0, "orphan_check_s": 1.0}


class FarServer:
    """A tiny server in an actor on the second node, reporting its host as ``far-host``."""

    def __init__(self, home: str):
        socket.gethostname = lambda: "far-host"  # another machine, as the registry sees it
        from hmi.scaleout.ray_registry import RemoteRegistry

        self.server = tiny_server(Path(home), shared_home=True, registry=RemoteRegistry(), **FAST_LEASES)
        self.url, self._stop = run_in_thread(self.server)

    def where(self) -> tuple[str, str]:
        return self.url, ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from ray.cluster_utils import Cluster

    from hmi.scaleout.ray_registry import ACTOR_NAME, NAMESPACE, start_registry_actor

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    os.environ["PYTHONPATH"] = REPO
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"second": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    home = tmp_path_factory.mktemp("home")
    tiny_server(home).shutdown()  # the home's root PLOT, made once
    start_registry_actor(home)
    registry_node = ray.get(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE).__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_node_id()))
    yield home, registry_node
    ray.shutdown()
    cluster.shutdown()


def far_server(home: Path):
    actor = ray.remote(FarServer).options(resources={"second": 1}, num_cpus=0).remote(str(home))
    url, node = ray.get(actor.where.remote())
    return actor, url, node


def test_a_tenant_trained_on_another_node_is_served_here_with_the_same_answers(two_nodes):
    from hmi.scaleout.ray_registry import RemoteRegistry

    home, registry_node = two_nodes
    actor, far_url, far_node = far_server(home)
    assert far_node != registry_node  # the far server reaches the registry on the head node
    far = Client(far_url, ADMIN)
    out = far.create_tenant("travelled", ["neg", "pos"], training_data={"train": TRAIN * 2, "dev": TRAIN}, epochs=2)
    assert far.wait_job(out["job"], 300)["state"] == "succeeded"
    here = tiny_server(home, shared_home=True, registry=RemoteRegistry(), **FAST_LEASES)
    url, stop = run_in_thread(here)
    try:
        tenant = Client(url, out["token"])  # a token the head's server never issued
        assert tenant.infer("travelled", TEXTS) == Client(far_url, out["token"]).infer("travelled", TEXTS)
    finally:
        stop()
        ray.kill(actor)


def test_a_job_of_a_server_gone_with_its_node_is_taken_over_once_its_lease_expires(two_nodes):
    from hmi.scaleout.ray_registry import RemoteRegistry

    home, _ = two_nodes
    actor, far_url, _ = far_server(home)
    far = Client(far_url, ADMIN)
    out = far.create_tenant("orphaned", ["neg", "pos"], **LONG_JOB)
    deadline = time.time() + 120
    while (job := far.job(out["job"]))["state"] != "running":
        assert time.time() < deadline, job
        time.sleep(0.2)
    assert job["owner"].startswith("far-host:")
    here = tiny_server(home, shared_home=True, registry=RemoteRegistry(), **FAST_LEASES)
    url, stop = run_in_thread(here)
    try:
        admin = Client(url, ADMIN)
        time.sleep(2 * FAST_LEASES["orphan_check_s"])
        assert admin.job(out["job"])["owner"] == job["owner"]  # its lease is renewed: left alone
        ray.kill(actor)  # the far server's process ends without a word, as with its node
        killed = time.time()
        while (now := admin.job(out["job"]))["owner"] == job["owner"]:
            assert time.time() - killed < 60, now
            time.sleep(0.2)
        assert time.time() - killed >= FAST_LEASES["lease_s"] - 1.0  # not before the lease expired
        assert now["attempt"] == 2 and now["owner"] == here.leases.owner
        admin.cancel_job(out["job"])  # a minute of training: its take-over is what is tested
        assert admin.wait_job(out["job"], 60, poll=0.2)["state"] == "cancelled"
    finally:
        stop()
