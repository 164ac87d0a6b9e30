"""Background jobs (tenant fine-tuning, domains) in workers (hmi.services.workers).

Where a worker runs is its launcher's business: by default (``ProcessLauncher``) a process
forked from the server's fork server (``torch.multiprocessing``), which maps the server's root
weights from shared memory instead of loading its own; under Ray Serve, a Ray task with its own
resources (``hmi.scaleout.ray_jobs``).  A job reports
progress through a queue, can be cancelled, has a time limit, and writes its result as an
unpublished adapter version named by its job id; the server publishes it only while the tenant
still belongs to that job.  Workers die with the server (``hmi.lifetime.die_with``): after a
``kill -9`` of the server no worker goes on writing.  The queue of waiting jobs is bounded.

Nothing accepted is lost: a tenant job's inputs are written (atomically) to ``inputs/<job>.json``
before the job is accepted, so a job whose server stopped (crash, kill, a replica replaced) is
run again from its start by the next server on the home, up to ``max_attempts`` times in all.
A job stopped by a shutdown (Ctrl+C, a replica scaled down) is marked ``stopped_by_shutdown``
and runs again without using up an attempt: attempts count the stops that may have been caused
by the job itself (a crash, a kill), so stopping the server while a tenant trains never fails it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp

from hmi.errors import Kind, Refusal
from hmi.io import atomic_write_json
from hmi.services.registry import UNFINISHED, Registry, process_owner
from hmi.services.workers import WorkerContext, decoder_worker, domain_worker, finetune_worker, start_worker
from hmi.version_tree.tree import forget_checkpoint

log = logging.getLogger("hmi.jobs")

# Jobs run again after a stop (from their kept inputs): tenant jobs from their start, domain jobs
# from their distillation's last checkpoint (``JobFiles.checkpoint``).
RESUMABLE = ("create", "update", "domain-create", "domain-update")
FINAL = ("succeeded", "failed", "cancelled")
CANCEL_CHECK_S = 0.5  # how often a running job's owner looks for a cancel request recorded by another process


class ProcessLauncher:
    """Runs a job's worker as a process of this server's.  A launcher makes the cancel flag
    (``event()``: ``set``/``is_set``), the progress queue (``queue()``: ``put``/``get(timeout=)``,
    raising ``queue.Empty``) and starts ``target(ctx, job, progress, cancel)``, returning a handle
    with ``pid``, ``is_alive()``, ``join(timeout)``, ``terminate()``, ``kill()`` and, to say why it
    ended without a result, ``exitcode`` (a process) or ``death()``.

    Workers are forked from a fork server (``multiprocessing``'s ``forkserver``) that has imported
    what a worker runs (``hmi.services.workers``: torch, transformers) once, when the first job
    started, instead of a new interpreter importing them for each job: a short fine-tune job
    after the first takes about a third of the time (``benchmarks/bench_job_start.py``).  The
    fork server is a child of this process that exits once this process and the workers have; a
    worker dies with this process (``hmi.lifetime.die_with``).  A worker takes this process's
    environment as it is when the job starts (``environ``), not as it was when the fork server
    started."""

    where = "process"
    PRELOAD = ["__main__", "hmi.services.workers"]

    def __init__(self, start_method: str = "forkserver"):
        """``start_method``: ``forkserver``, or ``spawn`` (a new interpreter per job, which imports
        everything itself: the reference ``bench_job_start`` and the tests compare it with)."""
        self.mp = mp.get_context(start_method)
        if start_method == "forkserver":
            self.mp.set_forkserver_preload(self.PRELOAD)

    def event(self):
        return self.mp.Event()

    def queue(self):
        return self.mp.Queue()

    def start(self, target: Callable, ctx: WorkerContext, job: dict, progress, cancel):
        inbox, outbox = self.mp.Pipe(duplex=False)
        job = {**job, "server_pid": os.getpid(), "environ": dict(os.environ)}
        proc = self.mp.Process(target=start_worker, args=(target, inbox, job, progress, cancel), daemon=True)
        proc.start()
        inbox.close()
        try:
            outbox.send(ctx)  # after the start (``start_worker``); a worker already dead breaks the pipe
        except (BrokenPipeError, ConnectionResetError):
            pass  # its death is what the job's owner reports
        finally:
            outbox.close()
        return proc


def death(proc) -> str:
    """Why a worker ended without a result."""
    why = getattr(proc, "death", None)
    return why() if why is not None else f"the worker process died (exit code {proc.exitcode})"


class JobQueueFullError(RuntimeError):
    """Too many jobs are waiting; the caller should retry later."""


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


# What a job of each class holds at its peak before one has run here (worker VmHWM, MB, measured on
# 2 cores: docs/design.md); afterwards the largest peak of the last jobs of its class is used.
JOB_PEAK_MB = {"encoder": 2500.0, "decoder": 4500.0, "domain": 9000.0}
PEAK_HISTORY = 5


def job_class(job: dict) -> str:
    """``domain``, ``decoder`` (a decoder tenant's fine-tune) or ``encoder`` (an encoder tenant's)."""
    return "domain" if job["kind"].startswith("domain") else "decoder" if job.get("model") == "decoder" else "encoder"


class MemoryBudget:
    """Admits jobs against a memory budget (MB; 0: none): a job starts when the peaks expected of
    the running jobs and its own fit, or when nothing else runs; until then it waits, with the
    reason in its record (``waiting``).  A class's expected peak is the largest worker peak of
    its last ``PEAK_HISTORY`` finished jobs here, else ``JOB_PEAK_MB``."""

    def __init__(self, registry: Registry, budget_mb: float):
        self.registry, self.budget_mb = registry, float(budget_mb or 0.0)
        self._held: dict[str, float] = {}
        self._cv = threading.Condition()

    def expected_mb(self, job: dict) -> float:
        cls = job_class(job)
        done = sorted((j for _, j in self.registry.items("jobs")
                       if j.get("state") == "succeeded" and job_class(j) == cls
                       and ((j.get("metrics") or {}).get("worker_memory_kib") or {}).get("VmHWM")),
                      key=lambda j: j.get("finished") or 0)[-PEAK_HISTORY:]
        if not done:
            return JOB_PEAK_MB[cls]
        return max(j["metrics"]["worker_memory_kib"]["VmHWM"] for j in done) / 1024

    def reserve(self, job: dict, stop: Callable[[], bool]) -> bool:
        """Waits until ``job`` fits (returns True, its expected peak held) or ``stop()`` (False)."""
        if self.budget_mb <= 0:
            return True
        need = self.expected_mb(job)
        said = False
        with self._cv:
            while self._held and sum(self._held.values()) + need > self.budget_mb:
                if stop():
                    return False
                if not said:
                    said = True
                    self.registry.update("jobs", job["id"], waiting=(
                        f"memory: this {job_class(job)} job is expected to take about {need:.0f} MB at its peak, and "
                        f"{sum(self._held.values()):.0f} of the {self.budget_mb:.0f} MB jobs may take are held by "
                        f"{len(self._held)} running job(s); it starts when they finish"))
                self._cv.wait(0.5)
            self._held[job["id"]] = need
        if said:
            self.registry.update("jobs", job["id"], waiting=None)
        return True

    def release(self, job_id: str) -> None:
        with self._cv:
            if self._held.pop(job_id, None) is not None:
                self._cv.notify_all()


class JobFiles:
    """What is kept of each resumable job in ``folder`` until it ends (None: nothing is kept): its
    inputs (``<id>.json``, written before the job is accepted), a domain job's distillation
    checkpoint (``<id>.ckpt``) and a killed writer's temporary files."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def input(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.json"

    def checkpoint(self, job_id: str) -> Path | None:
        """Where a domain job's worker keeps its distillation checkpoint (beside the job's kept
        inputs; removed when the job ends); None where inputs are not kept."""
        return None if self.folder is None else self.folder / f"{job_id}.ckpt"

    @staticmethod
    def job_of(path: Path) -> str:
        """The job a kept file belongs to: ``<id>.json``, ``<id>.ckpt``, ``<id>.ckpt.plot/`` and a
        killed writer's ``.<id>.<name>.<random>.tmp`` (job ids are hex, without a dot)."""
        return path.name.lstrip(".").split(".", 1)[0]

    def forget(self, job_id: str) -> None:
        """Every file kept for a job that ended (``job_of`` lists them)."""
        if self.folder is not None:
            for f in (self.input(job_id), *self.folder.glob(f".{job_id}.*.tmp")):
                f.unlink(missing_ok=True)
            forget_checkpoint(self.checkpoint(job_id))

    def forget_ended(self, ended: Callable[[str], bool]) -> None:
        """The files of every job ``ended`` says has ended (a start-up's recovery)."""
        if self.folder is not None:
            for f in [*self.folder.glob("*.json"), *self.folder.glob("*.ckpt*"), *self.folder.glob(".*.tmp")]:
                if ended(jid := self.job_of(f)):
                    self.forget(jid)


class JobManager:
    """Runs jobs one (or ``concurrency``) at a time in workers started by ``launcher`` (default:
    spawned processes, ``ProcessLauncher``).

    Contract: ``submit`` raises JobQueueFullError past ``max_queued`` waiting jobs; every job ends
    in a final state (succeeded, failed, cancelled) reported once to ``on_finish``, whatever
    happens to its worker or to ``on_finish`` itself; a job running past ``time_limit_s`` is
    stopped and failed.  With ``inputs`` (a folder), tenant jobs are kept there until they end and
    :meth:`recover` queues again those a stopped server left unfinished."""

    def __init__(self, registry: Registry, ctx: WorkerContext, on_finish: Callable[[dict, str, dict], None],
                 concurrency: int = 1, max_queued: int = 64, time_limit_s: float = 6 * 3600,
                 inputs: Path | None = None, max_attempts: int = 3, launcher=None, memory_mb: float = 0.0):
        self.registry = registry
        self.memory = MemoryBudget(registry, memory_mb)
        self.files = JobFiles(inputs)
        self.max_attempts = max_attempts
        self.ctx = ctx
        self.on_finish = on_finish
        self.max_queued = max_queued
        self.time_limit_s = time_limit_s
        self.launcher = launcher or ProcessLauncher()
        self._queue: queue.Queue = queue.Queue()
        self._cancel: dict[str, object] = {}
        self._procs: dict[str, object] = {}
        self._cancelled_at: dict[str, float] = {}
        self._closed = False
        self.stopped = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"jobs-{i}", daemon=True) for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def full(self) -> bool:
        return self._queue.qsize() >= self.max_queued

    def require_room(self) -> None:
        """Refuses (``BUSY``, retry after 30 s) when ``max_queued`` jobs are waiting already."""
        if self.full():
            raise Refusal(Kind.BUSY, "too_many_jobs", f"{self.max_queued} jobs are waiting; retry later", retry_after_s=30)

    def submit(self, kind: str, tenant: str | None, spec: dict | None, data: dict, job_id: str | None = None,
               **extra) -> str:
        if self.full():
            raise JobQueueFullError(f"{self._queue.qsize()} jobs are waiting; the limit is {self.max_queued}")
        job_id = job_id or new_job_id()
        job = {"id": job_id, "kind": kind, "tenant": tenant, "spec": spec, "state": "queued", "progress": 0.0,
               "info": {}, "owner": process_owner(), "attempt": 1, **extra}
        if self.files.folder is not None and kind in RESUMABLE:
            atomic_write_json(self.files.input(job_id), data)  # before the job exists: accepted means kept
            job["inputs_kept"] = True
        try:
            self.registry.create("jobs", job_id, {k: v for k, v in job.items()})
        except BaseException:  # not accepted: its inputs are not kept either
            if job.get("inputs_kept"):
                self.files.input(job_id).unlink(missing_ok=True)
            raise
        self._enqueue(job, data)
        return job_id

    def _enqueue(self, job: dict, data: dict) -> None:
        self._cancel[job["id"]] = self.launcher.event()
        self._queue.put((job, data))

    def _resumable(self, job: dict, attempt_used: bool = True) -> bool:
        """Whether a stopped job can run again from its kept inputs; ``attempt_used``: whether its
        stop counts as one of its ``max_attempts`` (not when a shutdown stopped it)."""
        used = attempt_used and not job.get("stopped_by_shutdown")
        return (self.files.folder is not None and job.get("inputs_kept", False) and job["kind"] in RESUMABLE
                and not job.get("cancel_requested")
                and (not used or job.get("attempt", 1) < self.max_attempts) and self.files.input(job["id"]).is_file())

    def _left_for_next_start(self, job: dict) -> None:
        """Records that this server's shutdown, not the job, stopped ``job``: the next start's
        recovery runs it again without counting an attempt."""
        try:
            self.registry.update("jobs", job["id"], stopped_by_shutdown=True)
        except Exception:  # noqa: BLE001 - unrecorded, the stop counts as an attempt, as a crash would
            log.exception("job %s: recording that the shutdown stopped it failed", job["id"])
        finally:
            self._cancel.pop(job["id"], None)

    def recover(self, alive: Callable[[dict], bool] | None = None) -> tuple[list[str], list[str]]:
        """Start-up recovery of the registry's unfinished jobs whose process is gone (all of them, or
        those ``alive`` denies): a tenant job whose inputs were kept and that has tries left is
        claimed and queued again (its tenant stays ``training`` / ``updating``); any other is failed
        (Registry.recover).  Inputs of jobs that already ended are removed.  Returns (failed, resumed)."""
        failed, claimed = self.registry.recover(alive, resume=self._resumable)
        resumed = []
        for job in claimed:
            jid = job["id"]
            try:
                data = json.loads(self.files.input(jid).read_text())
            except (OSError, ValueError) as exc:
                self._finish(job, "failed", {"error": f"the job's kept inputs could not be read: {exc}"})
                failed.append(jid)
                continue
            log.warning("job %s (%s of tenant %s): run again from its start, attempt %d of %d",
                        jid, job["kind"], job.get("tenant"), job["attempt"], self.max_attempts)
            self._enqueue(job, data)
            resumed.append(jid)
        if failed or resumed:
            log.warning("jobs of stopped servers: %d failed, %d run again", len(failed), len(resumed))
        self.files.forget_ended(lambda jid: (self.registry.get("jobs", jid) or {"state": "failed"})["state"] in FINAL)
        return failed, resumed

    def cancel(self, job_id: str) -> bool:
        """Stops a queued or running job, whichever process on the home runs it: the request is
        recorded with the job (its owner's watch sees it within ``CANCEL_CHECK_S``) and, when this
        process runs it, its worker is told at once."""
        ev = self._cancel.get(job_id)
        job = self.registry.get("jobs", job_id)
        if job is None or job["state"] not in UNFINISHED:
            return False
        self.registry.update("jobs", job_id, cancel_requested=True)
        if ev is not None:
            ev.set()
            self._cancelled_at[job_id] = time.time()
        if job["state"] == "queued":
            self.registry.update_if("jobs", job_id, ("queued",), state="cancelled")
        return True

    def _run(self) -> None:
        """One job thread: takes jobs until shutdown; no error in one job stops it."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, data = item
            if self._closed:  # left queued: the next start's recovery runs it again or marks it failed
                if self._resumable(job, attempt_used=False):
                    self._left_for_next_start(job)
                continue
            try:
                if not self.memory.reserve(job, lambda: self._closed or self._cancel[job["id"]].is_set()):
                    state, info = "cancelled", {}  # while it waited: by its owner, or by the shutdown
                else:
                    try:
                        state, info = self._run_one(job, data)
                    finally:
                        self.memory.release(job["id"])
            except Exception as exc:  # noqa: BLE001 - supervised: the job fails, the thread goes on
                log.exception("job %s: the job thread failed", job["id"])
                state, info = "failed", {"error": f"internal error running the job: {type(exc).__name__}: {exc}"}
            if (self._closed and state == "cancelled" and job["id"] not in self._cancelled_at
                    and self._resumable(job, attempt_used=False)):
                # Stopped by the server's shutdown, not by its owner: left running, the next start runs it again.
                self._left_for_next_start(job)
                continue
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
        progress = self.launcher.queue()
        target = (domain_worker if job["kind"].startswith("domain") else
                  decoder_worker if job.get("model") == "decoder" else finetune_worker)
        work = {**job, "data": data}
        if job["kind"].startswith("domain") and self.files.folder is not None:
            work["checkpoint"] = str(self.files.checkpoint(jid))
        proc = self.launcher.start(target, self.ctx, work, progress, cancel)
        self._procs[jid] = proc
        self.registry.update("jobs", jid, state="running", started=started, worker_pid=proc.pid,
                             worker=self.launcher.where)
        try:
            return self._watch(jid, proc, progress, cancel, started)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            self._procs.pop(jid, None)

    def _watch(self, jid: str, proc, progress, cancel, started: float) -> tuple[str, dict]:
        """Relays a worker's progress until its result, its death, or its time limit; tells the
        worker to stop when another process recorded a cancel request with the job."""
        checked = time.time()
        while True:
            if not cancel.is_set() and time.time() - checked >= CANCEL_CHECK_S:
                checked = time.time()
                if (self.registry.get("jobs", jid) or {}).get("cancel_requested"):
                    self._cancelled_at.setdefault(jid, checked)
                    cancel.set()
            try:
                kind, frac, payload = progress.get(timeout=0.5)
            except queue.Empty:
                if not proc.is_alive():
                    if cancel.is_set():
                        return "cancelled", {}
                    return "failed", {"error": death(proc)}
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
        try:  # the tenant first: whoever sees the job succeeded finds its tenant served
            self.on_finish(job, state, info)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be published fails its job
            log.exception("job %s: publishing its result failed", job["id"])
            state, info = "failed", {"error": f"publishing its result failed: {type(exc).__name__}: {exc}"}
            self.on_finish(job, state, info)
        finally:
            extra = {"metrics": info} if state == "succeeded" else ({"error": info.get("error")} if info else {})
            self.registry.update("jobs", job["id"], state=state, progress=1.0 if state == "succeeded" else None,
                                 finished=time.time(), **extra)
            self.files.forget(job["id"])

    def take_over_orphans(self, alive: Callable[[dict], bool]) -> tuple[list[str], list[str]]:
        """:meth:`recover` while this process runs: its own jobs are alive, whatever ``alive`` says
        of its pid (at start-up, a record naming this pid is of an earlier process)."""
        me = process_owner()
        return self.recover(lambda job: job.get("owner") == me or alive(job))

    def running(self) -> int:
        return len(self._procs)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancels running jobs, starts no queued one, and returns once every job thread has
        recorded its job's end (so the registry may be closed after this)."""
        self._closed = True
        self.stopped.set()
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


def watch_orphans(jobs: JobManager, alive: Callable[[dict], bool], every_s: float,
                  renew: Callable[[], None] | None = None, renew_every_s: float | None = None) -> None:
    """On a home shared by several serving processes: every ``every_s`` seconds, ``jobs`` takes
    over the unfinished jobs of processes that are gone (``JobManager.take_over_orphans``), so a
    replica's jobs are not left waiting for a restart that may never come; every
    ``renew_every_s`` seconds (default ``every_s``) this process's lease is renewed (``renew``).
    The watch ends when ``jobs`` shuts down."""
    tick = min(every_s, renew_every_s or every_s)

    def loop() -> None:
        checked = renewed = time.monotonic()
        while not jobs.stopped.wait(tick):
            try:
                if renew is not None and time.monotonic() - renewed >= tick * 0.99:
                    renewed = time.monotonic()
                    renew()
                if time.monotonic() - checked >= every_s * 0.99:
                    checked = time.monotonic()
                    jobs.take_over_orphans(alive)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("taking over the jobs of stopped servers failed")

    threading.Thread(target=loop, name="jobs-orphans", daemon=True).start()
