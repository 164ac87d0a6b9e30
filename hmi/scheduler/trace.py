"""Per-batch, per-stage timings as Chrome trace JSON (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path


class Tracer:
    def __init__(self, enabled: bool = True, max_events: int = 200_000):
        self.enabled = enabled
        self.max_events = max_events
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter_ns()

    @contextmanager
    def span(self, name: str, batch_id: int, **args):
        if not self.enabled:
            yield
            return
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            self.add(name, batch_id, start, end, **args)

    def add(self, name: str, batch_id: int, start_ns: int, end_ns: int, **args) -> None:
        if not self.enabled:
            return
        ev = {"name": name, "cat": name.split(":")[0], "ph": "X", "pid": os.getpid(),
              "tid": threading.current_thread().name, "ts": (start_ns - self._t0) / 1000,
              "dur": (end_ns - start_ns) / 1000, "args": {"batch": batch_id, **args}}
        with self._lock:
            if len(self.events) < self.max_events:
                self.events.append(ev)

    def stage_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        with self._lock:
            for e in self.events:
                out[e["cat"]] = out.get(e["cat"], 0.0) + e["dur"] / 1e6
        return out

    def export(self, path: Path | str) -> None:
        with self._lock:
            data = {"traceEvents": list(self.events), "displayTimeUnit": "ms"}
        Path(path).write_text(json.dumps(data))
