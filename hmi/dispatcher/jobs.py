"""Background jobs (tenant fine-tuning) in worker processes.

Workers are spawned with ``torch.multiprocessing``; the root's weights are moved to shared
memory once, so a worker maps the server's copy instead of loading its own.  A job reports
progress through a queue, can be cancelled, has a time limit, and writes its result as an
unpublished adapter version named by its job id; the server publishes it only while the tenant
still belongs to that job.  Workers die with the server (``PR_SET_PDEATHSIG``): after a
``kill -9`` of the server no worker goes on writing.  The queue of waiting jobs is bounded.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp

from hmi.dispatcher.registry import Registry

log = logging.getLogger("hmi.jobs")
PR_SET_PDEATHSIG = 1


class JobQueueFullError(RuntimeError):
    """Too many jobs are waiting; the caller should retry later."""


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def rss_kib() -> dict[str, int]:
    """This process's resident memory split into anonymous (private) and shared pages, KiB."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


@dataclass
class WorkerContext:
    """What every worker receives: shared-memory modules and where things live."""

    bert: object  # BertModel, parameters in shared memory
    windowed: object  # WindowedEncoder, in shared memory
    tokenizer_dir: str
    l_low: int
    plot_path: str
    plot_meta: object  # PlotMeta
    tenants_dir: str
    miss_policy: str
    artifact_id: str = ""
    home: str = ""
    gpt: object = None  # hmi.scheduler.decoder_runtime.WorkerDecoder when the server serves decoder tenants


def _root(ctx: WorkerContext):
    from hmi.model.artifact import Root
    from hmi.model.root import RootSpec, load_tokenizer

    spec = RootSpec(ctx.tokenizer_dir, ctx.l_low)
    return Root(spec, ctx.bert, load_tokenizer(ctx.tokenizer_dir), ctx.windowed, ctx.artifact_id, {})


def _tree(ctx: WorkerContext):
    from hmi.plot.lookup import PlotVersion
    from hmi.plot.store import PlotStore
    from hmi.version_tree.tree import VersionTree

    root_version = PlotVersion("root", PlotStore(ctx.plot_path, readonly=True, expect=ctx.plot_meta), ctx.windowed)
    return VersionTree(_root(ctx), Path(ctx.home), root_version=root_version)


def _lookup(ctx: WorkerContext, domain: str):
    return _tree(ctx).lookup(domain, ctx.miss_policy)


def domain_worker(ctx: WorkerContext, job: dict, progress, cancel) -> None:
    """Runs in a worker process: creates or updates a domain branch."""
    import torch

    _worker_setup(job)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        from hmi.version_tree.fpt import FPTConfig

        data = job["data"]
        lines = data["lines"]
        if data.get("corpus_name"):
            from hmi.data import load_corpus

            lines = load_corpus(data["corpus_name"], data.get("max_lines"))
        tree = _tree(ctx)
        fpt = FPTConfig(steps=job.get("steps", 150))
        progress.put(("progress", 0.05, {"stage": "further pretraining"}))
        if job["kind"] == "domain-create":
            node = tree.create(job["domain"], job["parent"], lines, job["alpha"], fpt, progress=False,
                               should_stop=cancel.is_set)
        else:
            node = tree.update(job["domain"], lines, fpt, progress=False, should_stop=cancel.is_set)
        from dataclasses import asdict

        progress.put(("done", 1.0, {**asdict(node), "worker_memory_kib": rss_kib()}))
    except Exception as exc:  # noqa: BLE001 - reported to the server as the job's error
        if cancel.is_set():
            progress.put(("cancelled", 0.0, {}))
        else:
            progress.put(("failed", 0.0, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}))


def die_with_parent(parent_pid: int) -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (Linux), and exits now if the
    parent is already gone (it died between spawning us and this call)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the server still terminates its workers on shutdown
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_setup(job: dict) -> None:
    from hmi.allocator import tune_allocator

    die_with_parent(job["server_pid"])
    logging.getLogger("adapters").setLevel(logging.ERROR)
    tune_allocator()


