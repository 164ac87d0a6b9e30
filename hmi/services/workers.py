"""What runs inside a job's worker process: encoder fine-tuning, decoder fine-tuning, and domain
creation or update.  Each worker maps the server's shared-memory root (``WorkerContext``), dies
with the server (``hmi.lifetime.die_with``), and reports through ``progress`` (a queue of
``(state, fraction, info)``): ``progress`` while it runs, then ``done``, ``cancelled`` or
``failed``.  What it writes (an adapter version, a domain folder) stays unpublished until the
server publishes it.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from hmi.adapters.spec import AdapterSpec
from hmi.adapters.store import AdapterStore
from hmi.allocator import release_heap, tune_allocator
from hmi.bootstrap import quiet_transformers
from hmi.data import hold_out, job_lines, job_rows, job_texts, job_unlabeled
from hmi.lifetime import die_with
from hmi.model.aliases import root_pooling
from hmi.model.artifact import Root
from hmi.model.root import RootSpec, load_tokenizer
from hmi.plot.kept import DEFAULT_BUDGET_MB, Keeper, keep_texts
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.pending import serving_store
from hmi.plot.store import PlotStore
from hmi.training.distil import Distillation
from hmi.training.examples import encode
from hmi.training.finetune import FinetuneConfig, dev_options, finetune
from hmi.training.finetune_lm import LmFinetuneConfig, finetune_lm
from hmi.training.fit import Cancelled
from hmi.training.full_context import train_teacher
from hmi.training.further_pretrain import FPTConfig
from hmi.training.objectives import DEFAULT_OBJECTIVE
from hmi.training.serving import choose_serving
from hmi.version_tree.tree import VersionTree

FPT_SHARE = 0.75  # of a domain job's progress bar: further pretraining; the branch's PLOT build follows
TEACHER_SHARE = 0.5  # of a distilled fine-tune's progress bar: the teacher (four settings); the served adapter (two) follows
# How often a worker returns its heap's free memory to the kernel (at a progress report). The tuned
# allocator keeps what a training step frees for the next one; over hundreds of steps of varying
# shapes that grew a distillation worker from 2.8 GB to 6.1 GB RSS in 95 steps (10,480 lines,
# MiniLM); trimming every 5 steps brought it back to 0.7-1.0 GB each time, its peak within a step
# 3.0-3.8 GB (docs/design.md).
TRIM_EVERY_S = 30.0


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
    gpt: object = None  # hmi.hgpt.runtime.WorkerDecoder when the server serves decoder tenants
    source: str | None = None  # RootSpec.source: the root's name (None: the default root)
    keep_mb: float = DEFAULT_BUDGET_MB  # compute+insert: the server's budget of kept misses per PLOT

    def root(self) -> Root:
        spec = RootSpec(self.tokenizer_dir, self.l_low, self.source)
        return Root(spec, self.bert, load_tokenizer(self.tokenizer_dir), self.windowed, self.artifact_id, {})

    def tree(self) -> VersionTree:
        keeps = self.miss_policy == "compute+insert"
        store = serving_store(PlotStore(self.plot_path, readonly=not keeps, expect=self.plot_meta), self.windowed)
        return VersionTree(self.root(), Path(self.home), root_version=PlotVersion("root", store, self.windowed),
                           writable=keeps)

    def lookup(self, domain: str) -> PlotLookup:
        """The domain's lookup with the server's miss policy.  With ``compute+insert``, what a job reads
        (the tenant's training texts) is kept in the domain's PLOT like a request's misses: the texts
        it will be asked about hit from its first request; the job calls ``keeper.close()`` before it
        reports done, so the windows are written by then."""
        keeper = Keeper(self.keep_mb) if self.miss_policy == "compute+insert" else None
        return self.tree().lookup(domain, self.miss_policy, keeper)


def rss_kib() -> dict[str, int]:
    """This process's resident memory split into anonymous (private) and shared pages, and its
    peak (``VmHWM``), KiB."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def start_worker(target: Callable, inbox, job: dict, progress, cancel) -> None:
    """The entry of a worker process of the server's (``hmi.services.jobs.ProcessLauncher``; a Ray
    task dies with its owner instead): the worker dies with the server (``job["server_pid"]``),
    takes the server's environment as it was when the job started (``job["environ"]``), then
    receives its ``WorkerContext`` through ``inbox`` (the reading end of a pipe) and runs
    ``target``.  The context does not go with the process's start: its shared-memory weights are
    a file descriptor per tensor (about 400 with the decoder), and a fork server hands a new
    process at most 253, where a pipe passes any number (``multiprocessing``'s resource sharer)."""
    die_with(job["server_pid"])
    os.environ.clear()
    os.environ.update(job["environ"])
    with inbox:
        ctx = inbox.recv()
    target(ctx, job, progress, cancel)


def _run(job: dict, progress, cancel, work: Callable[[Callable[[float, dict], None]], dict]) -> None:
    """The frame of every worker: set-up, then ``work(report)`` -> the job's result, reported as
    ``done`` (with the worker's memory), ``cancelled`` or ``failed`` (with the error)."""
    quiet_transformers()  # a job's long texts are cut to the model's limit on purpose: no tokenizer warning
    tune_allocator()
    torch.set_num_threads(job.get("threads") or max(1, (os.cpu_count() or 2) // 2))
    trimmed = [time.monotonic()]

    def report(fraction: float, info: dict) -> None:
        progress.put(("progress", fraction, info))
        if time.monotonic() - trimmed[0] >= TRIM_EVERY_S:
            release_heap()
            trimmed[0] = time.monotonic()

    try:
        result = work(report)
        progress.put(("done", 1.0, {**result, "worker_memory_kib": rss_kib()}))
    except Exception as exc:  # noqa: BLE001 - reported to the server as the job's error
        if isinstance(exc, Cancelled) or cancel.is_set():
            progress.put(("cancelled", 0.0, {}))
        else:
            progress.put(("failed", 0.0, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}))


def domain_worker(ctx: WorkerContext, job: dict, progress, cancel) -> None:
    """Creates or updates a domain branch (further pretraining, then the branch's PLOT)."""

    def work(report) -> dict:
        lines = job_lines(job["data"])
        tree = ctx.tree()
        fpt = FPTConfig(steps=job.get("steps"), objective=job.get("objective", DEFAULT_OBJECTIVE))
        checkpoint = Path(job["checkpoint"]) if job.get("checkpoint") else None  # a stopped job continues from it
        report(0.0, {"stage": "further pretraining"})

        def on_progress(fraction: float, info: dict) -> None:
            if info["stage"] == "further pretraining":
                report(FPT_SHARE * fraction, info)
            else:
                report(FPT_SHARE + (1 - FPT_SHARE) * fraction, info)

        if job["kind"] == "domain-create":
            node = tree.create(job["domain"], job["parent"], lines, job["alpha"], fpt, progress=False,
                               should_stop=cancel.is_set, on_progress=on_progress, checkpoint=checkpoint)
        else:
            node = tree.update(job["domain"], lines, fpt, progress=False, should_stop=cancel.is_set,
                               on_progress=on_progress, checkpoint=checkpoint)
        return asdict(node)

    _run(job, progress, cancel, work)


def starting_pooling(spec: AdapterSpec, named: bool, continued: bool, source: str | None) -> tuple[AdapterSpec, bool]:
    """The spec a fine-tune starts from, and whether every setting keeps its pooling (else dev
    chooses it, ``dev_options``): kept where the tenant named it or the fine-tune continues weights
    trained with it; on a packaged root that fixes one (``root_pooling``: mpnet-base reads the mean
    of the tokens, as its tables do), that one, unless the tenant named another."""
    fixed = root_pooling(source)
    if named or continued:
        return spec, True
    if fixed is not None and spec.head == "classification":
        return replace(spec, pooling=fixed), True
    return spec, False


def _serve_whole(model, metrics: dict, tokenizer, rows: tuple, cfg: FinetuneConfig):
    """A tenant served by its teacher on the full root: the teacher's spec and weights, its scores on
    the job's splits in ``metrics`` (what the adapter of the upper layers scored kept as ``windows``)."""
    spec, weights = model.whole_weights()
    metrics["windows"] = {k: metrics.pop(k) for k in ("train", "dev", "test")}
    for name, split in zip(("train", "dev", "test"), rows):
        ex = encode(tokenizer, split, spec, cfg.max_len, cfg.truncate)
        metrics[name] = model.evaluate(ex) if ex else None
    return spec, weights


def finetune_worker(ctx: WorkerContext, job: dict, progress, cancel) -> None:
    """Fine-tunes one encoder tenant and stores what it will serve (unpublished, named by the job
    id): the adapter of the upper layers, or its teacher on the full root where the job's
    ``serving`` asks for it (``choose_serving``).  Its metrics' ``seconds`` are the whole job's (a
    distilled one's ``distilled`` record splits them into the teacher's and the student's)."""

    def work(report) -> dict:
        t0 = time.monotonic()
        spec = replace(AdapterSpec.from_dict(job["spec"]), whole=False)  # the served adapter's; a teacher's is whole
        train, dev, test = job_rows(job["data"])
        train, dev, held = hold_out(train, dev, job["data"].get("hold_out"))
        adapters = AdapterStore(ctx.tenants_dir)
        update = job["kind"] == "update" and not adapters.spec(job["tenant"]).whole
        init = adapters.load(job["tenant"]) if update else None
        # Jobs queued before tenants chose how long texts are read kept the old rule: cut at 128.
        cfg = FinetuneConfig(epochs=job.get("epochs", 4), seed=job.get("seed", 0), max_len=job.get("max_len", 128),
                             truncate=job.get("truncate", True))
        lookup, tokenizer = ctx.lookup(job.get("domain", "root")), load_tokenizer(ctx.tokenizer_dir)
        spec, keep_pooling = starting_pooling(spec, job.get("keep_pooling", False), init is not None, ctx.source)
        # the (pooling, rate) settings dev chooses among: the served adapter's, or the teacher's and then its
        # student's at the pooling the teacher kept
        options, distil, student_report, teacher = dev_options(spec, bool(dev), keep_pooling=keep_pooling), None, report, {}
        if job.get("distil"):
            answers, teacher = train_teacher(
                ctx.bert, tokenizer, spec, train, dev, cfg, keep_pooling=keep_pooling, should_stop=cancel.is_set,
                on_progress=lambda f, info: report(TEACHER_SHARE * f, {**info, "stage": "training the teacher"}))
            distil = Distillation(answers, job_unlabeled(job["data"], len(train)))
            options = dev_options(replace(spec, pooling=teacher["pooling"]), bool(dev), teacher["lr"], keep_pooling=True)
            student_report = lambda f, info: report(  # noqa: E731
                TEACHER_SHARE + (1 - TEACHER_SHARE) * f, {**info, "stage": "distilling the served adapter"})
        weights, metrics = finetune(
            ctx.bert, ctx.l_low, lookup, tokenizer, spec, train, dev, test, cfg, init=init, progress=False,
            on_progress=student_report, should_stop=cancel.is_set, distil=distil, options=options)
        spec = replace(spec, pooling=metrics["pooling"])  # the kept setting's
        if held:
            metrics["dev_held_out"] = held  # training rows that became the dev split (none was given)
        metrics["miss_policy"] = lookup.policy  # what its features were read with (Tenants.trained_with_another_policy)
        if distil is not None:
            metrics["distilled"] = {"teacher_dev": teacher["dev"], "unlabeled_texts": len(distil.texts),
                                    "teacher_pooling": teacher["pooling"], "teacher_lr": teacher["lr"],
                                    "teacher_tried": teacher["tried"], "teacher_seconds": teacher["seconds"],
                                    "student_seconds": metrics["seconds"]}
        scored = metrics["dev"] or {}  # None without dev rows
        choice = choose_serving(job.get("serving", "windows"), distil is not None, teacher.get("dev"),
                                scored.get("accuracy"))
        if choice["mode"] == "whole":
            spec, weights = _serve_whole(teacher["model"], metrics, tokenizer, (train, dev, test), cfg)
        metrics["serving"] = choice
        if lookup.keeper is not None:
            keep_texts(lookup, tokenizer, job["data"].get("unlabeled", []), cfg.max_len)
            lookup.keeper.close()
            metrics["windows_kept"] = lookup.keeper.stats["added"]
        metrics["seconds"] = round(time.monotonic() - t0, 1)
        adapters.save(job["tenant"], spec, weights, {"domain": job.get("domain", "root"), "metrics": metrics},
                      version=job["id"], publish=False)
        return metrics

    _run(job, progress, cancel, work)


def decoder_worker(ctx: WorkerContext, job: dict, progress, cancel) -> None:
    """Fine-tunes one decoder tenant's LoRA and stores it (unpublished, named by the job id)."""

    def work(report) -> dict:
        if ctx.gpt is None:
            raise RuntimeError("the server does not serve decoder tenants")
        spec = AdapterSpec.from_dict(job["spec"])
        train, dev = job_texts(job["data"])
        adapters = AdapterStore(ctx.tenants_dir)
        init = {k: v.float() for k, v in adapters.load(job["tenant"]).items()} if job["kind"] == "update" else None
        weights, metrics = finetune_lm(
            ctx.gpt.root(), ctx.gpt.lookup(), spec, train, dev, LmFinetuneConfig(epochs=job.get("epochs", 1)),
            init=init, progress=False, on_progress=report, should_stop=cancel.is_set)
        adapters.save(job["tenant"], spec, weights, {"model": "decoder", "metrics": metrics},
                      version=job["id"], publish=False)
        return metrics

    _run(job, progress, cancel, work)
