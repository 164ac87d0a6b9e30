"""HTTP routes of tenants: infer, create, update, delete, list and read (docs/design.md, section 7)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from pydantic import ValidationError

from hmi.adapters.portable import read_decoder, read_encoder, write_decoder, write_encoder
from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.archive import ArchiveError, unzip, zip_files
from hmi.data import is_tagging, job_rows, task_labels
from hmi.dispatcher.context import SERVER
from hmi.dispatcher.schemas import ROOT_MODEL, api_error, models_of, parse
from hmi.dispatcher.validation import ApiError, as_api_error, bearer, check_rows, json_body, refused
from hmi.errors import Refusal
from hmi.names import is_valid_name
from hmi.scheduler.types import InferRequest, QueueFullError, SchedulerClosedError, TenantEntry
from hmi.services.server import Server
from hmi.services.tenants import is_private, private_error
from hmi.textlimit import TooLongError
from hmi.training.examples import encode


def public_tenant(s: Server, name: str, rec: dict) -> dict:
    """A tenant's record as the API shows it, with its usage and residency tier; encoder tenants
    also state how texts are read: ``max_tokens`` (the server's limit) and ``truncate``."""
    keep = ("state", "model", "domain", "spec", "metrics", "error", "created", "updated", "version", "job")
    out = {"name": name, **{k: rec.get(k) for k in keep if k in rec}, **s.usage.report(name, rec)}
    if rec.get("model", "encoder") == "encoder":
        out.update(max_tokens=s.cfg.max_len, truncate=rec.get("truncate", False), weight=rec.get("weight", 1.0))
    return out


async def infer(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    await s.auth.require_owner(bearer(request), tenant)
    admit(s, tenant)  # a tenant over its share is refused before its body is read
    body = parse(models_of(s)["InferBody"], await json_body(request))
    entry = await servable_entry(s, tenant)
    truncate = body.truncate if body.truncate is not None else entry.truncate
    outputs = await run_requests(s, [InferRequest(tenant, x, truncate=truncate) for x in body.inputs])
    return web.json_response({"tenant": tenant, "outputs": outputs})


async def servable_entry(s: Server, tenant: str) -> TenantEntry:
    """The serving entry of an encoder tenant whose adapter is published; 404 for no such tenant,
    409 for a private tenant or one whose first job has not succeeded, 422 for a decoder tenant."""
    try:
        return await s.tenants.resolve(tenant)
    except Refusal:
        rec = await s.registry.aget("tenants", tenant)
        if rec is None:
            raise ApiError(404, "unknown_tenant", f"no tenant {tenant!r}") from None
        if is_private(rec):
            raise private_error(tenant, "this server does not run its model") from None
        if rec.get("model") == "decoder":
            raise ApiError(422, "not_an_encoder_tenant", f"tenant {tenant!r} is a decoder tenant; use "
                           "/v1/completions or /v1/tenants/{tenant}/generate") from None
        raise ApiError(409, "tenant_not_ready", f"tenant {tenant!r} is {rec['state']}; it serves once its job succeeds") \
            from None


def admit(s: Server, tenant: str | None, n: int = 1) -> None:
    """429 at once when the batcher would refuse ``n`` more requests of ``tenant`` (None: the root's)."""
    try:
        s.batcher.admit(tenant or "", n)
    except QueueFullError as exc:
        raise refused(exc) from None


async def run_requests(s: Server, reqs: list[InferRequest]) -> list:
    """Queues one HTTP call's requests (one model) in the cross-tenant batcher and awaits their
    answers; the scheduler's errors become the call's HTTP errors (429 at capacity, 503 when
    shutting down or past the server's inference timeout)."""
    tenant = reqs[0].tenant or "root"
    try:
        s.batcher.add(reqs)  # admits them (Batcher.admit) or refuses them all
    except QueueFullError as exc:
        raise refused(exc) from None
    s.metrics.tenant_infer.labels(s.metrics.tenant_label(tenant)).inc(len(reqs))
    start = time.perf_counter()
    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(r.future) for r in reqs)),
                                         s.cfg.infer_timeout_s)
    except Refusal as exc:
        raise as_api_error(exc) from None
    except QueueFullError as exc:  # a batch the scheduler refused
        raise refused(exc) from None
    except SchedulerClosedError:
        raise ApiError(503, "shutting_down", "the server is shutting down") from None
    except asyncio.TimeoutError:
        raise ApiError(503, "timeout", "inference did not finish in time; retry") from None
    if reqs[0].tenant is not None:
        s.usage.record(tenant, len(reqs), time.perf_counter() - start)
    return outputs


