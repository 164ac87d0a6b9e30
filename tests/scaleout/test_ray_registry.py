"""The registry as a Ray actor (``hmi.scaleout.ray_registry``, what replicas on several machines
share): every operation answers as the home's own registry does, concurrent claims of one job
through it take the job once, a restarted actor keeps every record, and a server runs on it."""

import os
import threading
import time
from pathlib import Path

import pytest

from hmi.services.registry import Leases, Registry
from tests.helpers.servers import ADMIN, TRAIN, tiny_server

ray = pytest.importorskip("ray")
REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    from hmi.scaleout.ray_registry import start_registry_actor, stop_registry_actor

    os.environ.setdefault("PYTHONPATH", REPO)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    home = tmp_path_factory.mktemp("home")
    handle = start_registry_actor(home)
    yield home, handle
    stop_registry_actor()
    ray.shutdown()


def script(reg) -> list:
    """A sequence of every operation, with what each answers (timestamps left out)."""
    def clean(v):
        if isinstance(v, dict):
            return {k: x for k, x in v.items() if k not in ("created", "updated", "resumed")}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, tuple):
            return tuple(clean(x) for x in v)
        return v

    dead = "gone-host:1"  # another host, no lease: its jobs are orphans
    out = [reg.create("tenants", "a", {"state": "training", "n": 1}), reg.create("tenants", "a", {"state": "x"}),
           reg.get("tenants", "a"), reg.get("tenants", "nobody"), reg.update("tenants", "a", n=2),
           reg.update("tenants", "nobody", n=2), reg.update_if("tenants", "a", ("ready",), n=3),
           reg.update_if("tenants", "a", ("training",), n=4), reg.claim("tenants", "a", {"n": 3}, n=5),
           reg.claim("tenants", "a", {"n": 4}, n=6), reg.put("domains", "d", {"state": "ready"}),
           reg.items("tenants"), reg.items("domains"), reg.delete("domains", "d"), reg.delete("domains", "d"),
           reg.age("domains", "d"), reg.age("tenants", "a") < 60]
    for jid, state in (("j1", "running"), ("j2", "queued"), ("j3", "succeeded")):
        reg.create("jobs", jid, {"id": jid, "state": state, "owner": dead, "tenant": "a"})
    leases = Leases(reg, ttl_s=60)
    out += [leases.alive({"owner": dead}), clean(reg.recover(leases.alive, resume=lambda j: j["id"] == "j2")),
            reg.items("jobs"), reg.get("tenants", "a")]
    return clean(out)


def test_every_operation_through_the_actor_answers_as_the_local_registry(actor, tmp_path):
    from hmi.scaleout.ray_registry import RemoteRegistry

    home, handle = actor
    local = Registry(tmp_path / "registry")
    try:
        want = script(local)
    finally:
        local.close()
    remote = RemoteRegistry()
    got = script(remote)
    assert got == want
    assert want[-1]["state"] == "failed" and want[-4] is False  # the orphaned job's tenant failed
    # The actor's records are the home's registry on disk.
    on_disk = Registry(home / "registry")
    try:
        assert on_disk.get("tenants", "a") == remote.get("tenants", "a")
    finally:
        on_disk.close()
    for table in ("tenants", "jobs"):
        for key, _ in remote.items(table):
            remote.delete(table, key)


def test_concurrent_claims_of_one_job_through_the_actor_take_it_once(actor):
    from hmi.scaleout.ray_registry import RemoteRegistry

    reg = RemoteRegistry()
    for i in range(20):
        reg.create("jobs", f"c{i}", {"id": f"c{i}", "state": "running", "owner": "gone-host:1"})
    wins: list[str] = []

    def claim_all(me: str) -> None:
        for i in range(20):
            if reg.claim("jobs", f"c{i}", {"owner": "gone-host:1"}, owner=me) is not None:
                wins.append(f"c{i}")

    threads = [threading.Thread(target=claim_all, args=(f"host{n}:1",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == sorted(f"c{i}" for i in range(20))  # each job claimed exactly once
    for i in range(20):
        reg.delete("jobs", f"c{i}")


def test_the_registry_actor_restarted_after_its_process_dies_keeps_every_record(actor):
    from hmi.scaleout.ray_registry import ACTOR_NAME, NAMESPACE, RemoteRegistry

    reg = RemoteRegistry()
    reg.create("tenants", "durable", {"state": "ready", "version": 3})
    handle = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)

    def pid() -> int:
        return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))

    before = pid()
    ray.kill(handle, no_restart=False)  # its process dies; Ray restarts it
    deadline = time.time() + 60
    while True:
        try:
            if pid() != before:
                break
        except ray.exceptions.RayActorError:  # restarting
            pass
        assert time.time() < deadline, "the registry actor was not restarted"
        time.sleep(0.2)
    rec = reg.get("tenants", "durable")
    assert rec["version"] == 3 and rec["state"] == "ready"
    reg.delete("tenants", "durable")


