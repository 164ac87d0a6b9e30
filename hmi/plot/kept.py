"""Misses computed once and kept: the writer of the ``compute+insert`` miss policy (docs/design.md).

A window no version of a chain holds is computed by the first version's windowed lower layers
(``hmi.plot.lookup``), exactly as a build computes it, and answered at once in the PLOT's value
format: the value a later lookup reads back, so an answer does not depend on whether the PLOT
held the window yet.  The request then hands the value to the process's ``Keeper``, whose one
thread writes what several requests computed into that version's PLOT in one LMDB transaction,
off the request path; the next text that holds the window finds it.

Bounded: a PLOT keeps at most ``budget_mb`` of such entries.  Every lookup also tells the keeper
which of the version's tri-grams it read; past the budget, the least used kept entries (the
least recently used among equals) are removed until 90% of it remain: the paper's alpha rule
(keep the most frequent windows) applied online.  Built entries are never removed.  Kept entries
and their uses live in the PLOT's LMDB environment (``PlotStore.update_kept``): they survive
restarts, other processes serving the same home add to the same counts, and backups copy them.
A domain's new version starts with none (its PLOT is built anew).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import numpy as np

log = logging.getLogger("hmi.plot.kept")

DEFAULT_BUDGET_MB = 512.0  # per PLOT: about 230k windows of MiniLM (int8 rows, 1,164 bytes each)
LOW_WATER = 0.9


def keep_texts(lookup, tokenizer, texts: list[str], max_len: int, chunk: int = 64) -> None:
    """Looks ``texts`` up as requests would (cut at ``max_len`` tokens) and waits until what the
    lookup's keeper queued is written: with compute+insert, their missed windows are then kept."""
    for s in range(0, len(texts), chunk):
        enc = tokenizer(texts[s:s + chunk], truncation=True, max_length=max_len, padding=True, return_tensors="np")
        lookup.distinct(enc["input_ids"], enc["attention_mask"])
    if lookup.keeper is not None:
        lookup.keeper.flush()


class Keeper:
    """The one writer of kept misses in a process; thread-safe.  ``keep`` and ``used`` only queue
    (the request path); the writer thread drains the queue every ``flush_s`` into one transaction
    per PLOT.  ``stats``: windows ``queued``, ``added``, ``evicted``, ``failed`` (writes that
    raised: those windows are computed again when next missed)."""

    def __init__(self, budget_mb: float = DEFAULT_BUDGET_MB, flush_s: float = 0.05):
        if not budget_mb > 0:
            raise ValueError(f"a kept-miss budget must be above 0 MB, got {budget_mb:g}")
        self.budget_mb, self.flush_s = budget_mb, flush_s
        self.stats: Counter = Counter()
        self._pending: dict[int, tuple[object, list, list]] = {}  # id(store) -> (store, [(keys, values)], [keys used])
        self._writing = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def budget(self, store) -> int:
        """The kept entries ``store`` may hold: ``budget_mb`` over one value's bytes."""
        return max(1, int(self.budget_mb * 2**20 // store.meta.value_bytes))

    def keep(self, store, keys: np.ndarray, values: np.ndarray) -> None:
        """Queues computed windows for ``store``.  Shapes: keys (N,) uint64; values (N, n, H) float32,
        as computed (the store encodes them, as a build does: ``PlotStore.as_stored`` of them is what
        it will give back)."""
        if len(keys):
            self._queue(store, (np.array(keys, dtype=np.uint64), np.array(values)), None)

    def used(self, store, keys: np.ndarray) -> None:
        """Queues the tri-grams a lookup read from ``store`` (their uses). Shapes: keys (M,) uint64."""
        if len(keys):
            self._queue(store, None, np.array(keys, dtype=np.uint64))

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything queued so far is written; returns whether it was in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.notify_all()
            while self._pending or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Writes what is queued and stops the writer (before the PLOTs close)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- internals -----------------------------------------------------------------------------
    def _queue(self, store, computed, used) -> None:
        with self._cond:
            if self._closed:
                return
            _, kept, reads = self._pending.setdefault(id(store), (store, [], []))
            if computed is not None:
                kept.append(computed)
                self.stats["queued"] += len(computed[0])
            if used is not None:
                reads.append(used)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="plot-keeper", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
            time.sleep(self.flush_s)  # what other requests compute meanwhile joins this transaction
            with self._cond:
                batch, self._pending, self._writing = self._pending, {}, True
            try:
                for store, computed, reads in batch.values():
                    self._write(store, computed, reads)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, store, computed: list, reads: list) -> None:
        """One transaction for one PLOT: the distinct new windows (a window computed by several
        requests counts each of them as a use) and the uses of what lookups read."""
        keys = np.concatenate([k for k, _ in computed]) if computed else np.zeros(0, dtype=np.uint64)
        values = np.concatenate([v for _, v in computed]) if computed else None
        new, first, new_uses = np.unique(keys, return_index=True, return_counts=True)
        used, used_counts = np.unique(np.concatenate(reads), return_counts=True) if reads else (new[:0], new_uses[:0])
        try:
            out = store.update_kept(new, values[first] if values is not None else values, new_uses, used, used_counts,
                                    self.budget(store), LOW_WATER, int(time.time() * 1000))
        except Exception:  # noqa: BLE001 - serving goes on; these windows are computed again when next missed
            log.exception("kept misses could not be written to the PLOT at %s", getattr(store, "path", "?"))
            self.stats["failed"] += len(new)
            return
        self.stats["added"] += out["added"]
        self.stats["evicted"] += out["evicted"]
