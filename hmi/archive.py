"""Zip archives of a saved folder, as adapters travel over HTTP: written, and read with limits
(file count, unpacked size, one folder level, no pickle files)."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

from hmi.errors import Kind, Refusal

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_FILES = 16


class ArchiveError(Refusal, ValueError):
    """An archive that cannot be taken: ``Kind.TOO_LARGE`` for size, else ``UNPROCESSABLE``."""

    def __init__(self, code: str, message: str, kind: Kind = Kind.UNPROCESSABLE):
        super().__init__(kind, code, message)


def unzip(data: bytes, max_bytes: int) -> dict[str, bytes]:
    """The files of a zip archive by base name (one folder level is allowed, as zipping a saved
    folder makes it).  Refuses what is not a zip, more than ``MAX_FILES`` files, more than
    ``max_bytes`` uncompressed, nested folders, and pickle files."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise ArchiveError("not_a_zip", "the body is not a zip archive of the adapter's saved folder") from None
    members = [m for m in zf.infolist() if not m.is_dir()]
    if len(members) > MAX_FILES:
        raise ArchiveError("too_many_files", f"the archive has {len(members)} files; an adapter folder has at most "
                            f"{MAX_FILES}")
    if sum(m.file_size for m in members) > max_bytes:
        raise ArchiveError("body_too_large", f"the archive unpacks to more than {max_bytes} bytes", Kind.TOO_LARGE)
    out, budget = {}, max_bytes
    for m in members:
        parts = m.filename.replace("\\", "/").strip("/").split("/")
        if len(parts) > 2 or ".." in parts:
            raise ArchiveError("bad_archive", f"{m.filename!r}: the archive must hold one folder's files")
        name = parts[-1]
        if name.lower().endswith(PICKLE_SUFFIXES):
            raise ArchiveError("pickle_refused", f"{name}: pickle files are never loaded; save with "
                                "use_safetensors=True (safetensors only)")
        if name in out:
            raise ArchiveError("bad_archive", f"{name} appears twice in the archive")
        try:
            with zf.open(m) as f:
                out[name] = f.read(budget + 1)  # the headers' sizes may lie: what is read counts
        except (zipfile.BadZipFile, NotImplementedError, OSError, zlib.error) as exc:
            raise ArchiveError("bad_archive", f"{name} cannot be unpacked: {exc}") from None
        budget -= len(out[name])
        if budget < 0:
            raise ArchiveError("body_too_large", f"the archive unpacks to more than {max_bytes} bytes", Kind.TOO_LARGE)
    return out


def zip_files(files: dict[str, bytes], folder: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(f"{folder}/{name}", data)
    return buf.getvalue()


def zip_folder(folder: Path) -> bytes:
    """A saved folder's files (not its subfolders) as a zip archive."""
    folder = Path(folder)
    return zip_files({p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}, folder.name)
