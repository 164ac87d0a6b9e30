"""The aiohttp application: routes of docs/design.md, section 7."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.adapters.store import AdapterStore, TenantMissingError
from hmi.data import is_tagging, task_labels
from hmi.dispatcher.auth import admin_token, hash_token, new_token, same
from hmi.dispatcher.batcher import Batcher
from hmi.dispatcher.context import SERVER
from hmi.dispatcher.generate import completions, generate
from hmi.dispatcher.jobs import JobManager, new_job_id
from hmi.dispatcher.metrics import Metrics
from hmi.dispatcher.openapi import openapi_document
from hmi.dispatcher.registry import Registry
from hmi.dispatcher.schemas import api_error, build_models, parse
from hmi.dispatcher.validation import ApiError, check_rows, error_response, json_body
from hmi.dispatcher.workers import WorkerContext
from hmi.scheduler.pipeline import Scheduler, SchedulerConfig, pick_device
from hmi.scheduler.types import InferRequest, QueueFullError, RequestError, SchedulerClosedError, TenantEntry
from hmi.version_tree.tree import MIN_CORPUS_TOKENS, DomainError, VersionTree

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


class Server:
    """Everything one serving process holds; built by ``build_server``."""

    def __init__(self, home: Path, root, lookup, cfg: ServerConfig, plot_path: Path, plot_meta):
        self.home, self.root, self.lookup, self.cfg = home, root, lookup, cfg
        self.metrics = Metrics()
        self.registry = Registry(home / "registry")
        self.recovered = self.registry.recover()
        self.device = pick_device(cfg.device)
        self.store = AdapterStore(home / "tenants", host_cache_mb=cfg.host_cache_mb,
                                  pin_memory=self.device.type == "cuda")
        self.store.recover()
        self._entries: dict[str, TenantEntry] = {}
        self._gpt_ready: set[str] = set()  # decoder tenants that can generate
        self.gpt = None  # hmi.scheduler.decoder_runtime.HgptRuntime once enabled
        self._token_owner_by_hash: dict[str, str] = {}
        for name, rec in self.registry.items("tenants"):
            self._token_owner_by_hash[rec.get("token_hash", "")] = name
            if rec["state"] in ("ready", "updating"):
                if rec.get("model") == "decoder":
                    self._gpt_ready.add(name)
                else:
                    self._entries[name] = self._entry(name, rec)
        self.tree = VersionTree(root, home, root_version=lookup.chain[0])
        self._lookups: dict[str, object] = {"root": lookup}
        self.scheduler = Scheduler(root.bert, root.spec.l_low, root.tokenizer, self.store, self.resolve,
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
                            plot_meta, str(home / "tenants"), cfg.miss_policy, root.artifact_id, str(home))
        self.jobs = JobManager(self.registry, ctx, self._job_finished, cfg.job_concurrency, cfg.max_queued_jobs,
                               cfg.job_time_limit_s)
        self.started = time.time()

    # -- tenants ---------------------------------------------------------------------------------
    @staticmethod
    def _entry(name: str, rec: dict) -> TenantEntry:
        return TenantEntry(name, AdapterSpec.from_dict(rec["spec"]), rec.get("domain", "root"), rec.get("version", 0))

    def resolve(self, tenant: str) -> TenantEntry:
        e = self._entries.get(tenant)
        if e is None:
            raise RequestError("unknown_tenant", f"tenant {tenant!r} is not servable", 404)
        return e

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
            if rec.get("model") == "decoder":
                self.store.invalidate(t)
                if self.gpt is not None:
                    self.gpt.forget(t)
                self._gpt_ready.add(t)
                return
            self.scheduler.forget(t)
            self._entries[t] = self._entry(t, rec)
            return
        self.store.discard(t, job["id"])
        if job["kind"] == "create":
            self.registry.update("tenants", t, state="failed", error=info.get("error") or state)
        else:
            self.registry.update("tenants", t, state="ready")

    def _require_job_room(self) -> None:
        if self.jobs.full():
            raise ApiError(429, "too_many_jobs", f"{self.jobs.max_queued} jobs are waiting; retry later",
                           {"Retry-After": "30"})

    def create_tenant(self, name: str, rec: dict, data: dict, **job) -> tuple[str, str]:
        """Registers a new tenant and queues its first fine-tune job; returns (token, job id).
        Raises ApiError: 429 when the job queue is full, 409 when the name is taken."""
        self._require_job_room()
        token, jid = new_token("hmi_t"), new_job_id()
        rec = {**rec, "state": "training", "token_hash": hash_token(token), "version": 0, "job": jid}
        if not self.registry.create("tenants", name, rec):
            raise ApiError(409, "tenant_exists", f"tenant {name!r} already exists")
        self._token_owner_by_hash[rec["token_hash"]] = name
        self.jobs.submit("create", name, rec["spec"], data, job_id=jid, **job)
        return token, jid

    def update_tenant(self, name: str, data: dict, **job) -> str:
        """Queues a further fine-tune job of a ready tenant: one at a time per tenant (409 while
        one is queued or running), checked and claimed in one registry transaction."""
        self._require_job_room()
        jid = new_job_id()
        rec = self.registry.update_if("tenants", name, ("ready",), state="updating", job=jid)
        if rec is None:
            state = (self.registry.get("tenants", name) or {}).get("state", "deleted")
            raise ApiError(409, "tenant_busy", f"tenant {name!r} is {state}; update it once it is ready")
        self.jobs.submit("update", name, rec["spec"], data, job_id=jid, **job)
        return jid

    # -- auth ------------------------------------------------------------------------------------
    def caller(self, request: web.Request) -> str:
        """'admin', a tenant name, or raises 401."""
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise ApiError(401, "unauthorized", "send 'Authorization: Bearer <token>'")
        token = header[7:].strip()
        try:
            token.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as surrogates
            raise ApiError(401, "unauthorized", "the token is not valid UTF-8") from None
        if same(token, self.admin_token):
            return "admin"
        digest = hash_token(token)
        tenant = self._token_owner(digest)
        if tenant is None:
            raise ApiError(401, "unauthorized", "the token is not valid")
        return tenant

    def _token_owner(self, digest: str) -> str | None:
        # Tokens are random 192-bit secrets: looking up their SHA-256 leaks nothing useful; the
        # final comparison is constant-time all the same.
        name = self._token_owner_by_hash.get(digest)
        if name is None:
            return None
        rec = self.registry.get("tenants", name)
        return name if rec is not None and same(rec.get("token_hash", ""), digest) else None

    def require_admin(self, request) -> None:
        if self.caller(request) != "admin":
            raise ApiError(403, "forbidden", "this operation needs the admin token")

    def require_owner(self, request, tenant: str) -> str:
        who = self.caller(request)
        if who != "admin" and who != tenant:
            raise ApiError(403, "forbidden", f"this token may not act on tenant {tenant!r}")
        return who

    def tenant_record(self, tenant: str) -> dict:
        rec = self.registry.get("tenants", tenant)
        if rec is None:
            raise ApiError(404, "unknown_tenant", f"no tenant {tenant!r}")
        return rec

    def shutdown(self) -> None:
        if self.gpt is not None:
            self.gpt.shutdown()
        self.jobs.shutdown()
        self.scheduler.shutdown(cancel=True)
        self.registry.close()


# -- handlers ------------------------------------------------------------------------------------
def public_tenant(name: str, rec: dict) -> dict:
    keep = ("state", "model", "domain", "spec", "metrics", "error", "created", "updated", "version", "job")
    return {"name": name, **{k: rec.get(k) for k in keep if k in rec}}


async def infer(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    s.require_owner(request, tenant)
    body = parse(s.models["InferBody"], await json_body(request))
    if tenant not in s._entries:
        rec = s.registry.get("tenants", tenant)
        if rec is None:
            raise ApiError(404, "unknown_tenant", f"no tenant {tenant!r}")
        raise ApiError(409, "tenant_not_ready", f"tenant {tenant!r} is {rec['state']}; it serves once its job succeeds")
    reqs = [InferRequest(tenant, x) for x in body.inputs]
    try:
        s.batcher.add(reqs)
    except QueueFullError:
        raise ApiError(429, "overloaded", "the server is at capacity; retry shortly", {"Retry-After": "1"}) from None
    s.metrics.tenant_infer.labels(s.metrics.tenant_label(tenant)).inc(len(reqs))
    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(r.future) for r in reqs)),
                                         s.cfg.infer_timeout_s)
    except RequestError as exc:
        raise ApiError(exc.status, exc.code, exc.message) from None
    except QueueFullError:
        raise ApiError(429, "overloaded", "the server is at capacity; retry shortly", {"Retry-After": "1"}) from None
    except SchedulerClosedError:
        raise ApiError(503, "shutting_down", "the server is shutting down") from None
    except asyncio.TimeoutError:
        raise ApiError(503, "timeout", "inference did not finish in time; retry") from None
    return web.json_response({"tenant": tenant, "outputs": outputs})


def _spec(body) -> AdapterSpec:
    """The AdapterSpec of a validated EncoderTenant body; 422 for combinations the spec refuses."""
    kw = {"kind": body.adapter.kind, "head": body.task.type, "labels": body.task.labels}
    if body.task.pooling is not None:  # else the spec's default
        kw["pooling"] = body.task.pooling
    for k in ("reduction_factor", "rank", "alpha"):
        if getattr(body.adapter, k) is not None:
            kw[k] = getattr(body.adapter, k)
    try:
        return AdapterSpec(**kw)
    except SpecError as exc:
        raise ApiError(422, "invalid_spec", str(exc)) from None


def _training_data(body, spec: AdapterSpec) -> dict:
    """A validated body's training data (a prepared dataset, or examples) checked against the
    task: 422 when examples do not fit the head or use labels the task does not have."""
    if body.dataset is not None:
        if is_tagging(body.dataset) != (spec.head == "tagging"):
            need = "tagging" if is_tagging(body.dataset) else "classification"
            raise ApiError(422, "invalid_spec", f"dataset {body.dataset!r} needs a {need} task")
        missing = sorted(set(task_labels(body.dataset)) - set(spec.labels))
        if missing:
            raise ApiError(422, "labels_missing", f"labels {missing} of dataset {body.dataset!r} are not in the task's labels")
        return {"dataset": body.dataset, "max_train": body.max_train}
    tagging = spec.head == "tagging"
    data = {split: check_rows([r.model_dump() for r in getattr(body.training_data, split)], tagging,
                              f"training_data.{split}") for split in ("train", "dev", "test")}
    seen = {t for rows in data.values() for r in rows for t in (r["tags"] if tagging else [r["label"]])}
    missing = sorted(seen - set(spec.labels))
    if missing:
        raise ApiError(422, "labels_missing", f"labels {missing[:10]} occur in the training data but not in task.labels")
    return data


def _decoder_training(body) -> dict:
    """``corpus`` (a prepared corpus name) or ``training_text`` of a validated decoder body."""
    if body.corpus is not None:
        return {"corpus": body.corpus, "max_train": body.max_train}
    texts = body.training_text
    return {"texts": texts[:body.max_train] if body.max_train else texts}


async def _create_decoder_tenant(s: Server, raw: dict) -> web.Response:
    body = parse(s.models["DecoderTenant"], raw)
    gpt = s.require_gpt()
    rank = body.adapter.rank or gpt.rank
    if rank != gpt.rank:
        raise ApiError(422, "invalid_spec", f"this server batches decoder LoRA of rank {gpt.rank}")
    spec = AdapterSpec.decoder(rank=rank, alpha=body.adapter.alpha or None)
    token, job = s.create_tenant(body.name, {"model": "decoder", "domain": "root", "spec": spec.to_dict()},
                                 _decoder_training(body), epochs=body.epochs, model="decoder")
    return web.json_response({"tenant": body.name, "token": token, "job": job,
                              "note": "keep the token: it is shown only once"}, status=202)


async def create_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    raw = await json_body(request)
    if raw.get("model") == "decoder":
        return await _create_decoder_tenant(s, raw)
    body = parse(s.models["EncoderTenant"], raw)
    if body.domain != "root" and body.domain not in s.tree.nodes():
        raise ApiError(404, "unknown_domain", f"no domain {body.domain!r}")
    spec = _spec(body)
    data = _training_data(body, spec)
    token, job = s.create_tenant(body.name, {"domain": body.domain, "spec": spec.to_dict()}, data, epochs=body.epochs,
                                 domain=body.domain)
    return web.json_response({"tenant": body.name, "token": token, "job": job,
                              "note": "keep the token: it is shown only once"}, status=202)


def _parse_for_kind(s: Server, raw: dict, mine: str, other: str, kind: str):
    """The body under the tenant's own update model; a body made for the other kind of tenant
    is a 422 that says so (the document allows both on this route)."""
    try:
        return s.models[mine].model_validate(raw)
    except ValidationError as exc:
        try:
            s.models[other].model_validate(raw)
        except ValidationError:
            raise api_error(exc) from None
        raise ApiError(422, "wrong_tenant_kind", f"this body updates a {'decoder' if kind == 'encoder' else 'encoder'} "
                       f"tenant; this tenant is an {kind} tenant") from None


async def update_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    s.require_owner(request, tenant)
    rec = s.tenant_record(tenant)
    if rec["state"] != "ready":
        raise ApiError(409, "tenant_busy", f"tenant {tenant!r} is {rec['state']}; update it once it is ready")
    raw = await json_body(request)
    if rec.get("model") == "decoder":
        body = _parse_for_kind(s, raw, "DecoderUpdate", "EncoderUpdate", "decoder")
        s.require_gpt()
        job = s.update_tenant(tenant, _decoder_training(body), epochs=body.epochs, model="decoder")
        return web.json_response({"tenant": tenant, "job": job}, status=202)
    body = _parse_for_kind(s, raw, "EncoderUpdate", "DecoderUpdate", "encoder")
    data = _training_data(body, AdapterSpec.from_dict(rec["spec"]))
    job = s.update_tenant(tenant, data, epochs=body.epochs, domain=rec.get("domain", "root"))
    return web.json_response({"tenant": tenant, "job": job}, status=202)


async def delete_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    s.require_owner(request, tenant)
    rec = s.tenant_record(tenant)
    s._entries.pop(tenant, None)  # not servable from this instant
    s._gpt_ready.discard(tenant)
    if s.gpt is not None:
        s.gpt.forget(tenant)
    if rec.get("job"):
        s.jobs.cancel(rec["job"])
    s.registry.delete("tenants", tenant)
    s._token_owner_by_hash.pop(rec.get("token_hash", ""), None)
    s.scheduler.forget(tenant)
    try:
        s.store.delete(tenant)
    except TenantMissingError:
        pass
    return web.json_response({"tenant": tenant, "deleted": True})


async def list_tenants(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    return web.json_response({"tenants": [public_tenant(n, r) for n, r in s.registry.items("tenants")]})


async def get_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    s.require_owner(request, tenant)
    return web.json_response(public_tenant(tenant, s.tenant_record(tenant)))


def _job_for(request) -> tuple[Server, dict]:
    s: Server = request.app[SERVER]
    jid = request.match_info["job"]
    who = s.caller(request)
    job = s.registry.get("jobs", jid)
    if job is None:
        raise ApiError(404, "unknown_job", f"no job {jid!r}")
    if who != "admin" and job.get("tenant") != who:
        raise ApiError(403, "forbidden", f"this token may not see job {jid!r}")
    return s, job


async def get_job(request: web.Request) -> web.Response:
    _, job = _job_for(request)
    return web.json_response(job)


async def cancel_job(request: web.Request) -> web.Response:
    s, job = _job_for(request)
    if not s.jobs.cancel(job["id"]):
        raise ApiError(409, "job_finished", f"job {job['id']} is {job['state']}; only queued or running jobs can be cancelled")
    return web.json_response({"job": job["id"], "cancelling": True}, status=202)


async def list_jobs(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    return web.json_response({"jobs": [j for _, j in s.registry.items("jobs")]})


def _domains(s: Server) -> list[dict]:
    counts: dict[str, int] = {}
    for _, r in s.registry.items("tenants"):
        counts[r.get("domain", "root")] = counts.get(r.get("domain", "root"), 0) + 1
    out = []
    for d in s.tree.listing():
        if d["name"] == "root":
            d = {"name": "root", "parent": None, "depth": 0, "root_artifact": s.root.artifact_id, "alpha": 1.0,
                 "plot": s.lookup.chain[0].store.get_record("stats") or {}}
        out.append({**d, "tenants": counts.get(d["name"], 0)})
    return out


async def list_domains(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    return web.json_response({"domains": _domains(s)})


async def get_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    name = request.match_info["name"]
    for d in _domains(s):
        if d["name"] == name:
            return web.json_response(d)
    raise ApiError(404, "unknown_domain", f"no domain {name!r}")


async def _corpus_body(request: web.Request) -> dict:
    """A JSON body, or a multipart form with a ``corpus`` file (one document per line) and the
    other fields as text, as the dict the domain models validate."""
    if not request.content_type.startswith("multipart/"):
        return await json_body(request)
    try:
        form = await request.post()
    except ValueError as exc:  # no boundary, or a malformed part
        raise ApiError(400, "malformed_multipart", f"the multipart body cannot be read: {exc}") from None
    body = {}
    for k, v in form.items():
        if k == "corpus" and hasattr(v, "file"):
            try:
                body["corpus"] = v.file.read().decode("utf-8").splitlines()
            except UnicodeDecodeError:
                raise ApiError(400, "invalid_corpus", "the corpus file must be UTF-8 text") from None
        elif k in ("alpha", "steps", "max_lines"):
            try:
                body[k] = float(v) if k == "alpha" else int(v)
            except ValueError:
                raise ApiError(400, "invalid_type", f"field {k!r} must be a number") from None
        else:
            body[k] = v
    if "corpus" not in body and "corpus_name" not in body:
        raise ApiError(400, "missing_field", "upload the corpus as a file field named 'corpus'")
    return body


def _corpus_data(body) -> dict:
    """The corpus of a validated domain body: a prepared corpus by name, or lines (422 when too
    few words for a domain)."""
    if body.corpus_name is not None:
        return {"corpus_name": body.corpus_name, "max_lines": body.max_lines, "lines": None}
    lines = [x.strip() for x in body.corpus if x.strip()]
    words = sum(len(x.split()) for x in lines)
    if words < MIN_CORPUS_TOKENS // 2:
        raise ApiError(422, "corpus_too_small", f"the corpus has {words} words; a domain needs about "
                       f"{MIN_CORPUS_TOKENS} tokens (see docs)")
    return {"lines": lines}


def _pending_domain(s: Server, name: str) -> bool:
    return any(j.get("domain") == name and j["kind"].startswith("domain") and j["state"] in ("queued", "running")
               for _, j in s.registry.items("jobs"))


async def create_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    raw = await _corpus_body(request)
    if raw.get("name") == "root":
        raise ApiError(400, "invalid_name", "'root' is the root of every domain tree; choose another name")
    body = parse(s.models["DomainCreate"], raw)
    name, parent = body.name, body.parent
    if name in s.tree.nodes() or _pending_domain(s, name):
        raise ApiError(409, "domain_exists", f"domain {name!r} already exists or is being created")
    if parent != "root" and parent not in s.tree.nodes():
        raise ApiError(404, "unknown_domain", f"no parent domain {parent!r}")
    data = _corpus_data(body)
    s._require_job_room()
    job = s.jobs.submit("domain-create", None, None, data, domain=name, parent=parent, alpha=float(body.alpha),
                        steps=body.steps)
    return web.json_response({"domain": name, "job": job}, status=202)


async def update_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    name = request.match_info["name"]
    if name not in s.tree.nodes():
        hint = " (the root is not updated)" if name == "root" else ""
        raise ApiError(404, "unknown_domain", f"no domain {name!r}{hint}")
    if _pending_domain(s, name):
        raise ApiError(409, "domain_busy", f"domain {name!r} has a job running")
    body = parse(s.models["DomainUpdate"], await _corpus_body(request))
    data = _corpus_data(body)
    s._require_job_room()
    job = s.jobs.submit("domain-update", None, None, data, domain=name, steps=body.steps)
    return web.json_response({"domain": name, "job": job}, status=202)


async def delete_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    s.require_admin(request)
    name = request.match_info["name"]
    if name not in s.tree.nodes():
        raise ApiError(404, "unknown_domain", f"no domain {name!r}")
    in_use = {r.get("domain") for _, r in s.registry.items("tenants")}
    try:
        s.tree.delete(name, in_use)
    except DomainError as exc:
        raise ApiError(409, "domain_in_use", str(exc)) from None
    s.domain_changed(name)
    return web.json_response({"domain": name, "deleted": True})


async def healthz(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    return web.json_response({"status": "ok", "uptime_s": round(time.time() - s.started, 1),
                              "tenants_servable": len(s._entries), "root_artifact": s.root.artifact_id})


async def metrics(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    m = s.metrics
    m.queue_depth.set(s.scheduler.queue_depth())
    for stage, secs in s.scheduler.tracer.stage_seconds().items():
        m.stage_seconds.labels(stage).set(secs)
    for level, n in dict(s.lookup.hits).items():
        m.plot_hits.labels(level).set(n)
    res = s.scheduler.residency.stats()
    m.adapter_hits.labels("device").set(res["device_hits"])
    m.adapter_hits.labels("host").set(s.store.stats["host_hits"])
    m.adapter_hits.labels("disk").set(s.store.stats["disk_loads"])
    counts = {st: 0 for st in ("queued", "running", "succeeded", "failed", "cancelled")}
    for _, j in s.registry.items("jobs"):
        counts[j["state"]] = counts.get(j["state"], 0) + 1
    for st, n in counts.items():
        m.jobs.labels(st).set(n)
    return web.Response(body=m.render(), content_type="text/plain")


async def openapi(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    return web.json_response(openapi_document(request.app, s.models))


# -- app -----------------------------------------------------------------------------------------
@web.middleware
async def errors_and_logs(request: web.Request, handler):
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    start = time.perf_counter()
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        resp = await handler(request)
    except ApiError as exc:
        resp = error_response(exc.status, exc.code, exc.message, exc.headers)
    except web.HTTPRequestEntityTooLarge as exc:
        resp = error_response(413, "body_too_large", f"the body exceeds the limit: {exc.text}")
    except web.HTTPNotFound:
        resp = error_response(404, "not_found", f"no route {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        resp = error_response(405, "method_not_allowed", f"{request.method} is not allowed here; use {allowed}",
                              {"Allow": allowed})
    except web.HTTPException as exc:
        resp = error_response(exc.status, "http_error", exc.reason)
    except Exception:  # noqa: BLE001 - logged; the client sees a 500 without internals
        log.exception("unhandled error", extra={"request_id": rid})
        resp = error_response(500, "internal", f"internal error; request id {rid}")
    resp.headers["X-Request-Id"] = rid
    s = request.app.get(SERVER)
    if s is not None:
        s.metrics.requests.labels(route, str(resp.status)).inc()
        s.metrics.latency.labels(route).observe(time.perf_counter() - start)
    log.info(json.dumps({"request_id": rid, "method": request.method, "path": request.path, "route": route,
                         "status": resp.status, "ms": round((time.perf_counter() - start) * 1000, 2)}))
    return resp


ROUTES = [
    ("POST", "/v1/tenants/{tenant}/infer", infer),
    ("POST", "/v1/tenants/{tenant}/generate", generate),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/tenants", create_tenant),
    ("GET", "/v1/tenants", list_tenants),
    ("GET", "/v1/tenants/{tenant}", get_tenant),
    ("POST", "/v1/tenants/{tenant}/update", update_tenant),
    ("DELETE", "/v1/tenants/{tenant}", delete_tenant),
    ("POST", "/v1/domains", create_domain),
    ("POST", "/v1/domains/{name}/update", update_domain),
    ("DELETE", "/v1/domains/{name}", delete_domain),
    ("GET", "/v1/domains", list_domains),
    ("GET", "/v1/domains/{name}", get_domain),
    ("GET", "/v1/jobs", list_jobs),
    ("GET", "/v1/jobs/{job}", get_job),
    ("DELETE", "/v1/jobs/{job}", cancel_job),
    ("GET", "/healthz", healthz),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
]


def make_app(server: Server) -> web.Application:
    app = web.Application(middlewares=[errors_and_logs], client_max_size=int(server.cfg.max_body_mb * 2**20))
    app[SERVER] = server
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)

    async def on_cleanup(app):
        await asyncio.get_running_loop().run_in_executor(None, server.shutdown)

    app.on_cleanup.append(on_cleanup)
    return app
