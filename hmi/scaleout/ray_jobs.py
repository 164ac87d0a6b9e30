"""Jobs as Ray tasks (``hmi serve --ray``): a replica's fine-tune and domain jobs run where the
Ray cluster has the resources for them, not as processes of the replica.

``RayLauncher`` is a job launcher for ``hmi.services.jobs.JobManager``: the manager keeps
doing everything else (the job record, its kept inputs, progress, time limit, cancellation,
publishing, the take-over of a dead replica's jobs).  Per job:

- the worker (``hmi.services.workers``) runs in a Ray task that reserves ``cpus`` CPUs
  (``max_retries=0``: a job is run again by the manager's take-over, from its kept inputs, never
  by Ray behind its back);
- the root's weights reach the task through Ray's object store (put once per replica), so a task
  on another node gets them without loading anything; the PLOT and the adapter store are read at
  the same paths on the task's node (every node has its copy of ``HMI_HOME``'s root and PLOT);
- progress and the cancel flag go through one small actor per replica (``JobChannel``, no CPUs);
- a task dies with its owner: Ray kills the workers of a task whose owner (the replica) died,
  as ``hmi.lifetime.die_with`` does for a process.
"""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from typing import Callable

CANCEL_POLL_S = 0.5  # how stale a worker's view of its cancel flag may be


class JobChannel:
    """Progress queues and cancel flags of one replica's jobs, by key (a Ray actor)."""

    def __init__(self):
        self._queues: dict[str, asyncio.Queue] = {}
        self._set: set[str] = set()

    def _queue(self, key: str) -> asyncio.Queue:
        return self._queues.setdefault(key, asyncio.Queue())

    async def put(self, key: str, item) -> None:
        self._queue(key).put_nowait(item)

    async def get(self, key: str, timeout: float) -> tuple[bool, object]:
        try:
            return True, await asyncio.wait_for(self._queue(key).get(), timeout)
        except asyncio.TimeoutError:
            return False, None

    async def set(self, key: str) -> None:
        self._set.add(key)

    async def is_set(self, key: str) -> bool:
        return key in self._set

    async def forget(self, keys: list[str]) -> None:
        for key in keys:
            self._queues.pop(key, None)
            self._set.discard(key)


class RayQueue:
    """A job's progress queue (``put``, ``get(timeout=)`` raising ``queue.Empty``), on the channel."""

    def __init__(self, channel, key: str | None = None):
        self.channel, self.key = channel, key or uuid.uuid4().hex

    def put(self, item) -> None:
        import ray

        ray.get(self.channel.put.remote(self.key, item))

    def get(self, timeout: float = 0.5):
        import ray

        ok, item = ray.get(self.channel.get.remote(self.key, timeout))
        if not ok:
            raise queue.Empty
        return item


class RayEvent:
    """A job's cancel flag (``set``, ``is_set``), on the channel; the worker reads it at most every
    ``CANCEL_POLL_S`` seconds (it is asked at every training step)."""

    def __init__(self, channel, key: str | None = None):
        self.channel, self.key = channel, key or uuid.uuid4().hex
        self._seen, self._checked = False, 0.0

    def set(self) -> None:
        import ray

        self._seen = True
        ray.get(self.channel.set.remote(self.key))

    def is_set(self) -> bool:
        import ray

        if not self._seen and time.monotonic() - self._checked >= CANCEL_POLL_S:
            self._seen = ray.get(self.channel.is_set.remote(self.key))
            self._checked = time.monotonic()
        return self._seen

    def __getstate__(self):
        return {"channel": self.channel, "key": self.key}

    def __setstate__(self, state):
        self.__init__(state["channel"], state["key"])


def run_worker(target: Callable, ctx, job: dict, progress, cancel) -> None:
    """The body of a job's Ray task: the worker function, as a spawned process would run it."""
    target(ctx, job, progress, cancel)


class RayTask:
    """A running job's Ray task, with the handle a ``JobManager`` expects of a worker process."""

    pid = None  # a Ray worker process on whichever node; the task id names it instead

    def __init__(self, ref, channel, keys: list[str]):
        self.ref, self.channel, self.keys = ref, channel, keys
        self.task_id = ref.task_id().hex()
        self._error: str | None = None

    def is_alive(self) -> bool:
        import ray

        return not ray.wait([self.ref], timeout=0)[0]

    def death(self) -> str:
        """Why the task ended without a result ('' if it returned)."""
        import ray

        if self._error is None:
            try:
                ray.get(self.ref, timeout=0)
                self._error = ""
            except Exception as exc:  # noqa: BLE001 - the task's failure, reported as the job's error
                self._error = f"the job's Ray task {self.task_id} ended without a result: {type(exc).__name__}: {exc}"[:2000]
        return self._error

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)
        if not self.is_alive():
            self.channel.forget.remote(self.keys)

    def terminate(self) -> None:
        import ray

        ray.cancel(self.ref)

    def kill(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)


class RayLauncher:
    """Starts a job's worker as a Ray task reserving ``cpus`` CPUs (see the module's docstring);
    call it from a process connected to Ray (a replica)."""

    where = "ray task"

    def __init__(self, cpus: float = 1.0):
        self.cpus = cpus
        self._task = None  # run_worker as a Ray remote function, made once
        self._channel = None
        self._ctx_ref = None
        self._ctx_of: tuple[int, int] | None = None

    @property
    def channel(self):
        if self._channel is None:
            import ray

            self._channel = ray.remote(num_cpus=0)(JobChannel).remote()
        return self._channel

    def event(self) -> RayEvent:
        return RayEvent(self.channel)

    def queue(self) -> RayQueue:
        return RayQueue(self.channel)

    def _ctx(self, ctx):
        """The worker context in the object store, put again only when it changed (the server
        sets the decoder's view once it serves decoder tenants)."""
        import ray

        if self._ctx_of != (id(ctx), id(ctx.gpt)):
            self._ctx_ref, self._ctx_of = ray.put(ctx), (id(ctx), id(ctx.gpt))
        return self._ctx_ref

    def start(self, target: Callable, ctx, job: dict, progress: RayQueue, cancel: RayEvent) -> RayTask:
        import ray

        if self._task is None:
            self._task = ray.remote(run_worker)
        threads = max(1, int(self.cpus))
        task = self._task.options(num_cpus=self.cpus, max_retries=0, name=f"hmi-job-{job['id']}")
        ref = task.remote(target, self._ctx(ctx), {**job, "threads": threads}, progress, cancel)
        return RayTask(ref, self.channel, [progress.key, cancel.key])
