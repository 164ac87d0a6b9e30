"""What one serving process holds (``Server``): the root, its PLOT, adapter store, scheduler,
batcher, registry and metrics, and the services the HTTP layer calls (each with one job:
authentication, the tenant life cycle, domains, jobs, adapter transfer, usage, decoders)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hmi.adapters.store import AdapterStore
from hmi.allocator import release_heap
from hmi.data import load_corpus
from hmi.model.root import SentencePooling, sentence_pooling, weights_fingerprint
from hmi.plot.hot import attach_hot_tier
from hmi.plot.kept import DEFAULT_BUDGET_MB
from hmi.plot.pending import PendingStore, build_state
from hmi.scheduler.batcher import Batcher
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig, pick_device
from hmi.services.auth import Auth, admin_token
from hmi.services.decoders import Decoders
from hmi.services.domains import Domains
from hmi.services.jobs import JobManager, watch_orphans
from hmi.services.metrics import History, Metrics
from hmi.services.registry import UNFINISHED, Leases, Registry, RegistryOps
from hmi.services.tenants import ServedTenants, Tenants
from hmi.services.transfer import AdapterTransfer
from hmi.services.usage import Usage
from hmi.services.workers import WorkerContext
from hmi.split.base_executor import BaseExecutor, FrozenLinears
from hmi.version_tree.tree import VersionTree

log = logging.getLogger("hmi.server")


@dataclass
class ServerConfig:
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_len: int = 128
    max_inputs: int = 64
    max_embedding_inputs: int = 2048  # texts in one POST /v1/embeddings (OpenAI's limit)
    max_input_chars: int = 20_000
    max_examples: int = 50_000
    max_body_mb: float = 32.0
    pool_slots: int = 64
    host_cache_mb: float = 1024
    # The PLOT's miss policy (hmi.plot.lookup.POLICIES), or auto: the root's choice on its front where
    # the root PLOT has a learned back-off (``hmi.model.aliases.auto_miss_policy``), else backoff
    # (``resolve_policy``; docs/front.md).
    miss_policy: str = "auto"
    plot_keep_mb: float = DEFAULT_BUDGET_MB  # compute+insert: the kept misses each PLOT may hold (hmi.plot.kept)
    # Encoder fine-tunes distil the served adapter from a full-context teacher (hmi.training.distil)
    # unless the request says otherwise.
    distil: bool = True
    # How fine-tuned encoder tenants are served unless the request says (hmi.training.serving):
    # windows, whole, or auto: whole where the teacher beats the windows on dev, the front's best point
    # at >= 1.5x hBERT-adapter's requests/s on the default root (docs/front.md).
    serving: str = "auto"
    max_pending: int = 256
    # Fair shares (hmi.scheduler.batcher): batches formed ahead of the scheduler, and the requests
    # one tenant may have waiting before its own are refused (429) while the others' are served.
    batches_in_flight: int = 2
    tenant_queue: int = 256
    queue_delay_s: float = 0.25  # the work the batcher holds before it refuses (0: no such bound)
    heap_trim_s: float = 60.0  # how often the heap's free memory goes back to the kernel (0: never; hmi.allocator)
    job_concurrency: int = 1
    job_memory_mb: float = 0.0  # the memory jobs may take together (their expected peaks; 0: no bound)
    max_queued_jobs: int = 64
    job_time_limit_s: float = 6 * 3600.0
    infer_timeout_s: float = 60.0
    max_labels: int = 32  # labels a tenant's head may have (the width of the device pools' heads)
    device: str = "auto"  # cpu, cuda or auto
    # The shared upper layers' linear products: fp32, or bf16 where the CPU multiplies it natively
    # (hmi.scheduler.pipeline.check_precision; docs/results/bench_precision.md measures both).
    upper_precision: str = "fp32"
    # Other serving processes (hmi.scaleout's replicas) share this home's registry and adapter
    # store: a tenant is brought up to its registry record whenever it is used, and start-up
    # recovery fails only the jobs of processes that are gone.
    shared_home: bool = False
    orphan_check_s: float = 10.0  # shared home: how often the jobs of stopped processes are taken over
    # Shared home: a process on another host that has not renewed its lease for this long is gone
    # (and its jobs are taken over); each process renews its own four times as often.
    lease_s: float = 60.0
    # The base executor of private tenants: how long an idle executor holds a batch for more calls
    # (0: none; calls still gather while a GEMM runs), and whether calls of different clients are
    # batched at all (off: the ablation of bench_private).
    executor_wait_ms: float = 0.0
    executor_batching: bool = True
    # The root PLOT's hot tier (hmi.plot.hot), MB: its entries the general corpus reads most, on the
    # server's device, built in the background after start; 0: none (LMDB alone).
    plot_hot_mb: float = 0.0
    hot_tier_lines: int = 20_000  # general-corpus lines that order the hot tier's entries
    metrics_history_s: float = 10.0  # seconds between the samples of the last hour the console draws at once


class ServerConfigError(ValueError):
    """A server setting the root cannot honour."""


def check_config(cfg: ServerConfig, root) -> None:
    """Raises ServerConfigError for settings the root cannot serve (a token limit past its
    position embeddings)."""
    limit = root.bert.config.max_position_embeddings
    if not 8 <= cfg.max_len <= limit:
        raise ServerConfigError(f"max_len {cfg.max_len} is outside [8, {limit}] (the root's position limit)")
    if not cfg.plot_keep_mb > 0:
        raise ServerConfigError(f"plot_keep_mb must be above 0, got {cfg.plot_keep_mb:g}")
    if not cfg.metrics_history_s > 0:
        raise ServerConfigError(f"metrics_history_s must be above 0, got {cfg.metrics_history_s:g}")
    if not cfg.lease_s > 0:
        raise ServerConfigError(f"lease_s must be above 0, got {cfg.lease_s:g}")


class Server:
    """Everything one serving process holds, wired together; built by ``build_server``.  The
    HTTP layer reaches the services with one job each: ``auth`` (whom a token belongs to),
    ``tenants`` (their life cycle), ``served`` (which tenants are answered for now), ``transfer``
    (adapters uploaded and downloaded), ``usage`` (per-tenant counts), ``decoders`` (the hGPT
    runtime, when enabled), ``jobs``, ``domains`` (the version tree and its lookups),
    ``scheduler`` and ``batcher``."""

    def __init__(self, home: Path, root, lookup, cfg: ServerConfig, plot_path: Path, plot_meta, job_launcher=None,
                 registry: RegistryOps | None = None):
        check_config(cfg, root)
        self.home, self.root, self.lookup, self.cfg = home, root, lookup, cfg
        self.metrics = Metrics()
        self.history = History(cfg.metrics_history_s)
        # The home's own LMDB registry, or one that serving processes on several hosts share.
        self.registry = registry if registry is not None else Registry(home / "registry")
        self.device = pick_device(cfg.device)
        self.store = AdapterStore(home / "tenants", host_cache_mb=cfg.host_cache_mb,
                                  pin_memory=self.device.type == "cuda")
        # On a shared home other processes may be writing their jobs' versions right now.
        self.store.recover(keep=self._job_unfinished if cfg.shared_home else None)
        admin, self.admin_token_new = admin_token(home)
        self.auth = Auth(self.registry, admin, cfg.shared_home)
        self.decoders = Decoders()
        self.tree = VersionTree(root, home, root_version=lookup.chain[0], writable=lookup.keeper is not None)
        try:  # the root's own sentence pooling; a root whose pooling is not served embeds nothing
            pooling, self.embedding_error = sentence_pooling(root.spec.model_dir), None
        except ValueError as exc:
            pooling, self.embedding_error = SentencePooling(), str(exc)
        self._closing = threading.Event()
        self._start_background()
        root.bert.share_memory()
        root.windowed.share_memory()
        ctx = WorkerContext(root.bert, root.windowed, root.spec.model_dir, root.spec.l_low, str(plot_path),
                            plot_meta, str(home / "tenants"), lookup.policy, root.artifact_id, str(home),
                            source=root.spec.source, keep_mb=cfg.plot_keep_mb)
        self.jobs = JobManager(self.registry, ctx, self._job_finished, cfg.job_concurrency, cfg.max_queued_jobs,
                               cfg.job_time_limit_s, inputs=home / "jobs", launcher=job_launcher,
                               memory_mb=cfg.job_memory_mb)
        self.domains = Domains(self.tree, lookup, self.registry, self.jobs, root.artifact_id)
        self.served = ServedTenants(weights_fingerprint(root.bert), root.spec.name, root.spec.l_low,
                                    root.bert.config.num_hidden_layers)
        self.scheduler = Scheduler(root.bert, root.spec.l_low, root.tokenizer, self.store, self.served, self.domains,
                                   SchedulerConfig(max_batch=cfg.max_batch, max_len=cfg.max_len,
                                                   pool_slots=cfg.pool_slots, max_pending=cfg.max_pending,
                                                   max_labels=cfg.max_labels, device=str(self.device),
                                                   upper_precision=cfg.upper_precision), pooling)
        self.batcher = Batcher(self.scheduler.submit, cfg.max_batch, cfg.max_wait_ms / 1000,
                               on_close=self.metrics.batch_size.observe, in_flight=cfg.batches_in_flight,
                               tenant_queue=cfg.tenant_queue, weight=self.served.weight,
                               queue_delay=cfg.queue_delay_s or None)
        self.gate = None  # the HAProxy gate in front of this server (hmi.dispatcher.gate), when it runs behind one
        self.usage = Usage(self.scheduler.residency, self.store, self.decoders)
        self.tenants = Tenants(self.registry, self.store, self.scheduler, self.jobs, self.auth, self.decoders,
                               self.usage, self.served, default_root=root.spec.source is None,
                               shared_home=cfg.shared_home)
        self.transfer = AdapterTransfer(root, self.registry, self.store, self.scheduler.residency, self.tenants,
                                        self.decoders)
        self._executor: BaseExecutor | None = None
        self.leases = Leases(self.registry, cfg.lease_s) if cfg.shared_home else None
        self.recovered, self.resumed = self._recover_jobs()
        self.started = time.time()

    @property
    def admin_token(self) -> str:
        return self.auth.admin

    @property
    def executor(self) -> BaseExecutor:
        """The base executor of private tenants (``hmi.split``), made on first use."""
        if self._executor is None:
            self._executor = BaseExecutor(FrozenLinears(self.root.bert, self.root.spec.l_low, self.device),
                                          self.cfg.executor_wait_ms / 1000, batching=self.cfg.executor_batching)
        return self._executor

    def _recover_jobs(self) -> tuple[list[str], list[str]]:
        """Jobs a stopped server left unfinished: run again from their kept inputs, or failed.  On a
        shared home, only those of processes that are gone (this one's lease is taken first), and
        from then on those of processes that go while this one runs.  Jobs of tenants trained on
        another root are left alone: a server of that root runs them again."""
        foreign = self.tenants.is_foreign
        if self.leases is None:
            return self.jobs.recover(foreign)
        self.leases.renew()

        def left_alone(job: dict) -> bool:
            return foreign(job) or self.leases.alive(job)

        done = self.jobs.recover(left_alone)
        watch_orphans(self.jobs, left_alone, self.cfg.orphan_check_s, renew=self.leases.renew,
                      renew_every_s=self.cfg.lease_s / 4)
        return done

    def _job_unfinished(self, job_id: str) -> bool:
        job = self.registry.get("jobs", job_id)
        return job is not None and job["state"] in UNFINISHED

    def _job_finished(self, job: dict, state: str, info: dict) -> None:
        if not job["kind"].startswith("domain"):
            self.tenants.job_finished(job, state, info)
        elif state == "succeeded":
            self.domains.changed(job["domain"])

    def _start_background(self) -> None:
        """The server's own threads: the hot tier's build, the heap's trimming, and the wait for a root
        PLOT still being built; each ends with the process (daemon) or at ``_closing``."""
        if self.cfg.plot_hot_mb > 0:
            threading.Thread(target=self._build_hot_tier, name="hot-tier", daemon=True).start()
        if self.cfg.heap_trim_s > 0:
            threading.Thread(target=self._trim_heap, name="heap-trim", daemon=True).start()
        if isinstance(self.lookup.chain[0].store, PendingStore):
            threading.Thread(target=self._await_plot, args=(self.lookup.chain[0], "root PLOT"), name="root-plot",
                             daemon=True).start()

    def _build_hot_tier(self) -> None:
        """The root PLOT's hot tier, in the background: lookups read LMDB alone until it is there."""
        started = time.monotonic()
        try:
            tier = attach_hot_tier(self.lookup.chain[0], self.root.tokenizer,
                                   load_corpus("general", self.cfg.hot_tier_lines), self.cfg.plot_hot_mb, self.device)
        except Exception:  # serving goes on from LMDB alone
            log.exception("the root PLOT's hot tier could not be built; lookups read LMDB alone")
            return
        log.info("root PLOT hot tier: %d entries, %.0f MB on %s, built in %.1f s", len(tier), tier.nbytes / 2**20,
                 self.device, time.monotonic() - started)

    def _await_plot(self, version, what: str) -> None:
        """While a root PLOT (``version``'s store) is built beside the server, its lookups compute
        what is not written yet (``hmi.plot.pending``); once the build is complete, they read it alone."""
        pending = version.store
        while not build_state(pending.store).get("complete"):
            if self._closing.wait(1.0):
                return
        version.store = pending.store
        log.info("%s complete: %d entries; %d values were computed on demand while it was built", what,
                 len(pending.store), pending.computed)

    def _trim_heap(self) -> None:
        """Every ``heap_trim_s``: the memory freed since goes back to the kernel (the tuned
        allocator would keep up to 1 GiB per arena; batches in between still reuse theirs)."""
        while not self._closing.wait(self.cfg.heap_trim_s):
            release_heap()

    def closing(self) -> bool:
        """Whether the server is shutting down."""
        return self._closing.is_set()

    def preparing(self) -> dict:
        """The stages of preparation still running beside serving: ``{}`` when none, else e.g.
        ``{"root_plot": {"done": n, "total": m, "computed_on_demand": k}}`` (``decoder_plot``: the
        decoder's causal PLOT)."""
        stages = {"root_plot": self.lookup.chain[0]}
        if self.decoders.runtime is not None:
            stages["decoder_plot"] = self.decoders.runtime.lookup.chain[0]
        out = {}
        for stage, version in stages.items():
            store = version.store
            if isinstance(store, PendingStore):
                state = build_state(store.store)
                out[stage] = {"done": state.get("done", 0), "total": state.get("total"),
                              "computed_on_demand": store.computed}
        return out

    # -- decoders --------------------------------------------------------------------------------
    def enable_hgpt(self, runtime) -> None:
        """Serves decoder tenants with ``runtime`` (an HgptRuntime) and lets jobs train them."""
        self.decoders.enable(runtime)
        runtime.service.set_weight(self.served.weight)  # the admin's shares hold for the decoder's rows too
        self.jobs.ctx.gpt = runtime.worker_view()
        version = runtime.lookup.chain[0]
        if isinstance(version.store, PendingStore):
            threading.Thread(target=self._await_plot, args=(version, "the decoder's causal PLOT"),
                             name="decoder-plot", daemon=True).start()

    def shutdown(self) -> None:
        self._closing.set()
        if self._executor is not None:
            self._executor.shutdown()
        self.decoders.shutdown()
        self.jobs.shutdown()
        if self.leases is not None:
            try:  # its jobs left unfinished are taken over by the other processes at once
                self.leases.release()
            except Exception:  # noqa: BLE001 - the lease then expires instead
                log.warning("releasing this process's lease failed", exc_info=True)
        self.scheduler.shutdown(cancel=True)
        if self.lookup.keeper is not None:  # what lookups computed is written before the PLOTs close
            self.lookup.keeper.close()
        self.tree.close()
        self.registry.close()
