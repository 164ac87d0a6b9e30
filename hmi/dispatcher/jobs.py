"""Background jobs (tenant fine-tuning, domains) in worker processes (hmi.dispatcher.workers).

Workers are spawned with ``torch.multiprocessing``; the root's weights are moved to shared
memory once, so a worker maps the server's copy instead of loading its own.  A job reports
progress through a queue, can be cancelled, has a time limit, and writes its result as an
unpublished adapter version named by its job id; the server publishes it only while the tenant
still belongs to that job.  Workers die with the server (``PR_SET_PDEATHSIG``): after a
``kill -9`` of the server no worker goes on writing.  The queue of waiting jobs is bounded.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from typing import Callable

import torch.multiprocessing as mp

from hmi.dispatcher.registry import Registry, process_owner
from hmi.dispatcher.workers import WorkerContext, decoder_worker, domain_worker, finetune_worker

log = logging.getLogger("hmi.jobs")


class JobQueueFullError(RuntimeError):
    """Too many jobs are waiting; the caller should retry later."""


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


class JobManager:
    """Runs jobs one (or ``concurrency``) at a time in spawned worker processes.

    Contract: ``submit`` raises JobQueueFullError past ``max_queued`` waiting jobs; every job ends
    in a final state (succeeded, failed, cancelled) reported once to ``on_finish``, whatever
    happens to its worker or to ``on_finish`` itself; a job running past ``time_limit_s`` is
    stopped and failed."""

    def __init__(self, registry: Registry, ctx: WorkerContext, on_finish: Callable[[dict, str, dict], None],
                 concurrency: int = 1, max_queued: int = 64, time_limit_s: float = 6 * 3600):
        self.registry = registry
        self.ctx = ctx
        self.on_finish = on_finish
        self.max_queued = max_queued
        self.time_limit_s = time_limit_s
        self.mp = mp.get_context("spawn")
        self._queue: queue.Queue = queue.Queue()
        self._cancel: dict[str, object] = {}
        self._procs: dict[str, object] = {}
        self._cancelled_at: dict[str, float] = {}
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"jobs-{i}", daemon=True) for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def full(self) -> bool:
        return self._queue.qsize() >= self.max_queued

    def submit(self, kind: str, tenant: str | None, spec: dict | None, data: dict, job_id: str | None = None,
               **extra) -> str:
        if self.full():
            raise JobQueueFullError(f"{self._queue.qsize()} jobs are waiting; the limit is {self.max_queued}")
        job_id = job_id or new_job_id()
        job = {"id": job_id, "kind": kind, "tenant": tenant, "spec": spec, "state": "queued", "progress": 0.0,
               "info": {}, "owner": process_owner(), **extra}
        self.registry.create("jobs", job_id, {k: v for k, v in job.items()})
        self._cancel[job_id] = self.mp.Event()
        self._queue.put((job, data))
        return job_id

    def cancel(self, job_id: str) -> bool:
        ev = self._cancel.get(job_id)
        job = self.registry.get("jobs", job_id)
        if job is None or job["state"] not in ("queued", "running"):
            return False
        if ev is not None:
            ev.set()
            self._cancelled_at[job_id] = time.time()
        if job["state"] == "queued":
            self.registry.update("jobs", job_id, state="cancelled")
        return True

    def _run(self) -> None:
        """One job thread: takes jobs until shutdown; no error in one job stops it."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, data = item
            if self._closed:  # left queued: the next start's recovery marks it failed
                continue
            try:
                state, info = self._run_one(job, data)
            except Exception as exc:  # noqa: BLE001 - supervised: the job fails, the thread goes on
                log.exception("job %s: the job thread failed", job["id"])
                state, info = "failed", {"error": f"internal error running the job: {type(exc).__name__}: {exc}"}
            try:
                self._finish(job, state, info)
            except Exception:  # noqa: BLE001
                log.exception("job %s: recording its end failed", job["id"])
            finally:
                self._cancel.pop(job["id"], None)
                self._cancelled_at.pop(job["id"], None)

    def _run_one(self, job: dict, data: dict) -> tuple[str, dict]:
        jid = job["id"]
        cancel = self._cancel[jid]
        if cancel.is_set() or (self.registry.get("jobs", jid) or {}).get("state") == "cancelled":
            return "cancelled", {}
        started = time.time()
        progress = self.mp.Queue()
        target = (domain_worker if job["kind"].startswith("domain") else
                  decoder_worker if job.get("model") == "decoder" else finetune_worker)
        proc = self.mp.Process(target=target, args=(self.ctx, {**job, "data": data, "server_pid": os.getpid()},
                                                    progress, cancel), daemon=True)
        proc.start()
        self._procs[jid] = proc
        self.registry.update("jobs", jid, state="running", started=started, worker_pid=proc.pid)
        try:
            return self._watch(jid, proc, progress, cancel, started)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            self._procs.pop(jid, None)

    def _watch(self, jid: str, proc, progress, cancel, started: float) -> tuple[str, dict]:
        """Relays a worker's progress until its result, its death, or its time limit."""
        while True:
            try:
                kind, frac, payload = progress.get(timeout=0.5)
            except queue.Empty:
                if not proc.is_alive():
                    if cancel.is_set():
                        return "cancelled", {}
                    return "failed", {"error": f"the worker process died (exit code {proc.exitcode})"}
                if time.time() - started > self.time_limit_s:
                    proc.kill()
                    return "failed", {"error": f"the job exceeded its time limit of {self.time_limit_s:g} s"}
                if cancel.is_set() and time.time() - self._cancelled_at.get(jid, time.time()) > 30:
                    proc.terminate()  # a worker that ignores cancellation is stopped
                continue
            if kind == "progress":
                self.registry.update("jobs", jid, progress=round(frac, 4), info=payload)
                continue
            return {"done": "succeeded"}.get(kind, kind), payload

    def _finish(self, job: dict, state: str, info: dict) -> None:
        if info.get("trace"):
            log.error("job %s failed: %s\n%s", job["id"], info.get("error"), info["trace"])
            info = {k: v for k, v in info.items() if k != "trace"}
        extra = {"metrics": info} if state == "succeeded" else ({"error": info.get("error")} if info else {})
        self.registry.update("jobs", job["id"], state=state, progress=1.0 if state == "succeeded" else None,
                             finished=time.time(), **extra)
        self.on_finish(job, state, info)

    def running(self) -> int:
        return len(self._procs)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancels running jobs, starts no queued one, and returns once every job thread has
        recorded its job's end (so the registry may be closed after this)."""
        self._closed = True
        for ev in list(self._cancel.values()):
            ev.set()
        for _ in self._threads:
            self._queue.put(None)
        for p in list(self._procs.values()):
            p.join(10)
            if p.is_alive():
                p.kill()
        for t in self._threads:
            t.join(timeout)
