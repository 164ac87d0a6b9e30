"""Input validation at the HTTP edge: every client mistake becomes a 4xx JSON error."""

from __future__ import annotations

import json

from aiohttp import web

from hmi.errors import Kind, Refusal
from hmi.scheduler.fair import TenantQueueFullError
from hmi.scheduler.types import QueueFullError


class ApiError(Exception):
    """An HTTP error response: what the edge itself refuses, or a service's ``Refusal`` mapped."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


def bearer(request: web.Request) -> str:
    """The request's bearer token (401 without one, or with one that is not UTF-8)."""
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer ") or not header[7:].strip():
        raise ApiError(401, "unauthorized", "send 'Authorization: Bearer <token>'")
    token = header[7:].strip()
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as surrogates
        raise ApiError(401, "unauthorized", "the token is not valid UTF-8") from None
    return token


# The status code of each kind of refusal a service raises (hmi.errors): the one place it is decided.
STATUS = {Kind.INVALID: 400, Kind.UNAUTHENTICATED: 401, Kind.FORBIDDEN: 403, Kind.NOT_FOUND: 404, Kind.CONFLICT: 409,
          Kind.TOO_LARGE: 413, Kind.UNPROCESSABLE: 422, Kind.BUSY: 429, Kind.UNAVAILABLE: 503, Kind.FAILED: 500}


def as_api_error(exc: Refusal) -> ApiError:
    """A service's refusal as the HTTP error the client gets (``Retry-After`` where it says when)."""
    headers = {"Retry-After": f"{exc.retry_after_s:g}"} if exc.retry_after_s is not None else None
    return ApiError(STATUS[exc.kind], exc.code, exc.message, headers)


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


async def json_body(request: web.Request) -> dict:
    if request.content_type not in ("application/json", ""):
        raise ApiError(415, "unsupported_media_type", f"send JSON (Content-Type: application/json), not {request.content_type}")
    raw = await request.read()
    if not raw:
        raise ApiError(400, "empty_body", "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "malformed_json", "the body nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", f"the body must be a JSON object, not {type(body).__name__}")
    return body


def check_rows(rows: list[dict], tagging: bool, where: str) -> list[dict]:
    """Examples (already of the documented shape) checked against the task's head: 422 when a
    classification task gets tagging examples or the reverse, or tokens and tags differ in length."""
    out = []
    for i, r in enumerate(rows):
        if tagging:
            toks, tags = r.get("tokens"), r.get("tags")
            if toks is None or len(toks) != len(tags):
                raise ApiError(422, "invalid_example", f"{where}[{i}] needs 'tokens' and 'tags' of equal length "
                               "(the task is tagging)")
            out.append({"tokens": toks, "tags": tags})
        else:
            if r.get("text") is None:
                raise ApiError(422, "invalid_example", f"{where}[{i}] needs 'text' and 'label' (the task is classification)")
            out.append({"text": r["text"], "label": r["label"]})
    return out


def refused(exc: QueueFullError) -> ApiError:
    """The 429 of a refusal: ``over_share`` when the tenant holds its share while others are
    served, ``overloaded`` when the server is full."""
    if isinstance(exc, TenantQueueFullError):
        return ApiError(429, "over_share", f"{exc}: this tenant sends more than its share of the server; retry "
                        "shortly (other tenants are served meanwhile)", {"Retry-After": "1"})
    return ApiError(429, "overloaded", "the server is at capacity; retry shortly", {"Retry-After": "1"})
