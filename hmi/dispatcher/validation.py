"""Input validation at the HTTP edge: every client mistake becomes a 4xx JSON error."""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


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


def field(body: dict, name: str, typ, required: bool = True, default=None):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, "missing_field", f"field {name!r} is required")
        return default
    value = body[name]
    ok = isinstance(value, typ) and not (typ in (int, float, (int, float)) and isinstance(value, bool))
    if not ok:
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ApiError(400, "invalid_type", f"field {name!r} must be {names}, not {type(value).__name__}")
    return value


def unknown_fields(body: dict, allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise ApiError(400, "unknown_field", f"unknown field(s) {', '.join(map(repr, extra))}; allowed: {', '.join(sorted(allowed))}")


def check_rows(rows, tagging: bool, where: str, max_rows: int) -> list[dict]:
    if not isinstance(rows, list):
        raise ApiError(400, "invalid_type", f"{where} must be a list of examples")
    if len(rows) > max_rows:
        raise ApiError(413, "too_many_examples", f"{where} has {len(rows)} examples; the limit is {max_rows}")
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ApiError(400, "invalid_example", f"{where}[{i}] must be an object")
        if tagging:
            toks, tags = r.get("tokens"), r.get("tags")
            if not (isinstance(toks, list) and isinstance(tags, list) and toks and len(toks) == len(tags)
                    and all(isinstance(t, str) and t for t in toks) and all(isinstance(t, str) for t in tags)):
                raise ApiError(400, "invalid_example",
                               f"{where}[{i}] needs 'tokens' and 'tags': non-empty lists of strings of equal length")
            out.append({"tokens": toks, "tags": tags})
        else:
            text, label = r.get("text"), r.get("label")
            if not (isinstance(text, str) and text.strip() and isinstance(label, str)):
                raise ApiError(400, "invalid_example", f"{where}[{i}] needs 'text' (non-empty string) and 'label' (string)")
            out.append({"text": text, "label": label})
    return out
