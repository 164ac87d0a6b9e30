"""HTTP routes of operations: jobs (read, list, cancel), health, Prometheus metrics and the
OpenAPI document."""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.openapi import openapi_document
from hmi.dispatcher.schemas import models_of
from hmi.dispatcher.validation import ApiError, bearer
from hmi.services.server import Server


async def _job_for(request) -> tuple[Server, dict]:
    s: Server = request.app[SERVER]
    jid = request.match_info["job"]
    who = await s.auth.caller(bearer(request))
    job = await s.registry.aget("jobs", jid)
    if job is None:
        raise ApiError(404, "unknown_job", f"no job {jid!r}")
    if who != "admin" and job.get("tenant") != who:
        raise ApiError(403, "forbidden", f"this token may not see job {jid!r}")
    return s, job


async def get_job(request: web.Request) -> web.Response:
    _, job = await _job_for(request)
    return web.json_response(job)


async def cancel_job(request: web.Request) -> web.Response:
    s, job = await _job_for(request)
    if not s.jobs.cancel(job["id"]):
        raise ApiError(409, "job_finished", f"job {job['id']} is {job['state']}; only queued or running jobs can be cancelled")
    return web.json_response({"job": job["id"], "cancelling": True}, status=202)


async def list_jobs(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await s.auth.require_admin(bearer(request))
    return web.json_response({"jobs": [j for _, j in await s.registry.aitems("jobs")]})


async def healthz(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    return web.json_response({"status": "ok", "uptime_s": round(time.time() - s.started, 1),
                              "tenants_servable": s.served.count(), "tenants_whole": s.served.count_whole(),
                              "root_artifact": s.root.artifact_id,
                              "registry": s.registry.where, "preparing": s.preparing(),
                              "upper_precision": s.scheduler.cfg.upper_precision, "miss_policy": s.lookup.policy})


async def refresh_metrics(s: Server) -> dict[str, float]:
    """Sets the gauges that read the server's state (queue, stages, PLOT hits, residency, jobs);
    returns each running job's progress by ``"<kind> <tenant or domain>"``."""
    m = s.metrics
    m.queue_depth.set(s.scheduler.queue_depth())
    for stage, secs in s.scheduler.tracer.stage_seconds().items():
        m.stage_seconds.labels(stage).set(secs)
    for domain, lookup in s.domains.lookups().items():
        for level, n in dict(lookup.hits).items():
            m.plot_hits.labels(domain, level).set(n)
        if lookup.keeper is not None:
            m.plot_kept.labels(domain).set(lookup.chain[0].store.kept_count())
    if s.lookup.keeper is not None:
        for event in ("queued", "added", "evicted", "failed"):
            m.plot_keeper.labels(event).set(s.lookup.keeper.stats[event])
    res = s.scheduler.residency.stats()
    m.adapter_hits.labels("device").set(res["device_hits"])
    m.adapter_hits.labels("host").set(s.store.stats["host_hits"])
    m.adapter_hits.labels("disk").set(s.store.stats["disk_loads"])
    m.host_cache.set(s.store.host_bytes)
    counts = {st: 0 for st in ("queued", "running", "succeeded", "failed", "cancelled")}
    running = {}
    for _, j in await s.registry.aitems("jobs"):
        counts[j["state"]] = counts.get(j["state"], 0) + 1
        if j["state"] == "running":
            running[f"{j.get('kind')} {j.get('tenant') or j.get('domain')}"] = j.get("progress") or 0
    for st, n in counts.items():
        m.jobs.labels(st).set(n)
    return running


async def metrics(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    await refresh_metrics(s)
    return web.Response(body=s.metrics.render(), content_type="text/plain")


async def metrics_history(request: web.Request) -> web.Response:
    """The last hour of the series the console charts (``hmi.services.metrics.History``)."""
    s: Server = request.app[SERVER]
    return web.json_response(s.history.as_json())


async def openapi(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    return web.json_response(openapi_document(request.app, models_of(s)))


async def me(request: web.Request) -> web.Response:
    """Who the token belongs to: ``admin`` or a tenant's name."""
    s: Server = request.app[SERVER]
    return web.json_response({"caller": await s.auth.caller(bearer(request))})


CONSOLE = Path(__file__).with_name("console")
CONSOLE_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


async def console_index(request: web.Request) -> web.Response:
    """The web console (static files shipped in the package; the token is typed in the page)."""
    return web.Response(body=(CONSOLE / "index.html").read_bytes(), content_type="text/html", charset="utf-8")


async def console_file(request: web.Request) -> web.Response:
    name = request.match_info["file"]
    path = CONSOLE / name
    if name not in {p.name for p in CONSOLE.iterdir()} or path.suffix not in CONSOLE_TYPES:
        raise ApiError(404, "not_found", f"no console file {name!r}")
    return web.Response(body=path.read_bytes(), content_type=CONSOLE_TYPES[path.suffix], charset="utf-8")
