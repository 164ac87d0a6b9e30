"""A consistent copy of a live ``HMI_HOME``, and bringing one back (``hmi backup`` / ``hmi restore``).

A server (and its jobs) may keep running while a backup is taken.  The copy is made in the order
that keeps it consistent: first the registry (one LMDB read transaction: every tenant's and job's
record at one instant), then each domain tree under the lock its writers take (``tree.json`` and
the versions it names), then each tenant's published adapter version (versions are immutable; a
version published meanwhile is taken instead, and a job the registry copy still shows running is
run again on restore from its kept inputs), then everything else.  Every LMDB store (registry,
PLOTs, including a root PLOT still being built, with its plan) is copied by LMDB itself with
compaction; other files are copied as they are.  Left out: calibration checkpoints (a calibration
in progress resumes from its own), lock files and the unfinished work folders of builds, uploads
and jobs (``.building-*``, ``.tmp-*``, ``.new-*``, ``.old-*``, unpublished adapter versions).

``manifest.json`` lists every file with its size and sha256; ``restore`` checks them all before it
writes anything, then places the copy as the new home in one rename.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import lmdb

from hmi.adapters.store import POINTER
from hmi.io import atomic_write_json, fsync_dir, sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
SKIP_TOP = {"calibration"}  # resumable work with its own checkpoints, not state to restore
SKIP_PREFIXES = (".building-", ".tmp-", ".new-", ".old-", ".fetch-", ".restore-")
SKIP_NAMES = {"lock.mdb", "tree.lock"}


class BackupError(RuntimeError):
    """A backup that cannot be taken or restored; the message says why."""


def _is_lmdb(folder: Path) -> bool:
    return (folder / "data.mdb").is_file()


def _copy_lmdb(src: Path, dst: Path) -> None:
    """A consistent, compacted copy of a live LMDB environment (one read transaction), plus the
    plain files beside it (a PLOT build's plan)."""
    dst.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(str(src), readonly=True, lock=True, max_dbs=16, subdir=True)
    try:
        env.copy(str(dst), compact=True)
    finally:
        env.close()
    for f in src.iterdir():
        if f.is_file() and f.name not in ("data.mdb", "lock.mdb") and not f.name.startswith(SKIP_PREFIXES):
            shutil.copy2(f, dst / f.name)


def _copy_tree(src: Path, dst: Path, done: set[Path]) -> None:
    """``src`` into ``dst``: LMDB environments by LMDB, other files as they are; what ``done``
    holds (copied earlier in the backup's order) and unfinished work are left out."""
    if src in done or src.name.startswith(SKIP_PREFIXES) or src.name in SKIP_NAMES:
        return
    if src.is_dir():
        if _is_lmdb(src):
            _copy_lmdb(src, dst)
            return
        dst.mkdir(parents=True, exist_ok=True)
        for child in sorted(src.iterdir()):
            _copy_tree(child, dst / child.name, done)
    elif src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def _copy_domains(home: Path, out: Path, done: set[Path]) -> None:
    """Each domain tree under its writers' lock: ``tree.json`` and the version folders it names."""
    for tree_dir in sorted((home / "domains").glob("*")) if (home / "domains").is_dir() else []:
        if not tree_dir.is_dir():
            continue
        with open(tree_dir / "tree.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                records = tree_dir / "tree.json"
                nodes = json.loads(records.read_text()) if records.exists() else {}
                dst = out / tree_dir.relative_to(home)
                dst.mkdir(parents=True, exist_ok=True)
                if records.exists():
                    shutil.copy2(records, dst / "tree.json")
                for node in nodes.values():
                    rel = Path(node["name"]) / node["version"] if node.get("version") else Path(node["name"])
                    _copy_tree(tree_dir / rel, dst / rel, set())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        done.add(tree_dir)


def _copy_tenants(home: Path, out: Path, done: set[Path], attempts: int = 5) -> None:
    """Each tenant's published adapter version (its pointer and that folder); a version replaced
    while it is copied is copied again from the new pointer."""
    base = home / "tenants"
    if not base.is_dir():
        return
    for tenant in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        dst = out / "tenants" / tenant.name
        for _ in range(attempts):
            pointer = tenant / POINTER
            try:
                version = pointer.read_text().strip() if pointer.exists() else None
                if version is None:  # stored before versions existed, or never published
                    if (tenant / "adapter.safetensors").exists():
                        _copy_tree(tenant, dst, set())
                    break
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(tenant / version, dst / version)
                (dst / POINTER).write_text(version)
                if pointer.read_text().strip() == version:
                    break
            except FileNotFoundError:  # pruned by a publish meanwhile: read the pointer again
                time.sleep(0.05)
        else:
            raise BackupError(f"tenant {tenant.name!r}: its adapter kept changing while it was copied")
    done.add(base)


def _manifest(out: Path) -> dict:
    files = {}
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(f.relative_to(out))] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    return files


def backup(home: Path, dest: Path) -> dict:
    """Takes a consistent copy of the live home ``home`` into the new folder ``dest`` (written in a
    hidden folder beside it, renamed when complete); returns the manifest."""
    home, dest = Path(home), Path(dest)
    if not home.is_dir():
        raise BackupError(f"no home at {home}")
    if dest.exists():
        raise BackupError(f"{dest} exists; a backup goes into a new folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".building-{dest.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    started = time.time()
    try:
        done: set[Path] = set()
        if _is_lmdb(home / "registry"):
            _copy_lmdb(home / "registry", work / "registry")
            done.add(home / "registry")
        _copy_domains(home, work, done)
        _copy_tenants(home, work, done)
        for child in sorted(home.iterdir()):
            if child.name not in SKIP_TOP:
                _copy_tree(child, work / child.name, done)
        files = _manifest(work)
        manifest = {"format": FORMAT, "home": str(home), "created": started, "seconds": round(time.time() - started, 2),
                    "files": files}
        atomic_write_json(work / MANIFEST, manifest)
        fsync_dir(work)
        os.rename(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def verify(src: Path) -> dict:
    """The manifest of the backup ``src`` once every file it lists is there with its size and
    sha256 (BackupError naming the first that is not)."""
    src = Path(src)
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise BackupError(f"{src} is not a backup of hmi (its {MANIFEST} is missing or unreadable: {exc})") from None
    if manifest.get("format") != FORMAT:
        raise BackupError(f"{src}: backup format {manifest.get('format')!r}; this hmi reads format {FORMAT}")
    for rel, want in manifest["files"].items():
        f = src / rel
        if not f.is_file():
            raise BackupError(f"{src}: {rel} is missing")
        if f.stat().st_size != want["bytes"] or sha256_file(f) != want["sha256"]:
            raise BackupError(f"{src}: {rel} differs from the backup's record (damaged)")
    return manifest


def restore(src: Path, home: Path, force: bool = False) -> dict:
    """Checks the backup ``src`` and makes it the home ``home`` (which must not exist, or be empty,
    unless ``force``: then the old home is moved aside to ``<home>.before-restore-<time>``); the
    new home is placed in one rename.  Returns the manifest."""
    src, home = Path(src), Path(home)
    manifest = verify(src)
    if home.exists() and any(home.iterdir()) and not force:
        raise BackupError(f"{home} is not empty; restore into a new home, or pass --force to move it aside")
    home.parent.mkdir(parents=True, exist_ok=True)
    work = home.parent / f".restore-{home.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        shutil.copytree(src, work, ignore=shutil.ignore_patterns(MANIFEST))
        fsync_dir(work)
        if home.exists():
            if any(home.iterdir()):
                os.rename(home, home.with_name(f"{home.name}.before-restore-{int(time.time())}"))
            else:
                home.rmdir()
        os.rename(work, home)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest
