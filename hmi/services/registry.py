"""The registry: domains, tenants, token hashes, jobs and the leases of the processes that run
them, in one LMDB environment.

Every state change is one LMDB write transaction, so after a crash a record is in its old
state or its new one.  Values are JSON.  ``RegistryOps`` holds what is built from the
single-record operations (recovery), so a registry served by another process
(``hmi.scaleout.ray_registry``) shares it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import lmdb

from hmi.io import disk_writes

TABLES = (b"tenants", b"domains", b"jobs", b"owners")
UNFINISHED = ("queued", "running")  # the states of a job that some process still has to end


class RegistryUnavailable(RuntimeError):
    """A registry kept by another process could not be reached (it is restarting, or its host is
    gone); the operation may or may not have been applied."""


def process_owner() -> str:
    """What a job record names as the process that runs it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(job: dict) -> bool:
    """Whether the process a job record names (``owner``, see :func:`process_owner`) still runs on
    this host; records of other hosts count as alive (see :class:`Leases` for those), records
    without an owner as gone."""
    host, _, pid = (job.get("owner") or "").rpartition(":")
    if not pid.isdigit():
        return False
    if host != socket.gethostname():
        return True
    if int(pid) == os.getpid():
        return False  # this process is starting: the record is of an earlier process with its pid
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Leases:
    """Liveness of the processes that run jobs, on a registry that processes on several hosts
    share.  Each serving process renews its lease (the ``owners`` table: ``host:pid`` -> a record
    the registry stamps) more often than every ``ttl_s`` seconds.  A job's owner on this host is
    alive while its pid runs (exact and immediate); one on another host while its lease is younger
    than ``ttl_s``, measured by the registry's clock (so the hosts' clocks may differ)."""

    def __init__(self, registry: "RegistryOps", ttl_s: float = 60.0, owner: str | None = None):
        self.registry, self.ttl_s = registry, ttl_s
        self.owner = owner or process_owner()

    def renew(self) -> None:
        self.registry.put("owners", self.owner, {"ttl_s": self.ttl_s})

    def release(self) -> None:
        """Ends this process's lease (a clean stop): its unfinished jobs are taken over at once."""
        self.registry.delete("owners", self.owner)

    def alive(self, job: dict) -> bool:
        owner = job.get("owner") or ""
        host, _, pid = owner.rpartition(":")
        if not pid.isdigit():
            return False
        if host == socket.gethostname():
            return owner_alive(job)
        age = self.registry.age("owners", owner)
        return age is not None and age < self.ttl_s


class RegistryOps:
    """What is built on a registry's single-record operations (``get``, ``update``, ``claim``,
    ``items``), each of which is one transaction wherever the registry runs."""

    where = "lmdb"  # what keeps the records (reported by /healthz)

    async def aget(self, table: str, key: str) -> dict | None:
        """``get`` for a caller on an event loop.  Here the record is read at once (an LMDB read
        takes microseconds); a registry kept by another process awaits its answer instead of
        holding up the loop (``hmi.scaleout.ray_registry.RemoteRegistry``)."""
        return self.get(table, key)

    async def aitems(self, table: str) -> list[tuple[str, dict]]:
        """``items`` for a caller on an event loop (see ``aget``)."""
        return self.items(table)

    def recover(self, alive: Callable[[dict], bool] | None = None,
                resume: Callable[[dict], bool] | None = None) -> tuple[list[str], list[dict]]:
        """After a restart: jobs that were queued or running are failed with the reason, and the
        tenants they were creating are marked failed (never served half-built).  With ``alive``
        (a home shared by several serving processes), only the jobs ``alive(job)`` says no live
        process runs.  With ``resume``, a job it accepts (its inputs were kept) is instead claimed
        for this process: queued again, ``attempt`` counted up unless a shutdown stopped it
        (``stopped_by_shutdown``); the caller runs it.  Each job is
        claimed or failed in one transaction that first checks its owner is unchanged, so of
        several processes recovering one home only one takes a job.  Returns (the failed jobs' ids,
        the records of the jobs claimed)."""
        failed, claimed = [], []
        for jid, job in self.items("jobs"):
            if job["state"] not in UNFINISHED or (alive is not None and alive(job)):
                continue
            seen = {"state": job["state"], "owner": job.get("owner")}
            if resume is not None and resume(job):
                attempt = job.get("attempt", 1) + (0 if job.get("stopped_by_shutdown") else 1)
                mine = self.claim("jobs", jid, seen, state="queued", owner=process_owner(), progress=0.0,
                                  attempt=attempt, stopped_by_shutdown=False, resumed=time.time())
                if mine is not None:  # else another process took it meanwhile
                    claimed.append(mine)
                continue
            if self.claim("jobs", jid, seen, state="failed", error="the server stopped while this job ran") is None:
                continue  # another process took it meanwhile
            failed.append(jid)
            t = job.get("tenant")
            if t:
                rec = self.get("tenants", t)
                if rec and rec["state"] == "training":
                    self.update("tenants", t, state="failed", error="training was interrupted by a restart")
                elif rec and rec["state"] == "updating":
                    self.update("tenants", t, state="ready")
        return failed, claimed