def finetune_worker(ctx: WorkerContext, job: dict, progress, cancel) -> None:
    """Runs in a worker process: fine-tunes one tenant and stores its adapter (unpublished)."""
    import torch

    _worker_setup(job)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        from hmi.adapters.spec import AdapterSpec
        from hmi.adapters.store import AdapterStore
        from hmi.adapters.train import FinetuneConfig, JobCancelled, finetune
        from hmi.model.root import load_tokenizer

        spec = AdapterSpec.from_dict(job["spec"])
        lookup = _lookup(ctx, job.get("domain", "root"))
        data = job["data"]
        if data.get("dataset"):
            from hmi.data import load_task

            train = load_task(data["dataset"], "train", data.get("max_train"))
            dev = load_task(data["dataset"], "dev", data.get("max_eval", 500))
            test = load_task(data["dataset"], "test", data.get("max_eval", 500))
        else:
            train, dev, test = data["train"], data.get("dev") or [], data.get("test") or []
        adapters = AdapterStore(ctx.tenants_dir)
        init = adapters.load(job["tenant"]) if job["kind"] == "update" else None
        cfg = FinetuneConfig(epochs=job.get("epochs", 4), seed=job.get("seed", 0))
        weights, metrics = finetune(
            ctx.bert, ctx.l_low, lookup, load_tokenizer(ctx.tokenizer_dir), spec, train, dev, test, cfg, init=init,
            progress=False, on_progress=lambda f, info: progress.put(("progress", f, info)),
            should_stop=cancel.is_set, private_copy=False)
        metrics["worker_memory_kib"] = rss_kib()
        adapters.save(job["tenant"], spec, weights, {"domain": job.get("domain", "root"), "metrics": metrics},
                      version=job["id"], publish=False)
        progress.put(("done", 1.0, metrics))
    except JobCancelled:
        progress.put(("cancelled", 0.0, {}))
    except Exception as exc:  # noqa: BLE001 - reported to the server as the job's error
        progress.put(("failed", 0.0, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}))


def decoder_worker(ctx: WorkerContext, job: dict, progress, cancel) -> None:
    """Runs in a worker process: fine-tunes one decoder tenant's LoRA and stores it (unpublished)."""
    import torch

    _worker_setup(job)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        from hmi.adapters.spec import AdapterSpec
        from hmi.adapters.store import AdapterStore
        from hmi.adapters.train_lm import LmFinetuneConfig, finetune_lm

        if ctx.gpt is None:
            raise RuntimeError("the server does not serve decoder tenants")
        spec = AdapterSpec.from_dict(job["spec"])
        data = job["data"]
        texts = data.get("texts")
        if data.get("corpus"):
            from hmi.data import load_corpus

            texts = load_corpus(data["corpus"], (data.get("max_train") or 400) + 32)
        n_dev = max(1, min(32, len(texts) // 10))
        dev, train = texts[:n_dev], texts[n_dev:] or texts
        adapters = AdapterStore(ctx.tenants_dir)
        init = {k: v.float() for k, v in adapters.load(job["tenant"]).items()} if job["kind"] == "update" else None
        weights, metrics = finetune_lm(
            ctx.gpt.root(), ctx.gpt.lookup(), spec, train, dev, LmFinetuneConfig(epochs=job.get("epochs", 1)), init=init,
            progress=False, on_progress=lambda f, info: progress.put(("progress", f, info)), should_stop=cancel.is_set)
        metrics["worker_memory_kib"] = rss_kib()
        adapters.save(job["tenant"], spec, weights, {"model": "decoder", "metrics": metrics},
                      version=job["id"], publish=False)
        progress.put(("done", 1.0, metrics))
    except Exception as exc:  # noqa: BLE001 - reported to the server as the job's error
        if cancel.is_set():
            progress.put(("cancelled", 0.0, {}))
        else:
            progress.put(("failed", 0.0, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}))


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
               "info": {}, **extra}
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
