"""The aiohttp application: the route table of docs/design.md (section 7), error handling and
request logging around every route."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
import uuid

from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.routes_base import linear, lower
from hmi.dispatcher.routes_domains import create_domain, delete_domain, get_domain, list_domains, update_domain
from hmi.dispatcher.routes_embeddings import embeddings, list_models
from hmi.dispatcher.routes_generate import completions, generate
from hmi.dispatcher.routes_ops import (
    cancel_job,
    console_file,
    console_index,
    get_job,
    healthz,
    list_jobs,
    me,
    metrics,
    metrics_history,
    openapi,
    refresh_metrics,
)
from hmi.dispatcher.routes_tenants import (
    create_tenant,
    delete_tenant,
    download_adapter,
    get_tenant,
    infer,
    list_tenants,
    set_share,
    update_tenant,
    upload_adapter,
)
from hmi.dispatcher.validation import ApiError, as_api_error, error_response
from hmi.errors import Refusal
from hmi.services.registry import RegistryUnavailable
from hmi.services.server import Server

log = logging.getLogger("hmi.server")
HISTORY_TASK = web.AppKey("history_task", asyncio.Task)


@web.middleware
async def errors_and_logs(request: web.Request, handler):
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    start = time.perf_counter()
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        try:
            resp = await handler(request)
        except Refusal as exc:
            raise as_api_error(exc) from None
    except ApiError as exc:
        resp = error_response(exc.status, exc.code, exc.message, exc.headers)
        if exc.code == "over_share":  # the gate in front, if any, refuses this tenant's next requests itself
            gate_refuses(request)
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
    except RegistryUnavailable as exc:
        log.warning("registry unavailable", extra={"request_id": rid}, exc_info=True)
        resp = error_response(503, "registry_unavailable", f"{exc}; try again", {"Retry-After": "1"})
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.exception("unhandled error", extra={"request_id": rid})
            resp = error_response(500, "internal", f"internal error; request id {rid}")
        else:  # nothing of the request was kept (atomic writes): the client may send it again once there is space
            log.error("the disk is full: %s", exc, extra={"request_id": rid})
            resp = error_response(507, "insufficient_storage", "the server's disk is full, so nothing of this request "
                                  "was kept; try again once the operator has freed space")
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


def gate_refuses(request: web.Request) -> None:
    """Marks the tenant of a request refused over its share at the server's gate with its fair rate
    of inference (hmi.dispatcher.gate; a decoder tenant refused generation: the gate's least, one
    request a second)."""
    s = request.app.get(SERVER)
    tenant = request.match_info.get("tenant")
    if s is not None and s.gate is not None and tenant:
        s.gate.refuse(tenant, s.batcher.fair_rate(tenant) if request.path.endswith("/infer") else 1.0)


ROUTES = [
    ("POST", "/v1/tenants/{tenant}/infer", infer),
    ("POST", "/v1/tenants/{tenant}/generate", generate),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/embeddings", embeddings),
    ("GET", "/v1/models", list_models),
    ("POST", "/v1/tenants", create_tenant),
    ("GET", "/v1/tenants", list_tenants),
    ("GET", "/v1/tenants/{tenant}", get_tenant),
    ("POST", "/v1/tenants/{tenant}/update", update_tenant),
    ("POST", "/v1/tenants/{tenant}/share", set_share),
    ("DELETE", "/v1/tenants/{tenant}", delete_tenant),
    ("POST", "/v1/tenants/{tenant}/adapter", upload_adapter),
    ("GET", "/v1/tenants/{tenant}/adapter", download_adapter),
    ("POST", "/v1/domains", create_domain),
    ("POST", "/v1/domains/{name}/update", update_domain),
    ("DELETE", "/v1/domains/{name}", delete_domain),
    ("GET", "/v1/domains", list_domains),
    ("GET", "/v1/domains/{name}", get_domain),
    ("GET", "/v1/jobs", list_jobs),
    ("GET", "/v1/jobs/{job}", get_job),
    ("DELETE", "/v1/jobs/{job}", cancel_job),
    ("POST", "/v1/base/lower", lower),
    ("POST", "/v1/base/layers/{layer}/{projection}/{operation}", linear),
    ("GET", "/healthz", healthz),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/metrics/history", metrics_history),
    ("GET", "/openapi.json", openapi),
    ("GET", "/v1/me", me),
    ("GET", "/", console_index),
    ("GET", "/console/{file}", console_file),
]


def make_app(server: Server) -> web.Application:
    app = web.Application(middlewares=[errors_and_logs], client_max_size=int(server.cfg.max_body_mb * 2**20))
    app[SERVER] = server
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)

    async def keep_history():  # the console's last hour, sampled here whether or not a console is open
        while True:
            try:
                server.history.record(server.metrics, await refresh_metrics(server))
            except Exception:  # a sample missed (the registry closing at shutdown) costs nothing else
                log.exception("could not sample the metrics' history")
            await asyncio.sleep(server.history.interval_s)

    async def on_startup(app):
        app[HISTORY_TASK] = asyncio.get_running_loop().create_task(keep_history())

    async def on_cleanup(app):
        app[HISTORY_TASK].cancel()
        await asyncio.get_running_loop().run_in_executor(None, server.shutdown)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
