"""PLOT keys: n-gram windows packed into 8-byte big-endian integers (21 bits per token id).

A key is ``(a << 42) | (b << 21) | c`` for the window ``(a, b, c)``; big-endian bytes sort like
the integers, so a key's bytes order windows lexicographically.  Encoder back-off keys for a
missing tri-gram ``(l, c, r)`` are the bi-gram ``(0, c, r)`` and the uni-gram ``(0, c, 0)``;
causal back-off keys for ``(a, b, c)`` are ``(0, b, c)`` and ``(0, 0, c)`` (the windows a text's
first tokens have).
"""

from __future__ import annotations

import numpy as np

from hmi.model.windows import ID_BITS, causal_windows, encoder_windows, unique_windows

__all__ = ["encoder_windows", "causal_windows", "unique_windows", "pack", "unpack", "to_bytes", "from_bytes",
           "bigram_backoff", "unigram_backoff", "causal_unigram_backoff", "ngram_order", "served_keys", "MAX_ID"]

BITS = ID_BITS
MAX_ID = (1 << BITS) - 1
_MASK = np.uint64(MAX_ID)


def pack(win: np.ndarray) -> np.ndarray:
    """Shapes: win (..., 3) int -> keys (...,) uint64."""
    w = np.asarray(win, dtype=np.int64)
    if w.size and (w.min() < 0 or w.max() > MAX_ID):
        raise ValueError(f"token ids must lie in [0, {MAX_ID}] to be packed into a PLOT key")
    w = w.astype(np.uint64)
    return (w[..., 0] << np.uint64(2 * BITS)) | (w[..., 1] << np.uint64(BITS)) | w[..., 2]


def unpack(keys: np.ndarray) -> np.ndarray:
    """Shapes: keys (...,) uint64 -> win (..., 3) int64."""
    k = np.asarray(keys, dtype=np.uint64)
    return np.stack([(k >> np.uint64(2 * BITS)) & _MASK, (k >> np.uint64(BITS)) & _MASK, k & _MASK],
                    axis=-1).astype(np.int64)


def to_bytes(keys: np.ndarray) -> list[bytes]:
    """The LMDB key of each packed key: 8 bytes, big-endian."""
    return np.asarray(keys, dtype=">u8").reshape(-1).view("V8").tolist()


def from_bytes(raw: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(raw), dtype=">u8").astype(np.uint64)


def bigram_backoff(keys: np.ndarray) -> np.ndarray:
    """``(l, c, r) -> (0, c, r)``: drop the left context."""
    return np.asarray(keys, dtype=np.uint64) & np.uint64((1 << (2 * BITS)) - 1)


def unigram_backoff(keys: np.ndarray) -> np.ndarray:
    """``(l, c, r) -> (0, c, 0)``: keep the centre only."""
    return np.asarray(keys, dtype=np.uint64) & (_MASK << np.uint64(BITS))


def causal_unigram_backoff(keys: np.ndarray) -> np.ndarray:
    """``(a, b, c) -> (0, 0, c)``: keep the current token only."""
    return np.asarray(keys, dtype=np.uint64) & _MASK


def ngram_order(keys: np.ndarray) -> np.ndarray:
    """3 for tri-gram keys, 2 for ``(0, c, r)`` with r > 0, 1 for ``(0, c, 0)``."""
    w = unpack(keys)
    return np.where(w[..., 0] > 0, 3, np.where(w[..., 2] > 0, 2, 1))


def served_keys(keys: np.ndarray, trigram_keys: np.ndarray, bigram_keys: np.ndarray) -> np.ndarray:
    """The key whose entry serves each encoder window under back-off, for a PLOT that holds
    ``trigram_keys``, ``bigram_keys`` and every uni-gram: the window itself when held, else its
    bi-gram ``(0, c, r)`` when held, else its uni-gram ``(0, c, 0)``.

    Shapes: keys (N,) uint64; trigram_keys, bigram_keys sorted uint64 -> (N,) uint64.
    """
    keys = np.asarray(keys, dtype=np.uint64)

    def held(k: np.ndarray, table: np.ndarray) -> np.ndarray:
        if len(table) == 0:
            return np.zeros(k.shape, dtype=bool)
        pos = np.minimum(np.searchsorted(table, k), len(table) - 1)
        return table[pos] == k

    bi = bigram_backoff(keys)
    return np.where(held(keys, trigram_keys), keys, np.where(held(bi, bigram_keys), bi, unigram_backoff(keys)))
