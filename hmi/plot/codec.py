"""How a PLOT value is laid out in bytes, and in how many LMDB records.

Two value formats (``PlotMeta.dtype``):

- ``float16``: the ``(n, H)`` representation as fp16, ``2 n H`` bytes.
- ``int8``: each of the ``n`` rows quantized symmetrically with its own scale,
  ``row ~= scale * q``, ``q = round(row / scale)`` in [-127, 127], ``scale = max|row| / 127``:
  ``n`` float32 scales then ``n H`` int8 values, ``n (H + 4)`` bytes.  The error of an element
  is at most ``scale / 2``.

LMDB keeps a record in its leaf page only when key and value fit in about half a page (2,040
bytes of a 4,096-byte page); a larger value takes overflow pages of its own, rounded up to whole
pages: 2,304 bytes of value cost 4,123 on disk.  ``PlotMeta.chunks`` > 1 splits each value
into that many equal records (the key followed by the chunk's index byte), sized so that they
stay in leaf pages; :func:`leaf_chunks` chooses the count.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hmi.plot.keys import to_bytes

PAGE = 4096
PAGE_HEADER = 16
NODE_OVERHEAD = 8 + 2  # the node header and its slot in the page's index
MAX_NODE = ((PAGE - PAGE_HEADER) // 2) & ~1  # LMDB's largest node kept in a leaf page
FORMATS = ("float16", "int8")


def value_bytes(dtype: str, n: int, hidden: int) -> int:
    if dtype == "float16":
        return 2 * n * hidden
    if dtype == "int8":
        return n * (hidden + 4)
    raise ValueError(f"unknown PLOT value format {dtype!r}; one of {', '.join(FORMATS)}")


def leaf_chunks(value_size: int, key_size: int = 8, within: float = 1.25) -> int:
    """The fewest records per value, each kept in a leaf page, whose disk cost stays within
    ``within`` times the value's bytes (pages packed with as many whole records as fit: a build
    appends its keys in order); the cheapest count if none does.  Fewer is faster: every record
    is one more B-tree search in a lookup (``benchmarks/bench_plot_formats.py``)."""
    costs = {}
    for chunks in range(1, 17):
        record = math.ceil(value_size / chunks) + key_size + (chunks > 1) + NODE_OVERHEAD
        if record - 2 <= MAX_NODE:
            costs[chunks] = chunks * PAGE / ((PAGE - PAGE_HEADER) // record)
    fitting = [c for c, cost in costs.items() if cost <= within * value_size]
    return min(fitting) if fitting else min(costs, key=costs.get)


def chunk_keys(keys: np.ndarray, chunks: int) -> list[bytes]:
    """The LMDB keys of each value's records: the 8-byte big-endian key, then the chunk's index
    byte (none when a value is one record). Shapes: keys (N,) uint64 -> N * chunks keys, in order."""
    if chunks == 1:
        return to_bytes(keys)
    be = np.asarray(keys, dtype=">u8")
    out = np.empty((len(be), chunks, 9), dtype=np.uint8)
    out[:, :, :8] = be.view(np.uint8).reshape(-1, 1, 8)
    out[:, :, 8] = np.arange(chunks, dtype=np.uint8)
    return out.reshape(-1, 9).view("V9").ravel().tolist()


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values in a PLOT's byte format.

    Shapes: values (N, n, H) float -> (N, value_bytes) uint8.
    """
    values = np.asarray(values)
    N = values.shape[0]
    if dtype == "float16":
        return np.ascontiguousarray(values, dtype=np.float16).view(np.uint8).reshape(N, -1)
    if dtype != "int8":
        raise ValueError(f"unknown PLOT value format {dtype!r}")
    v = values.astype(np.float32, copy=False)
    scale = np.abs(v).max(axis=2) / 127.0  # (N, n)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(v / scale[:, :, None]), -127, 127).astype(np.int8)
    return np.concatenate([scale.view(np.uint8).reshape(N, -1), q.view(np.uint8).reshape(N, -1)], axis=1)


def decode(raw: np.ndarray, dtype: str, n: int, hidden: int) -> np.ndarray:
    """The inverse of :func:`encode` (up to the format's rounding).

    Shapes: raw (N, value_bytes) uint8 -> (N, n, H) float16.
    """
    N = raw.shape[0]
    if dtype == "float16":
        return np.ascontiguousarray(raw).view(np.float16).reshape(N, n, hidden)
    scale = np.ascontiguousarray(raw[:, : 4 * n]).view(np.float32).reshape(N, n, 1)
    q = np.ascontiguousarray(raw[:, 4 * n:]).view(np.int8).reshape(N, n, hidden)
    v = torch.from_numpy(q.astype(np.float32)).mul_(torch.from_numpy(scale.copy()))
    return v.to(torch.float16).numpy()  # torch's fp16 conversion is vectorized, numpy's is not
