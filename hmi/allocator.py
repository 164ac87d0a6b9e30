"""Process memory: the glibc allocator settings under which large tensors are reused, not page-faulted."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_allocator() -> bool:
    """Keeps freed heap memory in the process instead of returning it to the kernel (glibc).

    torch's CPU allocator hands every tensor to ``malloc``. glibc serves blocks above its mmap
    threshold with fresh ``mmap`` calls and trims freed memory at the heap's top, so a batch's
    activations (several MB each) are page-faulted in anew on every batch. With a 32 MiB mmap
    threshold (glibc's upper limit), a 1 GiB trim threshold and 256 MiB of top padding they are
    reused: the upper layers on 32 x 128 tokens ran in 175-187 ms instead of 225-246 ms
    (``benchmarks/bench_adapters.py``). The same settings as ``MALLOC_*_`` environment variables,
    applied to a running process. ``HMI_TUNE_MALLOC=0`` leaves glibc's defaults. Returns whether
    the settings were applied (False off glibc).
    """
    if os.environ.get("HMI_TUNE_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 256 << 20)))


def release_heap() -> bool:
    """Returns the heap's free memory to the kernel now (glibc's ``malloc_trim(0)``): what loading
    a root leaves behind (the decoder's dequantized weights, about 1 GB, once its parameters are
    moved to shared memory) and what the retained memory of :func:`tune_allocator` holds between
    busy periods. Returns whether it ran (False off glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
