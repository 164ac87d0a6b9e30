"""What one serving process holds (``Server``): the root, PLOT lookups, version tree, adapter
store, scheduler, batcher, registry, jobs and metrics, and the operations the routes call on
them (tenant life cycle, authentication, domain changes)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from hmi.adapters.portable import RootShape
from hmi.adapters.spec import AdapterSpec
from hmi.adapters.store import AdapterStore, TenantMissingError
from hmi.dispatcher.auth import admin_token, hash_token, new_token, same
from hmi.dispatcher.batcher import Batcher
from hmi.dispatcher.jobs import JobManager, new_job_id
from hmi.dispatcher.metrics import Metrics
from hmi.dispatcher.registry import UNFINISHED, Leases, Registry, RegistryOps
from hmi.dispatcher.schemas import build_models
from hmi.dispatcher.validation import ApiError
from hmi.dispatcher.workers import WorkerContext
from hmi.model.root import weights_fingerprint
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig, pick_device
from hmi.scheduler.types import RequestError, TenantEntry
from hmi.version_tree.tree import VersionTree

log = logging.getLogger("hmi.server")


@dataclass
class ServerConfig:
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_len: int = 128
    max_inputs: int = 64
    max_input_chars: int = 20_000
    max_examples: int = 50_000
    max_body_mb: float = 32.0
    pool_slots: int = 64
    host_cache_mb: float = 1024
    miss_policy: str = "backoff"
    max_pending: int = 256
    job_concurrency: int = 1
    max_queued_jobs: int = 64
    job_time_limit_s: float = 6 * 3600.0
    infer_timeout_s: float = 60.0
    max_labels: int = 32  # labels a tenant's head may have (the width of the device pools' heads)
    device: str = "auto"  # cpu, cuda or auto
    # Other serving processes (hmi.scaleout's replicas) share this home's registry and adapter
    # store: a tenant is brought up to its registry record whenever it is used, and start-up
    # recovery fails only the jobs of processes that are gone.
    shared_home: bool = False
    orphan_check_s: float = 10.0  # shared home: how often the jobs of stopped processes are taken over
    # Shared home: a process on another host that has not renewed its lease for this long is gone
    # (and its jobs are taken over); each process renews its own four times as often.
    lease_s: float = 60.0


class ServerConfigError(ValueError):
    """A server setting the root cannot honour."""


def check_config(cfg: ServerConfig, root) -> None:
    """Raises ServerConfigError for settings the root cannot serve (a token limit past its
    position embeddings)."""
    limit = root.bert.config.max_position_embeddings
    if not 8 <= cfg.max_len <= limit:
        raise ServerConfigError(f"max_len {cfg.max_len} is outside [8, {limit}] (the root's position limit)")
    if not cfg.lease_s > 0:
        raise ServerConfigError(f"lease_s must be above 0, got {cfg.lease_s:g}")


class Server:
    """Everything one serving process holds; built by ``build_server``."""

    def __init__(self, home: Path, root, lookup, cfg: ServerConfig, plot_path: Path, plot_meta, job_launcher=None,
                 registry: RegistryOps | None = None):
        check_config(cfg, root)
        self.home, self.root, self.lookup, self.cfg = home, root, lookup, cfg
        self.metrics = Metrics()
        # The home's own LMDB registry, or one that serving processes on several hosts share.
        self.registry = registry if registry is not None else Registry(home / "registry")
        self._tokens_read = 0.0  # when the token map was last rebuilt from the registry (shared home)
        self._synced: dict[str, tuple] = {}  # tenant -> (created, version) of the record served (shared home)
        self.device = pick_device(cfg.device)
        self.store = AdapterStore(home / "tenants", host_cache_mb=cfg.host_cache_mb,
                                  pin_memory=self.device.type == "cuda")
        # On a shared home other processes may be writing their jobs' versions right now.
        self.store.recover(keep=self._job_unfinished if cfg.shared_home else None)
        self._entries: dict[str, TenantEntry] = {}
        # Encoder tenants record the root they were trained on (its fingerprint); those of
        # another root stay in the registry but are not served by this one.
        self.root_fingerprint = weights_fingerprint(root.bert)
        self._foreign: dict[str, str] = {}
        self._gpt_ready: set[str] = set()  # decoder tenants that can generate
        self.gpt = None  # hmi.scheduler.decoder_runtime.HgptRuntime once enabled
        self._token_owner_by_hash: dict[str, str] = {}
        self._usage: dict[str, tuple[int, float]] = {}  # tenant -> (requests answered, seconds summed)
        for name, rec in self.registry.items("tenants"):
            self._token_owner_by_hash[rec.get("token_hash", "")] = name
            if rec["state"] == "importing":
                rec = self._recover_import(name, rec)
            if rec.get("model") != "decoder" and not self._own_root(rec):
                self._foreign[name] = rec.get("root") or "the default root's"
            elif rec["state"] in ("ready", "updating"):
                if rec.get("model") == "decoder":
                    self._gpt_ready.add(name)
                else:
                    self._entries[name] = self._entry(name, rec)
        self.tree = VersionTree(root, home, root_version=lookup.chain[0])
        self._lookups: dict[str, object] = {"root": lookup}
        self.scheduler = Scheduler(root.bert, root.spec.l_low, root.tokenizer, self.store, self.entry,
                                   self.lookup_for,
                                   SchedulerConfig(max_batch=cfg.max_batch, max_len=cfg.max_len,
                                                   pool_slots=cfg.pool_slots, max_pending=cfg.max_pending,
                                                   max_labels=cfg.max_labels, device=str(self.device)))
        self.batcher = Batcher(self.scheduler.submit, cfg.max_batch, cfg.max_wait_ms / 1000,
                               on_close=self.metrics.batch_size.observe)
        self.models = build_models(cfg)
        self.admin_token, self.admin_token_new = admin_token(home)
        root.bert.share_memory()
        root.windowed.share_memory()
        ctx = WorkerContext(root.bert, root.windowed, root.spec.model_dir, root.spec.l_low, str(plot_path),
                            plot_meta, str(home / "tenants"), cfg.miss_policy, root.artifact_id, str(home),
                            source=root.spec.source)
        self.jobs = JobManager(self.registry, ctx, self._job_finished, cfg.job_concurrency, cfg.max_queued_jobs,
                               cfg.job_time_limit_s, inputs=home / "jobs", launcher=job_launcher)
        self.leases = Leases(self.registry, cfg.lease_s) if cfg.shared_home else None
        self.recovered, self.resumed = self._recover_jobs()
        self.started = time.time()

    def _recover_jobs(self) -> tuple[list[str], list[str]]:
        """Jobs a stopped server left unfinished: run again from their kept inputs, or failed.  On a
        shared home, only those of processes that are gone (this one's lease is taken first), and
        from then on those of processes that go while this one runs.  Jobs of tenants trained on
        another root are left alone: a server of that root runs them again."""
        def foreign(job: dict) -> bool:
            return job.get("tenant") in self._foreign

        if self.leases is None:
            return self.jobs.recover(foreign)
        self.leases.renew()

        def left_alone(job: dict) -> bool:
            return foreign(job) or self.leases.alive(job)

        done = self.jobs.recover(left_alone)
        self.jobs.watch_orphans(left_alone, self.cfg.orphan_check_s, renew=self.leases.renew,
                                renew_every_s=self.cfg.lease_s / 4)
        return done

    # -- tenants ---------------------------------------------------------------------------------
    @staticmethod
    def _entry(name: str, rec: dict) -> TenantEntry:
        return TenantEntry(name, AdapterSpec.from_dict(rec["spec"]), rec.get("domain", "root"), rec.get("version", 0),
                           rec.get("truncate", False))

    def resolve(self, tenant: str) -> TenantEntry:
        """The tenant's entry for a request (brought up to the registry first with a shared home)."""
        if self.cfg.shared_home:
            self.sync_tenant(tenant)
        return self.entry(tenant)

    async def aresolve(self, tenant: str) -> TenantEntry:
        """``resolve`` for a route on the event loop: the registry read is awaited, so a registry
        kept by another process (a Ray actor's round trip) does not hold up the other requests."""
        if self.cfg.shared_home:
            self.apply_record(tenant, await self.registry.aget("tenants", tenant))
        return self.entry(tenant)

    def entry(self, tenant: str) -> TenantEntry:
        """The tenant's entry as this process serves it; RequestError when it serves none."""
        e = self._entries.get(tenant)
        if e is None and tenant in self._foreign:
            raise RequestError("wrong_root", self.foreign_message(tenant), 409)
        if e is None:
            raise RequestError("unknown_tenant", f"tenant {tenant!r} is not servable", 404)
        return e

    def sync_tenant(self, name: str) -> None:
        """Brings this process's view of a tenant up to its registry record, which another process
        sharing the home may have changed: a tenant created, retrained, re-uploaded (or deleted and
        created again under its name) there is served here in its published version, its cached
        copies dropped; a deleted one is dropped.  A record is known by its creation time and version."""
        self.apply_record(name, self.registry.get("tenants", name))

    def apply_record(self, name: str, rec: dict | None) -> None:
        """``sync_tenant`` with the tenant's registry record ``rec`` (None: there is none) read."""
        if rec is None:
            self._synced.pop(name, None)
            if self._entries.pop(name, None) is not None or name in self._gpt_ready:
                self._gpt_ready.discard(name)
                self.scheduler.forget(name)
            return
        if rec.get("model") != "decoder" and not self._own_root(rec):
            self._foreign[name] = rec.get("root") or "the default root's"
            return
        self._foreign.pop(name, None)
        published = rec["state"] in ("ready", "updating") or (rec["state"] == "importing" and rec.get("import_of") == "update")
        if not published:
            return
        self._token_owner_by_hash[rec.get("token_hash", "")] = name
        seen = (rec.get("created"), rec.get("version", 0))
        if self._synced.get(name) != seen:
            self._synced[name] = seen
            self._serve_new_version(name, rec)

    def _own_root(self, rec: dict) -> bool:
        """Whether an encoder tenant was trained on this server's root; records from before roots
        were recorded belong to the default root, the only one then."""
        if "root" not in rec:
            return self.root.spec.source is None
        return rec["root"] == self.root_fingerprint

    def foreign_message(self, tenant: str) -> str:
        return (f"tenant {tenant!r} was trained on another root (fingerprint {self._foreign[tenant][:12]}); this "
                f"server serves {self.root.spec.name} ({self.root_fingerprint[:12]}): serve that root to use it")

    def lookup_for(self, domain: str):
        """The PLOT lookup of a domain's chain, opened once and kept until the domain changes."""
        lk = self._lookups.get(domain)
        if lk is None:
            lk = self._lookups[domain] = self.tree.lookup(domain, self.cfg.miss_policy)
        return lk

    def enable_hgpt(self, runtime) -> None:
        """Serves decoder tenants with ``runtime`` (an HgptRuntime) and lets jobs train them."""
        self.gpt = runtime
        self.jobs.ctx.gpt = runtime.worker_view()

    def require_gpt(self):
        """The hGPT runtime, or a 404 telling how to enable it."""
        if self.gpt is None:
            raise ApiError(404, "hgpt_disabled", "this server does not serve decoder tenants (start it with --hgpt)")
        return self.gpt

    def load_decoder_tenant(self, name: str):
        """(AdapterSpec, weights) of a decoder tenant, for the generation engine."""
        return AdapterSpec.from_dict(self.store.info(name)["spec"]), self.store.load(name)

    def domain_changed(self, name: str) -> None:
        for d in list(self._lookups):
            if d != "root":
                del self._lookups[d]
        self.tree.forget(name)

    def _job_unfinished(self, job_id: str) -> bool:
        job = self.registry.get("jobs", job_id)
        return job is not None and job["state"] in UNFINISHED

    def _job_finished(self, job: dict, state: str, info: dict) -> None:
        if job["kind"].startswith("domain"):
            if state == "succeeded":
                self.domain_changed(job["domain"])
            return
        t = job["tenant"]
        rec = self.registry.get("tenants", t)
        if rec is None or rec.get("job") != job["id"]:
            # The tenant was deleted (and maybe re-created) while this job ran: never serve its weights.
            self.store.discard(t, job["id"])
            return
        if state == "succeeded":
            self.store.publish(t, job["id"])
            rec = self.registry.update("tenants", t, state="ready", version=rec.get("version", 0) + 1,
                                       metrics=info, error=None)
            self._serve_new_version(t, rec)
            return
        self.store.discard(t, job["id"])
        if job["kind"] == "create":
            self.registry.update("tenants", t, state="failed", error=info.get("error") or state)
        else:
            self.registry.update("tenants", t, state="ready")

    # -- bring your own adapter -------------------------------------------------------------------
    def root_shape(self, model: str) -> RootShape:
        """What an adapter of an ``encoder`` or ``decoder`` tenant must fit on this server."""
        if model == "decoder":
            gpt = self.require_gpt()
            c = gpt.root.model.config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            return RootShape("llama", c.hidden_size, c.num_hidden_layers, gpt.root.l_low,
                             c.num_key_value_heads * head_dim, gpt.root.name)
        c = self.root.bert.config
        return RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, self.root.l_low, c.hidden_size,
                         self.root.spec.name)

    def import_adapter(self, name: str, model: str, spec: AdapterSpec, weights: dict) -> str | None:
        """Serves an uploaded adapter: for a new tenant (returns its token, shown once) or as a new
        version of an existing tenant of the same kind (returns None).  The version is written
        before it is published, and the record says ``importing`` meanwhile: a crash leaves the
        old version served (or, for a new tenant, a failed record), never a mix."""
        try:
            self.pool_check(spec, weights, model)
        except ValueError as exc:
            raise ApiError(422, "wrong_shape", f"the adapter does not fit this server: {exc}") from None
        rec = self.registry.get("tenants", name)
        if rec is None:
            token = self._register(name, {"state": "importing", "model": model, "domain": "root", "spec": spec.to_dict(),
                                          "truncate": False, "job": None, "import_of": "new"})
        else:
            token = None
            if rec.get("model", "encoder") != model:
                raise ApiError(422, "wrong_tenant_kind", f"tenant {name!r} is an {rec.get('model', 'encoder')} tenant")
            if self.registry.update_if("tenants", name, ("ready",), state="importing", import_of="update") is None:
                raise ApiError(409, "tenant_busy", f"tenant {name!r} is {rec['state']}; upload once it is ready")
        try:
            version = self.store.save(name, spec, weights, {"model": model, "imported": True}, publish=False)
            self.store.publish(name, version)
        except Exception:
            self._recover_import(name, self.registry.get("tenants", name))
            raise
        rec = self.registry.get("tenants", name)
        rec = self.registry.update("tenants", name, state="ready", spec=spec.to_dict(), version=rec.get("version", 0) + 1,
                                   metrics={"imported": True}, error=None, import_of=None)
        self._serve_new_version(name, rec)
        return token

    def _recover_import(self, name: str, rec: dict) -> dict:
        """An upload a crash interrupted: a new tenant fails; an existing one serves whatever
        version its store's pointer names, under that version's spec."""
        if rec.get("import_of") == "new":
            return self.registry.update("tenants", name, state="failed", error="the upload was interrupted by a restart")
        try:
            spec = self.store.spec(name).to_dict()
        except TenantMissingError:
            spec = rec["spec"]
        return self.registry.update("tenants", name, state="ready", spec=spec, import_of=None)

    def pool_check(self, spec: AdapterSpec, weights: dict, model: str) -> None:
        """Raises ValueError unless the weights fill a device slot of this server (shapes, head width)."""
        if model == "decoder":
            self.require_gpt().engine.pool.check(weights, 0)
        else:
            self.scheduler.residency.check(TenantEntry("upload", spec), weights)

    def _serve_new_version(self, name: str, rec: dict) -> None:
        """Drops every cached copy of a tenant whose published version changed, and serves it."""
        self.store.invalidate(name)
        if rec.get("model") == "decoder":
            if self.gpt is not None:
                self.gpt.forget(name)
            self._gpt_ready.add(name)
            return
        self.scheduler.forget(name)
        self._entries[name] = self._entry(name, rec)

    def export_adapter(self, name: str) -> tuple[AdapterSpec, dict, str]:
        """(spec, canonical weights, model kind) of a ready tenant's published adapter."""
        rec = self.tenant_record(name)
        if rec["state"] not in ("ready", "updating"):
            raise ApiError(409, "tenant_not_ready", f"tenant {name!r} is {rec['state']}; it has no adapter to download yet")
        return AdapterSpec.from_dict(self.store.info(name)["spec"]), self.store.load(name), rec.get("model", "encoder")

    def require_job_room(self) -> None:
        if self.jobs.full():
            raise ApiError(429, "too_many_jobs", f"{self.jobs.max_queued} jobs are waiting; retry later",
                           {"Retry-After": "30"})

    def create_tenant(self, name: str, rec: dict, data: dict, **job) -> tuple[str, str]:
        """Registers a new tenant and queues its first fine-tune job; returns (token, job id).
        Raises ApiError: 429 when the job queue is full, 409 when the name is taken."""
        self.require_job_room()
        jid = new_job_id()
        token = self._register(name, {**rec, "state": "training", "job": jid})
        self.jobs.submit("create", name, rec["spec"], data, job_id=jid, **job)
        return token, jid

    def _register(self, name: str, rec: dict) -> str:
        """Creates a tenant's record (version 0) with a new token, which it returns (shown once);
        409 when the name is taken."""
        token = new_token("hmi_t")
        rec = {**rec, "token_hash": hash_token(token), "version": 0}
        if rec.get("model") != "decoder":
            rec["root"] = self.root_fingerprint
        if not self.registry.create("tenants", name, rec):
            raise ApiError(409, "tenant_exists", f"tenant {name!r} already exists")
        self._token_owner_by_hash[rec["token_hash"]] = name
        return token

    def update_tenant(self, name: str, data: dict, **job) -> str:
        """Queues a further fine-tune job of a ready tenant: one at a time per tenant (409 while
        one is queued or running), checked and claimed in one registry transaction."""
        if name in self._foreign:
            raise ApiError(409, "wrong_root", self.foreign_message(name))
        self.require_job_room()
        jid = new_job_id()
        rec = self.registry.update_if("tenants", name, ("ready",), state="updating", job=jid)
        if rec is None:
            state = (self.registry.get("tenants", name) or {}).get("state", "deleted")
            raise ApiError(409, "tenant_busy", f"tenant {name!r} is {state}; update it once it is ready")
        self.jobs.submit("update", name, rec["spec"], data, job_id=jid, **job)
        return jid

    # -- auth ------------------------------------------------------------------------------------
    def _digest(self, request: web.Request) -> str | None:
        """The digest of the request's bearer token, None for the admin token; 401 without a token."""
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise ApiError(401, "unauthorized", "send 'Authorization: Bearer <token>'")
        token = header[7:].strip()
        try:
            token.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as surrogates
            raise ApiError(401, "unauthorized", "the token is not valid UTF-8") from None
        if same(token, self.admin_token):
            return None
        return hash_token(token)

    def _token_name(self, digest: str) -> str | None:
        """The tenant a token digest was issued to, as this process knows it (a tenant created by
        another process sharing the home: the registry's tokens are read, at most once a second);
        its registry record still has to confirm it (``_owns``).  Tokens are random 192-bit
        secrets: looking up their SHA-256 leaks nothing useful."""
        name = self._token_owner_by_hash.get(digest)
        if name is None and self.cfg.shared_home and time.time() - self._tokens_read > 1.0:
            self._tokens_read = time.time()
            self._token_owner_by_hash.update({rec.get("token_hash", ""): n for n, rec in self.registry.items("tenants")})
            name = self._token_owner_by_hash.get(digest)
        return name

    @staticmethod
    def _owns(rec: dict | None, digest: str) -> bool:
        return rec is not None and same(rec.get("token_hash", ""), digest)  # constant-time

    def caller(self, request: web.Request) -> str:
        """'admin', a tenant name, or raises 401."""
        digest = self._digest(request)
        if digest is None:
            return "admin"
        name = self._token_name(digest)
        if name is None or not self._owns(self.registry.get("tenants", name), digest):
            raise ApiError(401, "unauthorized", "the token is not valid")
        return name

    async def acaller(self, request: web.Request) -> str:
        """``caller`` for a route on the event loop: the tenant record that confirms a token is
        read awaited (a registry actor's round trip does not hold up the loop)."""
        digest = self._digest(request)
        if digest is None:
            return "admin"
        name = self._token_name(digest)
        if name is None or not self._owns(await self.registry.aget("tenants", name), digest):
            raise ApiError(401, "unauthorized", "the token is not valid")
        return name

    def require_admin(self, request) -> None:
        if self.caller(request) != "admin":
            raise ApiError(403, "forbidden", "this operation needs the admin token")

    @staticmethod
    def may_act(who: str, tenant: str) -> str:
        """``who`` (a ``caller``) if it may act on ``tenant``: the admin or the tenant; 403 otherwise."""
        if who != "admin" and who != tenant:
            raise ApiError(403, "forbidden", f"this token may not act on tenant {tenant!r}")
        return who

    def require_owner(self, request, tenant: str) -> str:
        return self.may_act(self.caller(request), tenant)

    async def arequire_owner(self, request, tenant: str) -> str:
        """``require_owner`` for a route on the event loop (see ``acaller``)."""
        return self.may_act(await self.acaller(request), tenant)

    def tenant_record(self, tenant: str) -> dict:
        rec = self.registry.get("tenants", tenant)
        if rec is None:
            raise ApiError(404, "unknown_tenant", f"no tenant {tenant!r}")
        return rec

    def record_usage(self, tenant: str, requests: int, seconds: float) -> None:
        """Counts a tenant's answered requests and their latency (for the console and the listing)."""
        n, total = self._usage.get(tenant, (0, 0.0))
        self._usage[tenant] = (n + requests, total + seconds * requests)

    def usage(self, tenant: str, rec: dict) -> dict:
        """Requests answered since start, their mean latency, and where the adapter is now:
        ``device`` (a pool slot), ``host`` (the memory cache) or ``disk``."""
        n, total = self._usage.get(tenant, (0, 0.0))
        if rec.get("model") == "decoder":
            on_device = self.gpt is not None and self.gpt.engine.pool.slot_of(tenant) is not None
        else:
            on_device = self.scheduler.residency.resident(tenant)
        tier = "device" if on_device else "host" if self.store.cached(tenant) else "disk"
        return {"residency": tier, "requests": n, "latency_ms": round(1000 * total / n, 2) if n else None}

    def servable_count(self) -> int:
        return len(self._entries)

    def decoder_ready(self, tenant: str) -> bool:
        """Whether a decoder tenant's LoRA is published and its generations are accepted."""
        return tenant in self._gpt_ready

    def delete_tenant(self, tenant: str, rec: dict) -> None:
        """Stops serving the tenant at once, cancels its job, forgets its record, token, resident
        copies and stored adapter."""
        self._entries.pop(tenant, None)
        self._gpt_ready.discard(tenant)
        if self.gpt is not None:
            self.gpt.forget(tenant)
        if rec.get("job"):
            self.jobs.cancel(rec["job"])
        self.registry.delete("tenants", tenant)
        self._token_owner_by_hash.pop(rec.get("token_hash", ""), None)
        self.scheduler.forget(tenant)
        try:
            self.store.delete(tenant)
        except TenantMissingError:
            pass

    def shutdown(self) -> None:
        if self.gpt is not None:
            self.gpt.shutdown()
        self.jobs.shutdown()
        if self.leases is not None:
            try:  # its jobs left unfinished are taken over by the other processes at once
                self.leases.release()
            except Exception:  # noqa: BLE001 - the lease then expires instead
                log.warning("releasing this process's lease failed", exc_info=True)
        self.scheduler.shutdown(cancel=True)
        self.tree.close()
        self.registry.close()
