"""Cross-tenant batching on the event loop, as the paper describes: a request joins the last open
batch; a full batch closes; an open batch also closes after ``max_wait`` seconds."""

from __future__ import annotations

import asyncio
from typing import Callable

from hmi.scheduler.types import InferRequest


class Batcher:
    def __init__(self, submit: Callable[[list[InferRequest]], None], max_batch: int = 32, max_wait: float = 0.005,
                 on_close: Callable[[int], None] | None = None):
        self.submit = submit
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.on_close = on_close
        self._open: list[InferRequest] = []
        self._timer: asyncio.TimerHandle | None = None

    def add(self, requests: list[InferRequest]) -> None:
        """Adds requests (all from one HTTP call) to the open batch, closing batches as they fill.
        Raises what ``submit`` raises (e.g. QueueFullError) for a batch that cannot be queued."""
        for r in requests:
            self._open.append(r)
            if len(self._open) >= self.max_batch:
                self.close()
        if self._open and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait, self._close_safe)

    def _close_safe(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - the requests carry the error back to their callers
            del exc

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._open = self._open, []
        if not batch:
            return
        if self.on_close:
            self.on_close(len(batch))
        try:
            self.submit(batch)
        except Exception as exc:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
            raise