def _spec(body) -> AdapterSpec:
    """The AdapterSpec of a validated EncoderTenant body (no kind: the task's default adapter);
    422 for combinations the spec refuses."""
    a = body.adapter
    try:
        return AdapterSpec.for_task(body.task.type, body.task.labels, a.kind, pooling=body.task.pooling,
                                    reduction_factor=a.reduction_factor, rank=a.rank, alpha=a.alpha, targets=a.targets)
    except SpecError as exc:
        raise ApiError(422, "invalid_spec", str(exc)) from None


def _teaching(s: Server, body) -> dict:
    """A fine-tune's ``distil`` and ``serving`` (the body's, else the server's); 400 for serving
    whole without the teacher it serves."""
    distil = s.cfg.distil if body.distil is None else body.distil
    serving = s.cfg.serving if body.serving is None else body.serving
    if serving == "whole" and not distil:
        raise ApiError(400, "serving_needs_teacher", "serving whole serves the distilled fine-tune's teacher; "
                       "send \"distil\": true or another serving (windows, auto)")
    return {"distil": distil, "serving": serving}


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
        out = {"dataset": body.dataset, "max_train": body.max_train}
        return out if body.max_eval is None else {**out, "max_eval": body.max_eval}
    tagging = spec.head == "tagging"
    data = {split: check_rows([r.model_dump() for r in getattr(body.training_data, split)], tagging,
                              f"training_data.{split}") for split in ("train", "dev", "test")}
    seen = {t for rows in data.values() for r in rows for t in (r["tags"] if tagging else [r["label"]])}
    missing = sorted(seen - set(spec.labels))
    if missing:
        raise ApiError(422, "labels_missing", f"labels {missing[:10]} occur in the training data but not in task.labels")
    if body.training_data.unlabeled:
        data["unlabeled"] = list(body.training_data.unlabeled)
    held = body.training_data.hold_out
    if held and data["dev"]:
        raise ApiError(422, "hold_out_with_dev", "training_data.hold_out makes a dev split of training rows; "
                       "training_data.dev already gives one: send one of them")
    if held is not None and held >= len(data["train"]):
        raise ApiError(422, "hold_out_too_large", f"training_data.hold_out is {held}, but training_data.train has "
                       f"{len(data['train'])} rows: at least one must be left to train on")
    return data if held is None else {**data, "hold_out": held}


async def _check_lengths(s: Server, data: dict, spec: AdapterSpec, truncate: bool) -> None:
    """Unless the tenant truncates, every training text must fit the server's limit as inference
    reads it: 413 naming the first one that does not (tokenized off the event loop)."""
    if truncate:
        return

    def first_too_long() -> str | None:
        for split, rows in zip(("train", "dev", "test"), job_rows(data)):
            try:
                encode(s.root.tokenizer, rows, spec, s.cfg.max_len, truncate=False)
            except TooLongError as exc:
                where = f"dataset {data['dataset']!r}, {split} split" if data.get("dataset") else f"training_data.{split}"
                return f"{where}, row {exc.row}: {exc.n_tokens} tokens; the limit is {exc.limit}"
        return None

    found = await asyncio.get_running_loop().run_in_executor(None, first_too_long)
    if found:
        raise ApiError(413, "input_too_long", f"{found}. Create the tenant with \"truncate\": true to cut texts "
                       "to the limit in training and inference alike")


def _decoder_training(body) -> dict:
    """``corpus`` (a prepared corpus name) or ``training_text`` of a validated decoder body."""
    if body.corpus is not None:
        return {"corpus": body.corpus, "max_train": body.max_train}
    texts = body.training_text
    return {"texts": texts[:body.max_train] if body.max_train else texts}


async def _create_decoder_tenant(s: Server, raw: dict) -> dict:
    body = parse(models_of(s)["DecoderTenant"], raw)
    gpt = s.decoders.require()
    rank = body.adapter.rank or gpt.rank
    if rank != gpt.rank:
        raise ApiError(422, "invalid_spec", f"this server batches decoder LoRA of rank {gpt.rank}")
    spec = AdapterSpec.decoder(rank=rank, alpha=body.adapter.alpha or None)
    token, job = s.tenants.create(body.name, {"model": "decoder", "domain": "root", "spec": spec.to_dict()},
                                  _decoder_training(body), epochs=body.epochs, model="decoder")
    return {"tenant": body.name, "token": token, "job": job}


