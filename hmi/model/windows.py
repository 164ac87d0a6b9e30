"""Token windows of the lower layers (docs/design.md, section 1).

Encoder window of token i: ``(x[i-1], x[i], x[i+1])``, id 0 at the sequence edges and for
padding neighbours; padding positions get no window.  Causal window of token i:
``(x[i-2], x[i-1], x[i])``.  Everything is vectorized numpy: no per-token Python loop.
"""

from __future__ import annotations

import numpy as np

ID_BITS = 21  # bits of one token id in a packed window (unique_windows here, PLOT keys in hmi.plot.keys)
_LOW = (1 << ID_BITS) - 1


def encoder_windows(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Encoder tri-gram windows of a padded batch.

    Semantics: win[b, i] = (x[b, i-1], x[b, i], x[b, i+1]) with x = ids * mask and id 0 outside
    the sequence; win[b, i] = (0, 0, 0) where mask[b, i] == 0.
    Shapes: ids (B, T) int; mask (B, T) {0,1} -> win (B, T, 3) int64.
    """
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(mask).astype(bool)
    x = np.where(mask, ids, 0)
    win = np.zeros(x.shape + (3,), dtype=np.int64)
    win[:, :, 1] = x
    win[:, 1:, 0] = x[:, :-1]
    win[:, :-1, 2] = x[:, 1:]
    win[~mask] = 0
    return win


def causal_windows(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Causal tri-gram windows of a padded batch.

    Semantics: win[b, i] = (x[b, i-2], x[b, i-1], x[b, i]), id 0 before the sequence start;
    win[b, i] = (0, 0, 0) where mask[b, i] == 0.
    Shapes: ids (B, T) int; mask (B, T) {0,1} -> win (B, T, 3) int64.
    """
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(mask).astype(bool)
    x = np.where(mask, ids, 0)
    win = np.zeros(x.shape + (3,), dtype=np.int64)
    win[:, :, 2] = x
    win[:, 1:, 1] = x[:, :-1]
    win[:, 2:, 0] = x[:, :-2]
    win[~mask] = 0
    return win


def unique_windows(win: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct windows of a batch and, for each real position, the index of its window.

    Shapes: win (B, T, 3); mask (B, T) -> uniq (U, 3) int64, inverse (B, T) int64 (-1 at padding).
    The distinct windows come in lexicographic order.  Ids under 2**21 (every vocabulary here)
    are packed three to an int64 that sorts like the window, and the ints are made distinct (far
    cheaper than ``np.unique(axis=0)`` on rows, the path larger ids take, with the same result).
    """
    mask = np.asarray(mask).astype(bool)
    flat = np.asarray(win, dtype=np.int64)[mask]
    inverse = np.full(mask.shape, -1, dtype=np.int64)
    if flat.shape[0] == 0:
        return np.zeros((0, 3), dtype=np.int64), inverse
    if flat.min() >= 0 and flat.max() <= _LOW:
        keys, inv = np.unique((flat[:, 0] << 2 * ID_BITS) | (flat[:, 1] << ID_BITS) | flat[:, 2], return_inverse=True)
        uniq = np.stack([keys >> 2 * ID_BITS, (keys >> ID_BITS) & _LOW, keys & _LOW], axis=1)
    else:
        uniq, inv = np.unique(flat, axis=0, return_inverse=True)
    inverse[mask] = inv.reshape(-1)
    return uniq.astype(np.int64), inverse


def present_groups(present: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Windows grouped by which of their three tokens are present, for computing each window on
    its present tokens alone.

    Semantics: one group per distinct row of ``present``, in order of that row read as a binary
    number: (the windows with that row, the columns where it is True).
    Shapes: present (N, 3) bool -> [(rows (n,) int64, cols (k,) int64), ...].
    """
    present = np.asarray(present).astype(bool)
    code = present.astype(np.int64) @ np.array([4, 2, 1])
    return [(np.flatnonzero(code == c), np.flatnonzero([c >> 2 & 1, c >> 1 & 1, c & 1]))
            for c in np.unique(code)]
