"""A private tenant's connection to a server's base executor: HTTP/1.1 on one kept-alive
connection, tensors in ``hmi.split.wire``'s format."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import torch

from hmi.split.wire import decode, encode


class BaseExecutorError(RuntimeError):
    """The server refused a call; ``status`` and ``code`` are its answer's."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class BaseClient:
    """Calls a server's base executor for a private tenant (its token).  Counts round trips and
    bytes both ways (``stats``).  Not shared between threads: one connection, one call at a time."""

    def __init__(self, url: str, token: str, timeout: float = 120.0):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout = u.hostname or "127.0.0.1", u.port or 80, timeout
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
        self._conn: http.client.HTTPConnection | None = None
        self.stats = {"round_trips": 0, "bytes_sent": 0, "bytes_received": 0}

    def lower(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The lower layers' output as the server's PLOT serves it, merged: the upper layers' input.
        Shapes: ids, mask (B, T) -> (B, T, H)."""
        return self._post("/v1/base/lower", encode(ids.to(torch.int32), mask.to(torch.uint8)))[0]

    def linear(self, layer: int, projection: str, operation: str, x: torch.Tensor, training: bool = False) -> torch.Tensor:
        """A frozen projection of upper layer ``layer`` (absolute index) on ``x``: ``forward``
        x W^T + b, ``nobias`` x W^T, ``backward`` x W.  Shapes: x (..., D) -> (..., D')."""
        path = f"/v1/base/layers/{layer}/{projection}/{operation}" + ("?priority=training" if training else "")
        return self._post(path, encode(x.detach().float().contiguous()))[0]

    def _post(self, path: str, body: bytes) -> list[torch.Tensor]:
        for attempt in (1, 2):
            try:
                conn = self._connection()
                conn.request("POST", path, body=body, headers=self.headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (ConnectionError, http.client.HTTPException):
                self.close()  # a kept-alive connection the server closed: once more on a new one
                if attempt == 2:
                    raise
        self.stats["round_trips"] += 1
        self.stats["bytes_sent"] += len(body)
        self.stats["bytes_received"] += len(data)
        if resp.status != 200:
            try:
                err = json.loads(data)["error"]
            except (ValueError, KeyError, TypeError):
                err = {"code": "http_error", "message": data[:200].decode(errors="replace")}
            raise BaseExecutorError(resp.status, err.get("code", ""), err.get("message", ""))
        return decode(data)

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
