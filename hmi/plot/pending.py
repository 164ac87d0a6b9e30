"""Serving a PLOT while it is being built: what the build will hold is computed on demand.

A build publishes its plan (every key it will write, ``plan_path``) before it computes anything.
While it runs, ``PendingStore`` answers a lookup from what is written so far, and computes a
planned key that is not written yet with the same windowed lower layers, rounded to the PLOT's
value format: the very value the build writes (the windowed layers give each window the same
result whatever else is in its batch).  A key outside the plan is missing, as it will be after
the build, so the chain backs off exactly as it will then.  Answers during the build are
therefore those after it, bit for bit; only slower.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from hmi.plot.keys import unpack
from hmi.plot.store import PlotStore

PLAN_FILE = "plan-{fingerprint}.npy"


def plan_path(store_path: Path | str, fingerprint: str) -> Path:
    """Where a build with ``fingerprint`` publishes its plan: beside the LMDB files."""
    return Path(store_path) / PLAN_FILE.format(fingerprint=fingerprint)


def build_state(store: PlotStore) -> dict:
    """The build record of a PLOT: ``{}`` before any build, else fingerprint, done, total, complete."""
    return store.get_record("build") or {}


class PendingStore:
    """A PLOT store being built, read as if it were complete (module docstring).  Everything but
    ``get_many`` and ``stamp`` is the store's own.  ``computed`` counts the values computed on
    demand."""

    readonly = True  # nothing but its build writes into a PLOT being built (``hmi.plot.kept``)

    def __init__(self, store: PlotStore, plan: np.ndarray, encoder):
        self.store, self.plan, self.encoder = store, np.sort(np.asarray(plan, dtype=np.uint64)), encoder
        self.computed = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def stamp(self) -> None:
        """None: what the build has not written yet is still answered (computed), so no hot tier
        stands for this store however still its LMDB is (``HotTier.covers``)."""
        return None

    def planned(self, keys: np.ndarray) -> np.ndarray:
        """Whether each key is in the build's plan. Shapes: keys (N,) uint64 -> (N,) bool."""
        at = np.searchsorted(self.plan, keys).clip(max=max(len(self.plan) - 1, 0))
        return self.plan[at] == keys if len(self.plan) else np.zeros(len(keys), dtype=bool)

    @torch.no_grad()
    def get_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``PlotStore.get_many`` of the PLOT the build will have written.
        Shapes: keys (N,) uint64 -> values (N, n, H) float16, found (N,) bool."""
        keys = np.asarray(keys, dtype=np.uint64)
        vals, found = self.store.get_many(keys)
        todo = np.flatnonzero(~found)
        if todo.size:
            todo = todo[self.planned(keys[todo])]
        if todo.size:
            uniq, inverse = np.unique(keys[todo], return_inverse=True)
            reps = self.encoder.lower(torch.from_numpy(unpack(uniq))).numpy()
            vals[todo] = self.store.as_stored(reps)[inverse.reshape(-1)]
            found[todo] = True
            with self._lock:
                self.computed += int(uniq.size)
        return vals, found


def serving_store(store: PlotStore, encoder) -> PlotStore | PendingStore:
    """``store`` when its build is complete (or it has no build), else a ``PendingStore`` over
    the plan the build published."""
    state = build_state(store)
    if not state or state.get("complete"):
        return store
    path = plan_path(store.path, state["fingerprint"])
    if not path.exists():
        return store
    return PendingStore(store, np.load(path), encoder)
