"""HTTP routes of domains: create, update, delete, list and read (docs/design.md, section 7)."""

from __future__ import annotations

from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.schemas import models_of, parse
from hmi.dispatcher.validation import ApiError, bearer, json_body
from hmi.services.server import Server


async def list_domains(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    return web.json_response({"domains": await s.domains.listing()})


async def get_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    return web.json_response(await s.domains.get(request.match_info["name"]))


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


def _text(body) -> dict:
    """The corpus fields of a validated domain body (``hmi.services.domains.corpus_data``)."""
    return {"corpus_name": body.corpus_name, "max_lines": body.max_lines, "corpus": body.corpus}


async def create_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    raw = await _corpus_body(request)
    s.domains.check_name(raw.get("name"))
    body = parse(models_of(s)["DomainCreate"], raw)
    job = await s.domains.create(body.name, body.parent, _text(body), alpha=float(body.alpha), steps=body.steps,
                                 objective=body.objective)
    return web.json_response({"domain": body.name, "job": job}, status=202)


async def update_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    name = request.match_info["name"]
    await s.domains.check_updatable(name)
    body = parse(models_of(s)["DomainUpdate"], await _corpus_body(request))
    job = await s.domains.update(name, _text(body), steps=body.steps, objective=body.objective)
    return web.json_response({"domain": name, "job": job}, status=202)


async def delete_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    name = request.match_info["name"]
    await s.domains.delete(name)
    return web.json_response({"domain": name, "deleted": True})
