"""Lower-layer output from PLOT lookups along a version chain (docs/design.md, sections 1-3).

Order for each distinct window of a batch: the tri-gram in each version of the chain
(branch, parent, ..., root), then the bi-gram ``(0, c, r)`` along the chain, then the uni-gram
``(0, c, 0)``, then zeros.  Miss policies: ``backoff`` (the paper's), ``compute`` (run the
first version's windowed lower layers on the windows no version holds, exact) and
``compute+insert`` (also keep them in the first version's PLOT, written off the request path and
bounded: ``hmi.plot.kept``), ``learned`` (the back-off's
rows of a missed tri-gram ``(l, c, r)``, l and r real tokens, turned into an estimate of its states
by the learned back-off of the first version that has one, ``hmi.plot.learned``) and
``learned+compute`` (a missed tri-gram whose bi-gram no version holds either, so that backing off
would reach the uni-gram, is computed as ``compute`` does; the others missed are estimated as
``learned`` does: exact windows where the back-off is worst, for a share of the computing).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from hmi.model.hplm import WindowedEncoder
from hmi.plot import learned
from hmi.plot.hot import HotTier
from hmi.plot.kept import Keeper
from hmi.plot.keys import (
    bigram_backoff,
    causal_unigram_backoff,
    causal_windows,
    encoder_windows,
    pack,
    unigram_backoff,
    unique_windows,
    unpack,
)
from hmi.plot.store import PlotStore

POLICIES = ("backoff", "compute", "compute+insert", "learned", "learned+compute")
LEARNED_POLICIES = ("learned", "learned+compute")  # the policies that serve a learned back-off


# a version's learned back-off, its tokens' centre states, and the two as serving runs them
Backoff = tuple[learned.LearnedBackoff, learned.CentreTable, learned.ProjectedBackoff]


@dataclass
class PlotVersion:
    """One node of a domain chain: its PLOT, the windowed encoder (lower layers, gate, merge)
    that produced it, and optionally the PLOT's hot tier (``hmi.plot.hot``), read before LMDB."""

    name: str
    store: PlotStore
    encoder: WindowedEncoder
    hot: HotTier | None = None
    # its learned back-off, its tokens' centre states and their projections (``learned_backoff``), kept
    # once per opened version
    backoff: Backoff | None = field(default=None, compare=False, repr=False)


def learned_backoff(version: PlotVersion) -> Backoff | None:
    """The version's learned back-off, the ``learned.CentreTable`` of its PLOT and the
    ``learned.ProjectedBackoff`` serving runs it through, or None where it has none; loaded at the
    first call and kept on the version, so the lookups of every domain whose chain goes through it
    (the root's: all of them) share one copy."""
    if version.backoff is None:
        model = learned.load(version.store.path)
        if model is None:
            return None
        vocab = version.encoder.lower.embeddings.word_embeddings.num_embeddings
        centres = learned.CentreTable(version.store, vocab)
        version.backoff = (model, centres, learned.ProjectedBackoff(model, centres, learned.SERVE_BF16))
    return version.backoff


@dataclass
class LookupResult:
    """Window representations of a batch and where each distinct window came from."""

    reps: torch.Tensor  # (B, T, 3, H) float32, zeros at padding
    hits: Counter = field(default_factory=Counter)  # level name -> distinct windows served there


def place(out: torch.Tensor, located: list[tuple[HotTier, np.ndarray, torch.Tensor]]) -> None:
    """Writes the values the hot tiers hold into their rows of ``out``, one gather per tier; a tier
    that serves every row gathers straight into ``out``.
    Shapes: out (U, n, H) float16; located [(tier, rows (F,) int64, positions (F,) int64 in the tier)]."""
    for tier in {id(t): t for t, _, _ in located}.values():
        rows = np.concatenate([r for t, r, _ in located if t is tier])
        positions = torch.cat([p for t, _, p in located if t is tier])
        if len(rows) == len(out):  # every row, each once: positions put in row order
            in_order = torch.empty_like(positions)
            in_order[torch.from_numpy(rows).to(positions.device)] = positions
            tier.gather(in_order, out=out)
        elif len(rows):
            out.index_copy_(0, torch.from_numpy(rows), tier.gather(positions))


