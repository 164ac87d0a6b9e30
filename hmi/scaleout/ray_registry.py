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
hosts is by leases (``hmi.services.registry.Leases``), stamped by the actor's clock.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from pathlib import Path

from hmi.services.registry import Registry, RegistryOps, RegistryUnavailable

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

    @staticmethod
    def _unavailable(op: str, attempt: int, exc: Exception) -> None:
        """After a call failed with the actor unavailable: returns when it is to be tried again (a
        read, once: the actor is restarting), raises ``RegistryUnavailable`` otherwise."""
        if op in READS and attempt == 1:
            return
        raise RegistryUnavailable(f"the registry actor is unavailable ({op}): {exc}") from exc

    def _call(self, op: str, *args, **kwargs):
        import ray
        from ray.exceptions import RayActorError

        for attempt in (1, 2):
            try:
                return ray.get(self.actor.call.remote(op, *args, **kwargs))
            except RayActorError as exc:
                self._unavailable(op, attempt, exc)

    async def _acall(self, op: str, *args, **kwargs):
        """``_call`` awaited on an event loop (a Ray object reference is awaitable)."""
        from ray.exceptions import RayActorError

        for attempt in (1, 2):
            try:
                return await self.actor.call.remote(op, *args, **kwargs)
            except RayActorError as exc:
                self._unavailable(op, attempt, exc)

    def _cached(self, table: str, key: str) -> tuple[tuple | None, int]:
        """For a read of ``table``/``key``: ``((record,), writes)`` when a fresh copy is cached,
        else ``(None, writes)``; ``writes``: this process's writes to the record so far (or -1
        when ``table`` is not cached)."""
        if not (self.cache_s > 0 and table == self.CACHED):
            return None, -1
        with self._lock:
            hit, writes = self._cache.get(key), self._writes[key]
        if hit is not None and time.monotonic() - hit[0] < self.cache_s:
            return (copy.deepcopy(hit[1]),), writes
        return None, writes

    def _keep(self, key: str, read_at: float, writes: int, value: dict | None) -> dict | None:
        """Caches a record read at ``read_at`` unless a write of this process began or ended since
        ``writes`` was counted (or the table is not cached: ``writes`` -1); returns a copy."""
        if writes < 0:
            return value
        with self._lock:
            if self._writes[key] == writes:
                self._cache[key] = (read_at, value)
        return copy.deepcopy(value)

    def get(self, table: str, key: str) -> dict | None:
        hit, writes = self._cached(table, key)
        if hit is not None:
            return hit[0]
        read_at = time.monotonic()
        return self._keep(key, read_at, writes, self._call("get", table, key))

    async def aget(self, table: str, key: str) -> dict | None:
        """``get`` awaited: the event loop serves other requests during the actor's round trip."""
        hit, writes = self._cached(table, key)
        if hit is not None:
            return hit[0]
        read_at = time.monotonic()
        return self._keep(key, read_at, writes, await self._acall("get", table, key))

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

    async def aitems(self, table: str) -> list[tuple[str, dict]]:
        """``items`` awaited (see ``aget``)."""
        return await self._acall("items", table)

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
