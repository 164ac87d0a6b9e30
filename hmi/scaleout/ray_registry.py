"""The registry as a named Ray actor: one writer that serving processes on every node of a Ray
cluster share (``hmi serve --ray --registry actor``).

An LMDB environment is shared safely only by processes on one host (its lock file lives in
shared memory; over NFS it does not hold).  Replicas on several machines therefore reach the
registry through an actor instead: ``RegistryService`` owns the home's LMDB registry on the node
that created it (the driver's, which holds the home) and runs each operation there as the one
transaction it is; ``RemoteRegistry`` is the registry interface a ``Server`` takes, forwarding
every operation to the actor.  Recovery (``RegistryOps.recover``) is built from those operations,
each a compare-and-set, so processes on any node may recover one home at once.

The actor is detached and restarted by Ray if its process dies (the registry is on disk, so
nothing is lost): an operation in flight then fails with ``RegistryUnavailable`` (the HTTP API
answers 503 with ``Retry-After``), a read is tried once more.  Liveness of job owners on other
hosts is by leases (``hmi.dispatcher.registry.Leases``), stamped by the actor's clock.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from pathlib import Path

from hmi.dispatcher.registry import Registry, RegistryOps, RegistryUnavailable

ACTOR_NAME = "hmi-registry"
NAMESPACE = "hmi"
READS = ("get", "items", "age")
OPS = READS + ("put", "update", "update_if", "create", "delete", "claim")


class RegistryService:
    """The actor's body: the home's registry, opened on the actor's node."""

    def __init__(self, path: str):
        self.registry = Registry(path)
        self.calls: Counter = Counter()  # operation -> calls since the actor (re)started

    def call(self, op: str, *args, **kwargs):
        if op not in OPS:
            raise ValueError(f"unknown registry operation {op!r}")
        self.calls[op] += 1
        return getattr(self.registry, op)(*args, **kwargs)

    def stats(self) -> dict[str, int]:
        """Calls per operation since the actor (re)started: the registry's load."""
        return dict(self.calls)

    def path(self) -> str:
        return str(self.registry.path)


class RemoteRegistry(RegistryOps):
    """The registry interface, each operation run by the registry actor (one round trip).

    ``cache_s`` > 0 keeps each tenant record read (``get("tenants", ...)``, what every request
    reads) for that long: a change made through another process is then seen within ``cache_s``
    instead of at once, and a request costs no round trip while its tenant's record is cached.
    This process's own writes to a tenant drop its cached record.  Jobs, domains and leases are
    always read from the actor."""

    where = "ray actor"
    CACHED = "tenants"

    def __init__(self, actor=None, cache_s: float = 0.0):
        import ray

        if not cache_s >= 0:
            raise ValueError(f"cache_s must be 0 or more, got {cache_s}")
        self.actor = actor if actor is not None else ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, dict | None]] = {}  # tenant -> (read at, record)
        self._writes: Counter = Counter()  # tenant -> this process's writes to it (started or ended)
        self._lock = threading.Lock()

    def _forget(self, table: str, key: str) -> None:
        if table == self.CACHED:
            with self._lock:
                self._cache.pop(key, None)
                self._writes[key] += 1

    def _write(self, op: str, table: str, key: str, *args, **kwargs):
        """A write, with the record's cached copy dropped before and after it; a read that overlaps a
        write of this process is not cached (see ``get``)."""
        self._forget(table, key)
        try:
            return self._call(op, table, key, *args, **kwargs)
        finally:
            self._forget(table, key)

    def _call(self, op: str, *args, **kwargs):
        import ray
        from ray.exceptions import RayActorError

        for attempt in (1, 2):
            try:
                return ray.get(self.actor.call.remote(op, *args, **kwargs))
            except RayActorError as exc:
                if op in READS and attempt == 1:
                    continue  # the actor is restarting: a read is safe to repeat
                raise RegistryUnavailable(f"the registry actor is unavailable ({op}): {exc}") from exc

    def get(self, table: str, key: str) -> dict | None:
        if self.cache_s > 0 and table == self.CACHED:
            with self._lock:
                hit, writes = self._cache.get(key), self._writes[key]
            if hit is not None and time.monotonic() - hit[0] < self.cache_s:
                return copy.deepcopy(hit[1])
            read_at = time.monotonic()
            value = self._call("get", table, key)
            with self._lock:
                if self._writes[key] == writes:  # no write of this process began or ended meanwhile
                    self._cache[key] = (read_at, value)
            return copy.deepcopy(value)
        return self._call("get", table, key)

    def put(self, table: str, key: str, value: dict) -> None:
        self._write("put", table, key, value)

    def update(self, table: str, key: str, **changes) -> dict | None:
        return self._write("update", table, key, **changes)

    def update_if(self, table: str, key: str, states: tuple[str, ...], **changes) -> dict | None:
        return self._write("update_if", table, key, states, **changes)

    def create(self, table: str, key: str, value: dict) -> bool:
        return self._write("create", table, key, value)

    def delete(self, table: str, key: str) -> bool:
        return self._write("delete", table, key)

    def items(self, table: str) -> list[tuple[str, dict]]:
        return self._call("items", table)

    def claim(self, table: str, key: str, expect: dict, **changes) -> dict | None:
        return self._write("claim", table, key, expect, **changes)

    def age(self, table: str, key: str) -> float | None:
        return self._call("age", table, key)

    def close(self) -> None:
        """Nothing to close here: the actor serves the other processes on."""


def start_registry_actor(home: Path | str):
    """Starts the registry actor for ``home`` on this node (or returns the running one); call it
    where ``home`` is, before the replicas start."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    expected = str(Path(home) / "registry")
    actor = ray.remote(RegistryService).options(
        name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
        max_concurrency=8, num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(expected)
    serving = ray.get(actor.path.remote())
    if serving != expected:
        raise RuntimeError(f"a registry actor for another home is running ({serving}); stop it first")
    return actor


def stop_registry_actor() -> None:
    """Stops the registry actor, if one runs (``hmi serve --ray`` does at its end)."""
    import ray

    try:
        ray.kill(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE))
    except ValueError:
        pass