class PlotLookup:
    """Batched PLOT lookup along a chain. Thread-safe: counters are guarded by a lock."""

    def __init__(self, chain: list[PlotVersion], policy: str = "backoff", keeper: Keeper | None = None):
        """``keeper``: the writer of ``compute+insert``'s kept misses (one per process, shared by
        its lookups; a new one when none is given).  That policy needs the first version's PLOT
        opened writable (a PLOT still being built is read as the build will leave it: nothing is
        kept in it until the build is complete)."""
        if not chain:
            raise ValueError("a lookup chain needs at least one version")
        if policy not in POLICIES:
            raise ValueError(f"unknown miss policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.chain = chain
        self.policy = policy
        self.keeper = None
        if policy == "compute+insert":
            if getattr(chain[0].store, "store", chain[0].store).readonly:
                raise ValueError(f"the miss policy 'compute+insert' keeps misses in the PLOT of {chain[0].name!r}, "
                                 "which is open read-only")
            self.keeper = keeper or Keeper()
        # A decoder's chain (``CausalLower``) reads causal windows; an encoder's, centred ones.
        self.causal = bool(getattr(chain[0].encoder, "causal", False))
        self.hits: Counter = Counter()
        self._lock = threading.Lock()
        self.learned: tuple[PlotVersion, Backoff] | None = None
        if policy in LEARNED_POLICIES:
            if self.causal:
                raise ValueError(f"the miss policy {policy!r} is for encoder PLOTs; a decoder's uses 'compute' or 'backoff'")
            found = [(v, m) for v in chain if (m := learned_backoff(v)) is not None]
            if not found:
                raise learned.LearnedBackoffMissingError(
                    f"no version of the chain {[v.name for v in chain]} has a learned back-off: train the root "
                    "PLOT's with `hmi plot learn-backoff` or serve with another miss policy")
            self.learned = found[0]

    @property
    def merge(self):
        return self.chain[0].encoder.merge

    def window_reps(self, windows: np.ndarray) -> tuple[np.ndarray, Counter]:
        """Representations of distinct windows.

        Shapes: windows (U, 3) int64 -> reps (U, n, H) float16 (n = 3 encoder, 1 causal), zeros
        where no level holds the window; plus hits per level.
        """
        keys = pack(windows)
        meta = self.chain[0].store.meta
        written = torch.empty((len(keys), meta.n, meta.hidden_size), dtype=torch.float16)  # every row set below
        out = written.numpy()
        todo = np.ones(len(keys), dtype=bool)
        hits: Counter = Counter()
        located: list[tuple[HotTier, np.ndarray, torch.Tensor]] = []  # (tier, rows, positions in it)
        read_first: list[np.ndarray] = []  # tri-grams read from the first version's LMDB (uses of kept entries)

        # Each version's tiers, the hot one first; LMDB is not read where the hot tier holds all of it.
        tiers = [(v, (v.hot,) if v.hot.covers(v.store) else (v.hot, v.store)) if v.hot is not None else (v, (v.store,))
                 for v in self.chain]

        def serve(level: str, lookup_keys: np.ndarray) -> None:
            for v, held_in in tiers:
                for tier in held_in:
                    idx = np.flatnonzero(todo)
                    if idx.size == 0:
                        return
                    if tier is v.hot:
                        found, positions = tier.locate(lookup_keys[idx])
                        located.append((tier, idx[found], positions))
                        hits["hot"] += int(found.sum())
                    else:
                        vals, found = tier.get_many(lookup_keys[idx])
                        out[idx[found]] = vals[found]
                        if self.keeper is not None and level == "trigram" and v is self.chain[0]:
                            read_first.append(lookup_keys[idx[found]])
                    todo[idx[found]] = False
                    hits[f"{level}:{v.name}"] += int(found.sum())

        serve("trigram", keys)
        # tri-grams of real tokens no version holds: the learned back-off's to estimate
        estimated = np.flatnonzero(todo & (windows[:, 0] > 0) & (windows[:, 2] > 0)) if self.learned else None
        if read_first:
            self.keeper.used(self.chain[0].store, np.concatenate(read_first))
        if todo.any() and self.policy in ("compute", "compute+insert"):
            self._compute(keys, out, todo, hits)
        if todo.any():
            serve("bigram", bigram_backoff(keys))
        if todo.any() and self.policy == "learned+compute":  # what would fall to the uni-gram: computed
            estimated = estimated[~todo[estimated]]
            self._compute(keys, out, todo, hits)
        from_bigram = ~todo[estimated] if estimated is not None else None
        if todo.any():
            serve("unigram", (causal_unigram_backoff if self.causal else unigram_backoff)(keys))
        place(written, located)
        out[todo] = 0
        hits["zeros"] += int(todo.sum())
        if estimated is not None and estimated.size:
            self._estimate(keys[estimated], out, estimated, from_bigram, hits)
        return out, hits

    def _estimate(self, keys: np.ndarray, out: np.ndarray, rows: np.ndarray, from_bigram: np.ndarray,
                  hits: Counter) -> None:
        """The learned back-off's estimates of the missed tri-grams ``keys`` (U,), written over their
        back-off rows ``out[rows]`` (U, 3, H); ``from_bigram`` (U,) bool: whether the bi-gram served them."""
        version, (model, centres, projected) = self.learned
        out[rows] = learned.estimate(model, version.store, keys, out[rows], from_bigram, centres=centres,
                                     projected=projected)
        hits["learned"] += int(rows.size)

    def _compute(self, keys: np.ndarray, out: np.ndarray, todo: np.ndarray, hits: Counter) -> None:
        """The first version's windowed lower layers on the windows ``todo`` marks, written into
        ``out`` (with ``compute+insert`` in its PLOT's value format, and queued to be kept there);
        clears their ``todo``."""
        idx = np.flatnonzero(todo)
        with torch.no_grad():
            computed = self.chain[0].encoder.lower(torch.from_numpy(unpack(keys[idx])))
        out[idx] = computed.numpy().astype(np.float16)
        todo[idx] = False
        hits["computed"] += int(idx.size)
        if self.keeper is not None:
            store, exact = self.chain[0].store, computed.numpy()
            out[idx] = store.as_stored(exact)  # what every later lookup reads: the same answer each time
            if not store.readonly:  # a PLOT still being built (hmi.plot.pending) keeps nothing
                self.keeper.keep(store, keys[idx], exact)  # encoded once, from the exact values, as a build does

    def record(self, hits: Counter) -> None:
        """Adds a lookup's hits per level to the running counters."""
        with self._lock:
            self.hits.update(hits)

    def distinct(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, Counter]:
        """The batch's distinct windows looked up (counted in ``hits``).

        Shapes: ids (B, T); mask (B, T) -> reps (U, n, H) float16, inverse (B, T) int64 (-1 at
        padding), hits per level.
        """
        ids, mask = np.asarray(ids), np.asarray(mask)
        uniq, inverse = unique_windows((causal_windows if self.causal else encoder_windows)(ids, mask), mask)
        reps, hits = self.window_reps(uniq)
        self.record(hits)
        return reps, inverse, hits

    def represent(self, ids: np.ndarray, mask: np.ndarray) -> LookupResult:
        """Shapes: ids (B, T); mask (B, T) -> LookupResult.reps (B, T, n, H) float32."""
        reps, inverse, hits = self.distinct(ids, mask)
        full = np.zeros(inverse.shape + reps.shape[1:], dtype=np.float32)
        real = inverse >= 0
        full[real] = reps[inverse[real]]
        return LookupResult(torch.from_numpy(full), hits)

    @torch.no_grad()
    def merged(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """The upper layers' input for a batch. Shapes: ids, mask (B, T) -> (B, T, H) float32.

        Encoder chains merge straight from the distinct windows (``Merge.forward_unique``); the
        result equals ``merge(represent(ids, mask).reps)``."""
        if self.causal:
            return self.merge(self.represent(ids, mask).reps)
        reps, inverse, _ = self.distinct(ids, mask)
        return self.merge.forward_unique(torch.from_numpy(reps), torch.from_numpy(inverse))
