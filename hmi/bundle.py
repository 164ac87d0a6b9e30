"""Offline bundles: files (wheels, shipped artifacts, a root model's package) carried to a machine
that reaches no package registry over a channel that takes at most so many bytes at a time, in
pieces each checked by sha256 on arrival.

A bundle is a folder: ``manifest.json`` and ``piece-0000`` ... ``piece-NNNN``, the pieces being an
uncompressed tar stream of the files cut at ``piece_bytes`` (weights do not compress). The manifest
names every piece's size and sha256, the whole stream's, and every file with its size; it is
written last, into a folder renamed into place, so a bundle that exists is complete.
``check`` says which pieces are missing or damaged (the pieces may arrive one by one);
``unpack`` checks every piece before it writes anything, then writes each file atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from hmi.io import atomic_write_json, atomic_write_with, sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 1 << 20


class BundleError(RuntimeError):
    """A bundle that cannot be written or taken (the message says which file and why)."""


class _PieceWriter:
    """A write-only file object that cuts what is written into ``folder/piece-NNNN`` files of at
    most ``piece_bytes`` each, hashing each piece and the whole stream."""

    def __init__(self, folder: Path, piece_bytes: int):
        self.folder, self.piece_bytes = folder, piece_bytes
        self.pieces: list[dict] = []
        self.whole = hashlib.sha256()
        self._file = None
        self._hash = None
        self._left = 0

    def _next_piece(self) -> None:
        self._close_piece()
        name = f"piece-{len(self.pieces):04d}"
        self._file, self._hash, self._left = open(self.folder / name, "wb"), hashlib.sha256(), self.piece_bytes
        self.pieces.append({"name": name, "bytes": 0})

    def _close_piece(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self.pieces[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        while view:
            if self._left == 0:
                self._next_piece()
            part = view[: self._left]
            self._file.write(part)
            self._hash.update(part)
            self._left -= len(part)
            self.pieces[-1]["bytes"] += len(part)
            view = view[len(part):]
        return len(data)

    def close(self) -> None:
        self._close_piece()


class _PieceReader:
    """A read-only file object over the pieces in order, checking the whole stream's sha256 once
    it is read to its end."""

    def __init__(self, folder: Path, pieces: list[dict], whole_sha256: str):
        self._paths = iter([folder / p["name"] for p in pieces])
        self._file = None
        self._hash, self._expected = hashlib.sha256(), whole_sha256

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if self._file is None:
                path = next(self._paths, None)
                if path is None:  # the end of the stream (read again at the end: the same digest)
                    if self._hash.hexdigest() != self._expected:
                        raise BundleError("the pieces joined do not give the stream the manifest names (sha256)")
                    break
                self._file = open(path, "rb")
            data = self._file.read(CHUNK if n < 0 else n - len(out))
            if not data:
                self._file.close()
                self._file = None
                continue
            self._hash.update(data)
            out += data
        return bytes(out)


class _Hashing:
    """A file read through, hashing what is read."""

    def __init__(self, fh):
        self.fh, self.hash = fh, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.hash.update(data)
        return data


def _files(paths: Iterable[Path], base: Path) -> Iterator[tuple[Path, str]]:
    """Every regular file under ``paths`` (files or folders), sorted, with its name relative to
    ``base``; a path outside ``base``, a link or a missing path is refused."""
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise BundleError(f"{path}: no such file or folder")
        top = path.resolve()
        try:
            top.relative_to(base)
        except ValueError:
            raise BundleError(f"{path} is not under {base}: a bundle stores paths relative to its base (--base)") from None
        found = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file() or p.is_symlink())
        for f in found:
            if f.is_symlink():
                raise BundleError(f"{f} is a symbolic link: a bundle carries files")
            yield f, f.relative_to(base).as_posix()


def pack(paths: Iterable[Path], out: Path, piece_bytes: int, base: Path | None = None, progress=None) -> dict:
    """Writes the bundle ``out`` (a new folder) of every file under ``paths``, stored relative to
    ``base`` (default: the working directory), in pieces of at most ``piece_bytes``; returns its
    manifest.  ``progress(done_bytes, total_bytes)`` is called as files are added."""
    if piece_bytes < 1024:
        raise BundleError(f"pieces of {piece_bytes} bytes: give at least 1 KiB")
    out, base = Path(out), Path(base or Path.cwd()).resolve()
    if out.exists():
        raise BundleError(f"{out} exists: give a new folder")
    files = list(_files(paths, base))
    if not files:
        raise BundleError("nothing to bundle: the paths hold no file")
    names = [n for _, n in files]
    if len(set(names)) != len(names):
        raise BundleError("a file is named twice (paths that overlap)")
    total, done, t0 = sum(f.stat().st_size for f, _ in files), 0, time.monotonic()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = _PieceWriter(tmp, piece_bytes)
    members = []
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path, name in files:
            info, st = tarfile.TarInfo(name), path.stat()
            info.size, info.mode, info.mtime = st.st_size, st.st_mode & 0o755, int(st.st_mtime)
            with open(path, "rb") as fh:
                hashed = _Hashing(fh)
                tar.addfile(info, hashed)
            members.append({"name": name, "bytes": info.size, "sha256": hashed.hash.hexdigest()})
            done += info.size
            if progress:
                progress(done, total)
    writer.close()
    manifest = {"format": FORMAT, "piece_bytes": piece_bytes, "bytes": sum(p["bytes"] for p in writer.pieces),
                "sha256": writer.whole.hexdigest(), "pieces": writer.pieces, "files": members,
                "seconds": round(time.monotonic() - t0, 1)}
    atomic_write_json(tmp / MANIFEST, manifest, mode=0o644)
    os.rename(tmp, out)
    return manifest


def read_manifest(src: Path) -> dict:
    path = Path(src) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path} is missing: {src} is not a bundle (hmi bundle pack writes one)") from None
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path} cannot be read: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: bundle format {manifest.get('format')!r}, this HMI reads format {FORMAT}")
    return manifest


def check(src: Path) -> dict:
    """Every piece of the bundle ``src`` against its manifest: ``{"missing": [...], "damaged":
    [...], "present": n, "pieces": n, "bytes": total}`` (damaged: another size or sha256)."""
    return _pieces_state(Path(src), read_manifest(src))


def _pieces_state(src: Path, manifest: dict) -> dict:
    missing, damaged = [], []
    for p in manifest["pieces"]:
        path = src / p["name"]
        if not path.exists():
            missing.append(p["name"])
        elif path.stat().st_size != p["bytes"] or sha256_file(path) != p["sha256"]:
            damaged.append(p["name"])
    n = len(manifest["pieces"])
    return {"missing": missing, "damaged": damaged, "present": n - len(missing) - len(damaged), "pieces": n,
            "bytes": manifest["bytes"]}


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        raise BundleError(f"the bundle names a file outside its folder: {name!r}")
    return p


def unpack(src: Path, dest: Path) -> dict:
    """Checks every piece of the bundle ``src`` (nothing is written unless all are there and
    intact), then writes its files under ``dest``, each atomically (a file already there is
    replaced); returns the manifest."""
    src, dest = Path(src), Path(dest)
    manifest = read_manifest(src)
    state = _pieces_state(src, manifest)
    if state["missing"] or state["damaged"]:
        raise BundleError(f"{src}: {state['present']} of {state['pieces']} pieces are intact; missing: "
                          f"{', '.join(state['missing']) or 'none'}; damaged (size or sha256): "
                          f"{', '.join(state['damaged']) or 'none'}. Nothing was unpacked.")
    expected = {f["name"]: f for f in manifest["files"]}
    reader = _PieceReader(src, manifest["pieces"], manifest["sha256"])
    seen = set()
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        for member in tar:
            name = _safe_name(member.name)
            if not member.isfile() or member.name not in expected:
                raise BundleError(f"the bundle's stream holds {member.name!r}, which its manifest does not name as a file")
            fh = tar.extractfile(member)

            def write(out, fh=fh, name=member.name):
                digest = hashlib.sha256()
                while chunk := fh.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                if digest.hexdigest() != expected[name]["sha256"]:  # before the file replaces one
                    raise BundleError(f"{name}: its sha256 differs from the manifest's")

            atomic_write_with(dest / name, write, mode=member.mode | 0o600)
            seen.add(member.name)
    if seen != set(expected):
        raise BundleError(f"the bundle's stream lacks {sorted(set(expected) - seen)[:5]}")
    return manifest
