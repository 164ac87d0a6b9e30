"""Finished cells of a long benchmark, kept so that the same command run again continues where it
stopped: a benchmark made of many independent measurements (an accuracy table: one training run
per task, scheme, pooling and learning rate) asks ``Cells.run(key, fn)`` for each; a cell finished
by an earlier run of the same configuration is read back instead of being run again.

A cell's result is one JSON file under ``$HMI_HOME/runs/<benchmark>/<config hash>/``, written
atomically when the cell ends, so a run stopped at any point (Ctrl+C, a restart, a time limit)
loses at most the cell it was in.  The config hash covers everything that makes a result
comparable (root artifact, data sizes, epochs, code format): another configuration starts afresh
and leaves this one's cells alone.

``max_minutes`` limits one invocation, not the recipe: a cell starts only while the invocation's
elapsed time is under it, so every invocation finishes at least one cell and the next invocation
of the same command continues after it."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from hmi.home import hmi_home
from hmi.io import atomic_write_json
from hmi.timelimit import OutOfTime, TimeLimit


def digest(obj) -> str:
    """A short, stable hash of a JSON-able object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Cells:
    def __init__(self, benchmark: str, config: dict, max_minutes: float | None = None, fresh: bool = False,
                 home: Path | None = None):
        self.folder = (home or hmi_home()) / "runs" / benchmark / digest(config)
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.folder / "config.json", config)
        if fresh:
            for f in self.folder.glob("cell-*.json"):
                f.unlink()
        self.limit = TimeLimit(max_minutes)
        self.reused = self.ran = 0

    def _path(self, key: dict) -> Path:
        return self.folder / f"cell-{digest(key)}.json"

    def done(self, key: dict) -> dict | None:
        """The result of cell ``key`` if an earlier run finished it (None when absent or unreadable)."""
        try:
            stored = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        return stored.get("result") if isinstance(stored, dict) and stored.get("key") == key else None

    def run(self, key: dict, fn: Callable[[], dict]) -> dict:
        """Cell ``key``'s result: read back when finished before, else ``fn()`` (a JSON-able dict),
        kept once it returns. Raises ``OutOfTime`` instead of starting a cell past ``max_minutes``."""
        result = self.done(key)
        if result is not None:
            self.reused += 1
            return result
        t0 = time.monotonic()
        result = self.work(fn)
        atomic_write_json(self._path(key), {"key": key, "result": result, "seconds": round(time.monotonic() - t0, 1)})
        return result

    def work(self, fn: Callable[[], object]):
        """``fn()``, under the limit of ``run``: a unit of work that keeps its own result (a
        checkpointed job, a published branch). Raises ``OutOfTime`` instead of starting it past
        ``max_minutes`` once this invocation has done some work."""
        if self.ran and self.limit.spent():
            raise OutOfTime(f"{self.limit.minutes:g} minutes spent")
        out = fn()
        self.ran += 1
        return out

    def summary(self) -> str:
        return (f"{self.ran} cell(s) run, {self.reused} reused from earlier runs "
                f"(kept in {self.folder})")