class Registry(RegistryOps):
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.path), map_size=1 << 30, max_dbs=len(TABLES) + 1, subdir=True)
        self._db = {t.decode(): self.env.open_db(t) for t in TABLES}

    @contextmanager
    def _writing(self, table: str):
        """A write transaction on ``table``, committed on leaving; a full disk raises DiskFullError."""
        with disk_writes(self.path), self.env.begin(write=True, db=self._db[table]) as txn:
            yield txn

    def get(self, table: str, key: str) -> dict | None:
        with self.env.begin(db=self._db[table]) as txn:
            raw = txn.get(key.encode())
        return None if raw is None else json.loads(raw)

    def put(self, table: str, key: str, value: dict) -> None:
        value = {**value, "updated": time.time()}
        with self._writing(table) as txn:
            txn.put(key.encode(), json.dumps(value).encode())

    def update(self, table: str, key: str, **changes) -> dict | None:
        """Read-modify-write in one transaction; returns the new value (None if absent)."""
        with self._writing(table) as txn:
            raw = txn.get(key.encode())
            if raw is None:
                return None
            value = {**json.loads(raw), **changes, "updated": time.time()}
            txn.put(key.encode(), json.dumps(value).encode())
            return value

    def update_if(self, table: str, key: str, states: tuple[str, ...], **changes) -> dict | None:
        """Compare-and-set: applies ``changes`` only while the record's state is one of ``states``,
        in one transaction; returns the new value, or None (absent, or in another state)."""
        with self._writing(table) as txn:
            raw = txn.get(key.encode())
            if raw is None or json.loads(raw).get("state") not in states:
                return None
            value = {**json.loads(raw), **changes, "updated": time.time()}
            txn.put(key.encode(), json.dumps(value).encode())
            return value

    def create(self, table: str, key: str, value: dict) -> bool:
        """Inserts unless the key exists; returns whether it was inserted."""
        value = {**value, "created": time.time(), "updated": time.time()}
        with self._writing(table) as txn:
            return txn.put(key.encode(), json.dumps(value).encode(), overwrite=False)

    def delete(self, table: str, key: str) -> bool:
        with self._writing(table) as txn:
            return txn.delete(key.encode())

    def items(self, table: str) -> list[tuple[str, dict]]:
        with self.env.begin(db=self._db[table]) as txn:
            return [(k.decode(), json.loads(v)) for k, v in txn.cursor()]

    def claim(self, table: str, key: str, expect: dict, **changes) -> dict | None:
        """Compare-and-set on any fields: applies ``changes`` only while the record's fields equal
        ``expect``, in one transaction; returns the new value, or None (absent, or changed)."""
        with self._writing(table) as txn:
            raw = txn.get(key.encode())
            if raw is None:
                return None
            value = json.loads(raw)
            if any(value.get(k) != v for k, v in expect.items()):
                return None
            value = {**value, **changes, "updated": time.time()}
            txn.put(key.encode(), json.dumps(value).encode())
            return value

    def age(self, table: str, key: str) -> float | None:
        """Seconds since the record was last written, by this registry's clock (None if absent)."""
        value = self.get(table, key)
        return None if value is None else max(0.0, time.time() - value["updated"])

    def close(self) -> None:
        self.env.close()