def test_a_server_on_the_registry_actor_trains_and_serves_a_tenant(actor, tmp_path):
    from hmi.client import Client
    from hmi.dispatcher.serve import run_in_thread
    from hmi.scaleout.ray_registry import RemoteRegistry

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    home, _ = actor
    server = tiny_server(home, shared_home=True, registry=RemoteRegistry())
    url, stop = run_in_thread(server)
    try:
        admin = Client(url, ADMIN)
        out = admin.create_tenant("remote", ["neg", "pos"], training_data={"train": TRAIN * 2}, epochs=1)
        assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
        assert admin.infer("remote", ["a great film"])[0]["label"] in ("neg", "pos")
        lease = RemoteRegistry().get("owners", server.leases.owner)
        assert lease is not None  # this server's lease, held in the actor
    finally:
        stop()
    assert RemoteRegistry().get("owners", server.leases.owner) is None  # released at a clean stop
    assert RemoteRegistry().get("tenants", "remote")["state"] == "ready"


def test_a_cached_tenant_record_is_seen_changed_within_its_cache_time_and_own_writes_at_once(actor):
    from hmi.scaleout.ray_registry import RemoteRegistry

    here, elsewhere = RemoteRegistry(cache_s=0.5), RemoteRegistry()
    elsewhere.create("tenants", "cached", {"state": "ready", "version": 1})
    elsewhere.create("jobs", "fresh", {"state": "running"})
    assert here.get("tenants", "cached")["version"] == 1 and here.get("jobs", "fresh")["state"] == "running"
    here.get("tenants", "cached")["version"] = 99  # a caller's changes to its copy stay its own
    elsewhere.update("tenants", "cached", version=2)
    elsewhere.update("jobs", "fresh", state="cancelled")
    assert here.get("tenants", "cached")["version"] == 1  # within the cache time: the record read
    assert here.get("jobs", "fresh")["state"] == "cancelled"  # jobs are never cached
    time.sleep(0.6)
    assert here.get("tenants", "cached")["version"] == 2
    here.update("tenants", "cached", version=3)  # this process's own write: seen at once
    assert here.get("tenants", "cached")["version"] == 3
    here.delete("tenants", "cached")
    assert here.get("tenants", "cached") is None
    elsewhere.create("tenants", "cached", {"state": "ready", "version": 1})
    assert here.get("tenants", "cached") is None  # its absence is cached too, as long
    time.sleep(0.6)
    assert here.get("tenants", "cached")["version"] == 1
    for table, key in (("tenants", "cached"), ("jobs", "fresh")):
        elsewhere.delete(table, key)
    with pytest.raises(ValueError, match="cache_s must be 0 or more"):
        RemoteRegistry(cache_s=-1)


def test_an_awaited_read_answers_as_get_and_lets_the_event_loop_run_meanwhile(actor):
    import asyncio

    from hmi.scaleout.ray_registry import RemoteRegistry

    elsewhere = RemoteRegistry()
    elsewhere.create("tenants", "awaited", {"state": "ready", "version": 1})
    for here in (RemoteRegistry(), RemoteRegistry(cache_s=0.5)):
        ticks = 0

        async def ticker(done: asyncio.Event) -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async def reads() -> list:
            done = asyncio.Event()
            tick = asyncio.ensure_future(ticker(done))
            out = [await here.aget("tenants", "awaited"), await here.aget("tenants", "nobody"),
                   await here.aget("jobs", "nothing")]
            for _ in range(20):
                await here.aget("tenants", "awaited")
            done.set()
            await tick
            return out

        ticks_before = ticks
        assert asyncio.run(reads()) == [here.get("tenants", "awaited"), None, None]
        assert here.get("tenants", "awaited")["version"] == 1
        if here.cache_s == 0:  # every read a round trip to the actor, during which the loop ran the ticker
            assert ticks - ticks_before >= 23
    cached = RemoteRegistry(cache_s=0.5)
    asyncio.run(cached.aget("tenants", "awaited"))
    elsewhere.update("tenants", "awaited", version=2)
    assert asyncio.run(cached.aget("tenants", "awaited"))["version"] == 1  # the awaited read fills the cache
    cached.update("tenants", "awaited", version=3)
    assert asyncio.run(cached.aget("tenants", "awaited"))["version"] == 3  # own writes seen at once
    elsewhere.delete("tenants", "awaited")
