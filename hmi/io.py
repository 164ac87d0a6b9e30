"""Atomic file writes: a crash at any point leaves the old content or the new, never a mix."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable

try:
    import lmdb

    WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, lmdb.Error)
except ImportError:  # the standard library alone: an offline bundle unpacked before the dependencies are installed
    WRITE_ERRORS = (OSError,)

FULL_BELOW = 4 << 20  # bytes free under which a failed write is taken for a full disk


class DiskFullError(OSError):
    """A write met a full disk; nothing of it was kept (errno ENOSPC)."""


def as_disk_full(path: Path | str, exc: BaseException) -> DiskFullError | None:
    """``exc``, raised by a write under ``path``, as a DiskFullError when the disk is full (an
    ENOSPC or EDQUOT, or an LMDB commit's I/O error on a disk with less than ``FULL_BELOW``
    free: LMDB reports a full disk that way), else None."""
    if not isinstance(exc, WRITE_ERRORS):
        return None
    try:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and (free is None or free >= FULL_BELOW):
        return None
    left = "" if free is None else f" ({free} bytes free)"
    return DiskFullError(errno.ENOSPC, f"No space left on device: the disk holding {path} is full{left}; nothing "
                                       "of this write was kept. Free space and try again")


@contextmanager
def disk_writes(path: Path | str):
    """Turns a write's failure on a full disk (see :func:`as_disk_full`) into a DiskFullError."""
    try:
        yield
    except DiskFullError:
        raise
    except WRITE_ERRORS as exc:
        full = as_disk_full(path, exc)
        if full is None:
            raise
        raise full from exc


def fsync_dir(path: Path | str) -> None:
    """Makes the entries of a folder (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path | str, data: bytes) -> None:
    """Writes a new file and flushes it to disk (not atomic by itself: write it inside a folder
    that is renamed into place, or use ``atomic_write_bytes``)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path | str, data: bytes, mode: int | None = None) -> None:
    """Replaces ``path`` in one rename: after a crash it holds the old content or the new one."""
    atomic_write_with(path, lambda f: f.write(data), mode)


def atomic_write_with(path: Path | str, write: Callable[[BinaryIO], object], mode: int | None = None) -> None:
    """Replaces ``path`` in one rename with what ``write(f)`` writes to a new file (e.g.
    ``torch.save(state, f)``); a failure leaves ``path`` as it was and no temporary file behind.
    A writer that meets a full disk raises DiskFullError, also where it reports the full disk as
    another error (torch's zip writer raises RuntimeError)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        full = as_disk_full(path.parent, exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))) \
            if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, DiskFullError) else None
        if full is not None:
            raise full from exc
        raise


def atomic_write_text(path: Path | str, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path | str, obj, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True), mode)


def sha256_file(path: Path | str) -> str:
    """sha256 (hex) of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
