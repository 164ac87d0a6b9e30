"""The hot tier of a PLOT: its most read entries held as tensors, in front of LMDB (the cold tier).

A sorted int64 key tensor (K,) and the values (K, n, H) float16 exactly as the PLOT gives them
back (``PlotStore.get_many``: its format decoded), looked up for a whole batch at once with
``searchsorted`` and a gather; on the GPU when the tier is placed there, in host memory otherwise.
A key the tier does not hold goes on to LMDB, so a lookup with the tier returns the same values,
bit for bit, as one without it.

Which entries: the PLOT's keys in the order serving reads them most (``serving_order``: every
window of a sample of texts counted at the key that serves it under back-off: the tri-gram when
the PLOT holds it, else its bi-gram, else its uni-gram), taken until the budget in MB is spent;
a budget of the PLOT's size holds all of it.
The tier is a snapshot: entries later inserted into the PLOT are read from LMDB.  A tier that
holds every entry of its PLOT (a budget of the PLOT's size) knows, while nothing has been written
to the PLOT since it was filled (``HotTier.covers``: LMDB's last write transaction is the one it
saw), that a key it lacks is not in the PLOT either: a lookup then reads no LMDB at all.
"""

from __future__ import annotations

import numpy as np
import torch

from hmi.plot.build import count_ngrams, tokenize_corpus
from hmi.plot.keys import ngram_order, served_keys
from hmi.plot.store import PlotStore

READ_CHUNK = 4096  # keys read from LMDB per transaction while the tier is filled


def serving_order(store: PlotStore, token_lists: list[list[int]]) -> np.ndarray:
    """Every key of an encoder PLOT, the most read first for texts like ``token_lists`` (ties by
    key), then the keys none of their windows reads (by key).  Shapes: -> (K,) uint64."""
    windows, counts = count_ngrams(token_lists)
    held = store.keys()
    order = ngram_order(held)
    served = served_keys(windows, held[order == 3], held[order == 2])
    keys, at = np.unique(served, return_inverse=True)
    reads = np.bincount(at.reshape(-1), weights=counts, minlength=len(keys))
    read = np.isin(keys, held)
    keys, reads = keys[read], reads[read]
    return np.concatenate([keys[np.lexsort((keys, -reads))], np.setdiff1d(held, keys)])


def attach_hot_tier(version, tokenizer, lines: list[str], budget_mb: float,
                    device: str | torch.device = "cpu") -> "HotTier":
    """Builds the hot tier of ``version`` (a ``PlotVersion``) in the order ``lines`` read its
    PLOT, and puts it in front of the version's LMDB (lookups already running read LMDB until it
    is there)."""
    order = serving_order(version.store, tokenize_corpus(tokenizer, lines, progress=False))
    version.hot = HotTier.from_store(version.store, order, budget_mb, device)
    return version.hot


def entry_bytes(n: int, hidden: int) -> int:
    """Memory of one entry in the tier: its int64 key and its float16 values."""
    return 8 + 2 * n * hidden


class HotTier:
    """Entries of one PLOT as tensors on ``device``.  Thread-safe for lookups (read-only)."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, device: str | torch.device = "cpu",
                 stamp: int | None = None):
        """Shapes: keys (K,) uint64, distinct; values (K, n, H) float16.  ``stamp``: the PLOT's
        ``PlotStore.stamp`` when these were all of its entries (None: part of them)."""
        self.stamp = stamp
        keys = np.asarray(keys, dtype=np.uint64).view(np.int64)
        order = np.argsort(keys, kind="stable")
        self.device = torch.device(device)
        self.keys = torch.from_numpy(keys[order]).to(self.device)
        self.values = torch.from_numpy(np.ascontiguousarray(values[order], dtype=np.float16)).to(self.device)

    @classmethod
    def from_store(cls, store: PlotStore, order: np.ndarray, budget_mb: float,
                   device: str | torch.device = "cpu") -> "HotTier":
        """The first keys of ``order`` (most read first) that fit ``budget_mb``, with the values
        the PLOT holds for them."""
        m = store.meta
        stamp, every = store.stamp(), store.keys()
        take = np.asarray(order, dtype=np.uint64)[: int(budget_mb * 2**20 // entry_bytes(m.n, m.hidden_size))]
        keys, values = [np.zeros(0, np.uint64)], [np.zeros((0, m.n, m.hidden_size), np.float16)]
        for i in range(0, len(take), READ_CHUNK):
            vals, found = store.get_many(take[i:i + READ_CHUNK])
            keys.append(take[i:i + READ_CHUNK][found])
            values.append(vals[found])
        keys = np.concatenate(keys)
        whole = stamp is not None and store.stamp() == stamp and bool(np.isin(every, keys).all())
        return cls(keys, np.concatenate(values), device, stamp if whole else None)

    @classmethod
    def whole(cls, store: PlotStore, device: str | torch.device = "cpu") -> "HotTier":
        """Every entry of ``store``: a tier that stands for it while nothing is written to it."""
        m = store.meta
        return cls.from_store(store, store.keys(), (len(store) + 1) * entry_bytes(m.n, m.hidden_size) / 2**20, device)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * 8 + self.values.numel() * 2

    def lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Semantics: where the tier holds each query key, and whether it does.
        Shapes: keys (N,) int64 on the tier's device -> positions (N,) int64 into ``values``
        (meaningless where not found), found (N,) bool."""
        if len(self.keys) == 0:
            return torch.zeros_like(keys), torch.zeros(len(keys), dtype=torch.bool, device=self.device)
        pos = torch.searchsorted(self.keys, keys).clamp_(max=len(self.keys) - 1)
        return pos, self.keys[pos] == keys

    def covers(self, store) -> bool:
        """Whether the tier holds every entry ``store`` holds now: it was filled with all of them
        and nothing has been written to the store since, so a key it lacks the store lacks too."""
        return self.stamp is not None and store.stamp() == self.stamp

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The held keys among ``keys`` and their values, on the host: keys (N,) uint64 -> found
        (N,) bool, values (F, n, H) float16 of the F found keys in query order."""
        found, positions = self.locate(keys)
        return found, self.gather(positions).numpy()

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """Which of ``keys`` the tier holds, and where: keys (N,) uint64 -> found (N,) bool on the
        host, positions (F,) int64 into ``values`` of the F found keys in query order, on the
        tier's device."""
        q = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)).to(self.device)
        pos, found = self.lookup(q)
        return found.cpu().numpy(), pos[found]

    def gather(self, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``values[positions]`` on the host, written into ``out`` when given (``index_select``: a
        gather of whole rows, far cheaper here than advanced indexing).
        Shapes: positions (F,) int64 on the tier's device -> (F, n, H) float16."""
        if out is not None and self.device.type == "cpu":
            return torch.index_select(self.values, 0, positions, out=out)
        held = torch.index_select(self.values, 0, positions).cpu()
        return held if out is None else out.copy_(held)

    def get_many(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``PlotStore.get_many``'s contract on host arrays: keys (N,) uint64 -> values (N, n, H)
        float16 (zeros where not held), found (N,) bool."""
        found, held = self.find(keys)
        values = np.zeros((len(found), *self.values.shape[1:]), dtype=np.float16)
        values[found] = held
        return values, found
