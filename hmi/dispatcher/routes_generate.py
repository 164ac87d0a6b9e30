"""HTTP routes of decoder tenants (hGPT): ``POST /v1/tenants/{tenant}/generate`` and the
OpenAI-style ``POST /v1/completions`` (``model`` names the tenant), both optionally streaming
tokens as they are produced (NDJSON lines, or server-sent events for completions)."""

from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid

from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.schemas import models_of, parse
from hmi.dispatcher.validation import ApiError, as_api_error, bearer, json_body, refused
from hmi.hgpt.generation import GenerationError, GenRequest, ServiceClosedError
from hmi.scheduler.fair import TenantQueueFullError


async def _decoder_tenant(s, tenant: str) -> None:
    s.decoders.require()
    rec = await s.registry.aget("tenants", tenant)
    if rec is None:
        raise ApiError(404, "unknown_tenant", f"no tenant {tenant!r}")
    if rec.get("model") != "decoder":
        raise ApiError(422, "not_a_decoder_tenant", f"tenant {tenant!r} is an encoder tenant; use /v1/tenants/{tenant}/infer")
    if not s.served.decoder_ready(tenant):
        raise ApiError(409, "tenant_not_ready", f"tenant {tenant!r} is {rec['state']}; it serves once its job succeeds")


async def _start(s, tenant: str, body, max_new_tokens: int):
    """Checks the tenant, queues the request of a validated body; returns (request, stream sink or None)."""
    await _decoder_tenant(s, tenant)
    sink: asyncio.Queue | None = asyncio.Queue() if body.stream else None
    req = _request(s, tenant, body, max_new_tokens, asyncio.get_running_loop(), sink)
    s.metrics.tenant_infer.labels(s.metrics.tenant_label(tenant)).inc()
    return req, sink


def _request(s, tenant: str, body, max_new_tokens: int, loop, sink):
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    req = GenRequest(tenant, body.prompt, max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                     seed=body.seed, stop=tuple(stop),
                     on_text=(lambda piece: loop.call_soon_threadsafe(sink.put_nowait, piece)) if sink is not None else None)
    try:
        s.decoders.runtime.service.submit(req)
    except GenerationError as exc:
        raise as_api_error(exc) from None
    except TenantQueueFullError as exc:
        raise refused(exc) from None
    except queue.Full:
        raise ApiError(429, "overloaded", "the generation queue is full; retry shortly", {"Retry-After": "1"}) from None
    except ServiceClosedError:
        raise ApiError(503, "shutting_down", "the server is shutting down") from None
    return req


def _gone(request: web.Request) -> bool:
    """Whether the client closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _outcome(request, s, req, sink: asyncio.Queue | None = None):
    """Waits for the request's result (or, with a sink, its next piece of text).  A client that
    disconnects or a request past its time limit is cancelled, so the engine frees its slot."""
    deadline = time.monotonic() + s.cfg.infer_timeout_s * 5
    done = asyncio.wrap_future(req.future)
    getter = asyncio.ensure_future(sink.get()) if sink is not None else None
    try:
        while True:
            waiting = {done} if getter is None else {done, getter}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=0.25)
            if getter is not None and getter.done():
                return "text", getter.result()
            if done.done():
                if not req.future.cancelled() and req.future.exception() is None:
                    s.usage.record(req.tenant, 1, time.monotonic() - req.created)
                return "done", None
            if _gone(request):
                req.cancel()
                return "gone", None
            if time.monotonic() > deadline:
                req.cancel()
                raise ApiError(503, "timeout", "generation did not finish in time; retry")
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
        if done.done() and not done.cancelled():
            done.exception()  # the outcome is read from req.future; this marks the wrapper's as read


def _final(req) -> dict:
    """The request's result, or its failure as an ApiError."""
    try:
        return req.future.result(0)
    except KeyError:
        raise ApiError(404, "adapter_missing", f"tenant {req.tenant!r} has no stored adapter") from None
    except GenerationError as exc:
        raise as_api_error(exc) from None
    except Exception as exc:  # noqa: BLE001 - it failed inside the engine: this request's failure alone
        raise ApiError(500, "generation_failed", f"{type(exc).__name__}: {exc}") from None


async def _result(request, s, req) -> dict:
    try:
        kind, _ = await _outcome(request, s, req)
    except asyncio.CancelledError:
        req.cancel()
        raise
    if kind == "gone":
        raise ApiError(499, "client_closed", "the client closed the connection")
    return _final(req)


async def _stream(request, s, req, sink: asyncio.Queue, content_type: str, encode) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        while True:
            kind, piece = await _outcome(request, s, req, sink)
            if kind == "text":
                await resp.write(encode({"text": piece}))
                continue
            if kind == "gone":
                return resp
            break
        while not sink.empty():
            await resp.write(encode({"text": sink.get_nowait()}))
        try:
            await resp.write(encode({"done": True, **_final(req)}))
        except ApiError as exc:  # the stream has started: report in-band
            await resp.write(encode({"error": {"code": exc.code, "message": exc.message}}))
        await resp.write_eof()
    except ApiError as exc:
        await resp.write(encode({"error": {"code": exc.code, "message": exc.message}}))
    except ConnectionResetError:  # the client left mid-stream: nothing to answer, its request is cancelled below
        pass
    finally:
        req.cancel()  # no-op once finished; frees the engine slot of a client that went away mid-stream
    return resp


async def generate(request: web.Request) -> web.StreamResponse:
    s = request.app[SERVER]
    tenant = request.match_info["tenant"]
    await s.auth.require_owner(bearer(request), tenant)
    body = parse(models_of(s)["GenerateBody"], await json_body(request))
    req, sink = await _start(s, tenant, body, body.max_new_tokens)
    if sink is None:
        return web.json_response({"tenant": tenant, **await _result(request, s, req)})
    return await _stream(request, s, req, sink, "application/x-ndjson", lambda d: (json.dumps(d) + "\n").encode())


async def completions(request: web.Request) -> web.StreamResponse:
    s = request.app[SERVER]
    who = await s.auth.caller(bearer(request))  # authenticate before the body is read or parsed
    body = parse(models_of(s)["CompletionBody"], await json_body(request))
    tenant = body.model
    s.auth.may_act(who, tenant)
    req, sink = await _start(s, tenant, body, body.max_tokens)
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def chunk(text: str, finish: str | None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": tenant,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    if sink is None:
        r = await _result(request, s, req)
        return web.json_response({**chunk(r["text"], r["finish_reason"]),
                                  "usage": {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["tokens"],
                                            "total_tokens": r["prompt_tokens"] + r["tokens"]}})

    def sse(d: dict) -> bytes:
        if "text" in d and "done" not in d:
            return f"data: {json.dumps(chunk(d['text'], None))}\n\n".encode()
        if "done" in d:
            return f"data: {json.dumps(chunk('', d['finish_reason']))}\n\ndata: [DONE]\n\n".encode()
        return f"data: {json.dumps(d)}\n\n".encode()

    return await _stream(request, s, req, sink, "text/event-stream", sse)