async def create_from_body(s: Server, raw: dict) -> dict:
    """Creates a tenant from a ``POST /v1/tenants`` body (encoder or decoder) and queues its first
    fine-tune job; returns ``{"tenant", "token", "job"}``.  Raises ApiError for what the body gets
    wrong (the route's answers)."""
    if raw.get("model") == "decoder":
        return await _create_decoder_tenant(s, raw)
    if raw.get("model") == "private":
        body = parse(models_of(s)["PrivateTenant"], raw)
        return {"tenant": body.name, "token": s.tenants.create_private(body.name), "job": None}
    body = parse(models_of(s)["EncoderTenant"], raw)
    if body.domain != "root" and body.domain not in s.tree.nodes():
        raise ApiError(404, "unknown_domain", f"no domain {body.domain!r}")
    spec = _spec(body)
    data = _training_data(body, spec)
    await _check_lengths(s, data, spec, body.truncate)
    # a pooling asked for is kept; without one, dev chooses it with the learning rate (hmi.training.finetune.dev_options)
    given = body.task.pooling is not None
    token, job = s.tenants.create(body.name, {"domain": body.domain, "spec": spec.to_dict(), "truncate": body.truncate,
                                              **({"pooling_given": True} if given else {})},
                                  data, epochs=body.epochs, domain=body.domain, truncate=body.truncate,
                                  max_len=s.cfg.max_len, keep_pooling=given, **_teaching(s, body))
    return {"tenant": body.name, "token": token, "job": job}


async def create_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    out = await create_from_body(s, await json_body(request))
    return web.json_response({**out, "note": "keep the token: it is shown only once"},
                             status=202 if out["job"] else 201)


def _parse_for_kind(s: Server, raw: dict, mine: str, other: str, kind: str):
    """The body under the tenant's own update model; a body made for the other kind of tenant
    is a 422 that says so (the document allows both on this route)."""
    try:
        return models_of(s)[mine].model_validate(raw)
    except ValidationError as exc:
        try:
            models_of(s)[other].model_validate(raw)
        except ValidationError:
            raise api_error(exc) from None
        raise ApiError(422, "wrong_tenant_kind", f"this body updates a {'decoder' if kind == 'encoder' else 'encoder'} "
                       f"tenant; this tenant is an {kind} tenant") from None


async def update_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    await s.auth.require_owner(bearer(request), tenant)
    rec = await s.tenants.record(tenant)
    if is_private(rec):
        raise private_error(tenant, "there is nothing of it to train here")
    if rec["state"] != "ready":
        raise ApiError(409, "tenant_busy", f"tenant {tenant!r} is {rec['state']}; update it once it is ready")
    raw = await json_body(request)
    if rec.get("model") == "decoder":
        body = _parse_for_kind(s, raw, "DecoderUpdate", "EncoderUpdate", "decoder")
        s.decoders.require()
        job = s.tenants.update(tenant, _decoder_training(body), epochs=body.epochs, model="decoder")
        return web.json_response({"tenant": tenant, "job": job}, status=202)
    body = _parse_for_kind(s, raw, "EncoderUpdate", "DecoderUpdate", "encoder")
    spec, truncate = AdapterSpec.from_dict(rec["spec"]), rec.get("truncate", False)
    data = _training_data(body, spec)
    await _check_lengths(s, data, spec, truncate)
    job = s.tenants.update(tenant, data, epochs=body.epochs, domain=rec.get("domain", "root"), truncate=truncate,
                          max_len=s.cfg.max_len, keep_pooling=rec.get("pooling_given", False), **_teaching(s, body))
    return web.json_response({"tenant": tenant, "job": job}, status=202)


async def set_share(request: web.Request) -> web.Response:
    """``POST /v1/tenants/{tenant}/share``: the tenant's weight in the batches (admin)."""
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    tenant = request.match_info["tenant"]
    body = parse(models_of(s)["ShareBody"], await json_body(request))
    rec = s.tenants.set_weight(tenant, body.weight)
    return web.json_response({"tenant": tenant, "weight": rec["weight"]})


