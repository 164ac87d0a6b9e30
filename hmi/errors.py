"""What the services say when they refuse a request: a ``Refusal`` of one ``Kind`` with a stable
code a client can act on and a message a person can read.  The services know nothing of HTTP;
the dispatcher alone turns a kind into a status code (``hmi.dispatcher.validation.STATUS``)."""

from __future__ import annotations

from enum import Enum


class Kind(str, Enum):
    """Why a request is refused (the HTTP status each maps to, for the reader)."""

    INVALID = "invalid"  # the request itself is malformed (400)
    UNAUTHENTICATED = "unauthenticated"  # no valid credential (401)
    FORBIDDEN = "forbidden"  # a valid credential that may not do this (403)
    NOT_FOUND = "not_found"  # no such tenant, domain, job or feature (404)
    CONFLICT = "conflict"  # the thing exists, or is in a state that does not allow this now (409)
    TOO_LARGE = "too_large"  # an input over a limit (413)
    UNPROCESSABLE = "unprocessable"  # well formed, but it does not fit this server (422)
    BUSY = "busy"  # a queue is full: retry later (429)
    UNAVAILABLE = "unavailable"  # a part of the server cannot serve now (503)
    FAILED = "failed"  # the server failed on this request alone (500)


class Refusal(Exception):
    """A request a service will not (or cannot) carry out; nothing of it was kept.

    ``retry_after_s``: when the client may try again (queues that are full), else None."""

    def __init__(self, kind: Kind, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.kind, self.code, self.message, self.retry_after_s = kind, code, message, retry_after_s
