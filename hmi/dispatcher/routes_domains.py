"""HTTP routes of domains: create, update, delete, list and read (docs/design.md, section 7)."""

from __future__ import annotations

from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.registry import UNFINISHED
from hmi.dispatcher.schemas import parse
from hmi.dispatcher.server import Server
from hmi.dispatcher.validation import ApiError, json_body
from hmi.version_tree.tree import MIN_CORPUS_TOKENS, DomainError


async def _domains(s: Server) -> list[dict]:
    counts: dict[str, int] = {}
    for _, r in await s.registry.aitems("tenants"):
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
    await s.auth.require_admin(request)
    return web.json_response({"domains": await _domains(s)})


async def get_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(request)
    name = request.match_info["name"]
    for d in await _domains(s):
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


async def _pending_domain(s: Server, name: str) -> bool:
    return any(j.get("domain") == name and j["kind"].startswith("domain") and j["state"] in UNFINISHED
               for _, j in await s.registry.aitems("jobs"))


async def create_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(request)
    raw = await _corpus_body(request)
    if raw.get("name") == "root":
        raise ApiError(400, "invalid_name", "'root' is the root of every domain tree; choose another name")
    body = parse(s.models["DomainCreate"], raw)
    name, parent = body.name, body.parent
    if name in s.tree.nodes() or await _pending_domain(s, name):
        raise ApiError(409, "domain_exists", f"domain {name!r} already exists or is being created")
    if parent != "root" and parent not in s.tree.nodes():
        raise ApiError(404, "unknown_domain", f"no parent domain {parent!r}")
    data = _corpus_data(body)
    s.jobs.require_room()
    job = s.jobs.submit("domain-create", None, None, data, domain=name, parent=parent, alpha=float(body.alpha),
                        steps=body.steps, objective=body.objective)
    return web.json_response({"domain": name, "job": job}, status=202)


async def update_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(request)
    name = request.match_info["name"]
    if name not in s.tree.nodes():
        hint = " (the root is not updated)" if name == "root" else ""
        raise ApiError(404, "unknown_domain", f"no domain {name!r}{hint}")
    if await _pending_domain(s, name):
        raise ApiError(409, "domain_busy", f"domain {name!r} has a job running")
    body = parse(s.models["DomainUpdate"], await _corpus_body(request))
    data = _corpus_data(body)
    s.jobs.require_room()
    job = s.jobs.submit("domain-update", None, None, data, domain=name, steps=body.steps, objective=body.objective)
    return web.json_response({"domain": name, "job": job}, status=202)


async def delete_domain(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(request)
    name = request.match_info["name"]
    if name not in s.tree.nodes():
        raise ApiError(404, "unknown_domain", f"no domain {name!r}")
    in_use = {r.get("domain") for _, r in await s.registry.aitems("tenants")}
    try:
        s.tree.delete(name, in_use)
    except DomainError as exc:
        raise ApiError(409, "domain_in_use", str(exc)) from None
    s.domain_changed(name)
    return web.json_response({"domain": name, "deleted": True})