async def delete_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    await s.auth.require_owner(bearer(request), tenant)
    rec = await s.tenants.record(tenant)
    s.tenants.delete(tenant, rec)
    return web.json_response({"tenant": tenant, "deleted": True})


async def list_tenants(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    return web.json_response({"tenants": [public_tenant(s, n, r) for n, r in await s.registry.aitems("tenants")]})


async def get_tenant(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    await s.auth.require_owner(bearer(request), tenant)
    return web.json_response(public_tenant(s, tenant, await s.tenants.record(tenant)))


async def upload_adapter(request: web.Request) -> web.Response:
    """``POST /v1/tenants/{tenant}/adapter``: a zip of the adapters library's saved folder
    (encoder tenants) or of PEFT's LoRA folder (decoder tenants, ``?model=decoder``).  A new name
    creates a ready tenant (admin; 201 with its token); an existing tenant's owner replaces its
    adapter (200)."""
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    if not is_valid_name(tenant):
        raise ApiError(400, "invalid_name", f"{tenant!r} is not a tenant name (1-63 characters a-z, 0-9, '_' or '-')")
    rec = await s.registry.aget("tenants", tenant)
    asked = request.query.get("model")
    if asked not in (None, "encoder", "decoder"):
        raise ApiError(400, "invalid_model", f"model must be encoder or decoder, not {asked!r}")
    truncate = request.query.get("truncate", "false")
    if truncate not in ("true", "false"):
        raise ApiError(400, "invalid_truncate", f"truncate must be true or false, not {truncate!r}")
    if rec is None:
        await s.auth.require_admin(bearer(request))
        if tenant == ROOT_MODEL:
            raise ApiError(400, "invalid_name", "'root' names the shared root model; choose another name")
        model = asked or "encoder"
    else:
        await s.auth.require_owner(bearer(request), tenant)
        if is_private(rec):
            raise private_error(tenant, "its adapter stays on its own side")
        model = rec.get("model", "encoder")
        if asked not in (None, model):
            raise ApiError(422, "wrong_tenant_kind", f"tenant {tenant!r} is an {model} tenant")
    if request.content_type not in ("application/zip", "application/octet-stream"):
        raise ApiError(415, "unsupported_media_type", "send the adapter's saved folder as a zip archive "
                       f"(Content-Type: application/zip), not {request.content_type}")
    data = await request.read()
    shape = s.transfer.root_shape(model)

    def read():
        files = unzip(data, int(s.cfg.max_body_mb * 2**20))
        return read_decoder(files, shape, s.decoders.runtime.rank) if model == "decoder" else read_encoder(files, shape)

    try:
        spec, weights = await asyncio.get_running_loop().run_in_executor(None, read)
    except ArchiveError as exc:  # a PortableError too
        raise as_api_error(exc) from None
    if model == "encoder" and spec.num_labels > s.cfg.max_labels:
        raise ApiError(422, "too_many_labels", f"the head has {spec.num_labels} labels; this server serves at most "
                       f"{s.cfg.max_labels}")
    token = await asyncio.get_running_loop().run_in_executor(
        None, lambda: s.transfer.import_adapter(tenant, model, spec, weights, truncate=truncate == "true"))
    out = {"tenant": tenant, "model": model, "spec": spec.to_dict(), "state": "ready"}
    if token is None:
        return web.json_response(out)
    return web.json_response({**out, "token": token, "note": "keep the token: it is shown only once"}, status=201)


async def download_adapter(request: web.Request) -> web.Response:
    """``GET /v1/tenants/{tenant}/adapter``: the tenant's published adapter as a zip of the
    adapters library's saved folder (encoder) or PEFT's LoRA folder (decoder); owner or admin."""
    s: Server = request.app[SERVER]
    tenant = request.match_info["tenant"]
    await s.auth.require_owner(bearer(request), tenant)
    rec = await s.tenants.record(tenant)
    if is_private(rec):
        raise private_error(tenant, "its adapter is not on the server")
    spec, weights, model = s.transfer.export_adapter(tenant, rec)
    shape = s.transfer.root_shape(model)

    def write() -> bytes:
        files = write_decoder(spec, weights, shape) if model == "decoder" else write_encoder(spec, weights, shape, tenant)
        return zip_files(files, tenant)

    body = await asyncio.get_running_loop().run_in_executor(None, write)
    return web.Response(body=body, content_type="application/zip",
                        headers={"Content-Disposition": f'attachment; filename="{tenant}-adapter.zip"'})
