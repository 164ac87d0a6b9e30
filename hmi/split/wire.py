"""The binary format of the tensors a private tenant and the base executor exchange.

A body is one or more tensors, each: the magic ``HMIT``, its dtype code (u8), its number of
dimensions n (u8), two reserved zero bytes, n little-endian u32 dimensions, then the elements
raw and little-endian in C order.  No JSON: a (32, 128, 384) float32 activation is 6 MiB and is
read with one copy.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

MAGIC = b"HMIT"
DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("u1")}
CODES = {np.dtype(v).newbyteorder("="): k for k, v in DTYPES.items()}
MAX_DIMS = 4
HEADER = struct.Struct("<4sBBxx")


class WireError(ValueError):
    """A body that is not a well-formed sequence of tensors (the message says where)."""


def encode(*tensors: torch.Tensor | np.ndarray) -> bytes:
    """The body of ``tensors`` (float32, int32, int64 or uint8; any shape up to 4 dimensions)."""
    parts = []
    for t in tensors:
        a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        code = CODES.get(a.dtype.newbyteorder("="))
        if code is None:
            raise WireError(f"dtype {a.dtype} cannot be sent; use float32, int32, int64 or uint8")
        if a.ndim > MAX_DIMS:
            raise WireError(f"{a.ndim} dimensions; at most {MAX_DIMS}")
        parts += [HEADER.pack(MAGIC, code, a.ndim), struct.pack(f"<{a.ndim}I", *a.shape),
                  np.ascontiguousarray(a, dtype=DTYPES[code]).tobytes()]
    return b"".join(parts)


def decode(body: bytes, limit: int | None = None) -> list[torch.Tensor]:
    """The tensors of a body, as CPU torch tensors; WireError for a malformed or truncated one, or
    when it holds more than ``limit`` tensors."""
    out, pos, view = [], 0, memoryview(body)
    while pos < len(body):
        if limit is not None and len(out) == limit:
            raise WireError(f"more than {limit} tensor(s) in the body")
        if len(body) - pos < HEADER.size:
            raise WireError(f"tensor {len(out)}: the header is cut short at byte {pos}")
        magic, code, ndim = HEADER.unpack_from(body, pos)
        if magic != MAGIC:
            raise WireError(f"tensor {len(out)}: no HMIT header at byte {pos}")
        if code not in DTYPES:
            raise WireError(f"tensor {len(out)}: unknown dtype code {code}")
        if ndim > MAX_DIMS:
            raise WireError(f"tensor {len(out)}: {ndim} dimensions; at most {MAX_DIMS}")
        pos += HEADER.size
        if len(body) - pos < 4 * ndim:
            raise WireError(f"tensor {len(out)}: its dimensions are cut short")
        shape = struct.unpack_from(f"<{ndim}I", body, pos)
        pos += 4 * ndim
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[code].itemsize
        if len(body) - pos < n:
            raise WireError(f"tensor {len(out)}: {len(body) - pos} bytes of data for shape {list(shape)} "
                            f"({n} expected)")
        a = np.frombuffer(view[pos:pos + n], dtype=DTYPES[code]).reshape(shape)
        out.append(torch.from_numpy(a.astype(a.dtype.newbyteorder("="), copy=True)))
        pos += n
    if not out:
        raise WireError("the body holds no tensor")
    return out
