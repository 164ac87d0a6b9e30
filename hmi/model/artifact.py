"""Versioned root artifacts: the calibrated windowed lower layers (of an encoder root: with gate
and merge; of a decoder root: the window copies of its lower layers).

One format for every root, written by :func:`write_artifact`: a folder ``$HMI_HOME/roots/<id>/``
holding one safetensors file of weights and one JSON file of metadata, placed by one rename, and
a pointer file naming the artifact served by default (``roots/current`` for the encoder,
``roots/current_decoder`` for the decoder).  The id is derived from the weights, so a PLOT records
exactly which root produced it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import BertModel

from hmi.home import hmi_home
from hmi.io import atomic_write_text, fsync_dir, sha256_file
from hmi.model.aliases import DEFAULT_L_LOW, pointer_name
from hmi.model.catalog import root_spec
from hmi.model.hplm import HPLM, WindowedEncoder
from hmi.model.root import RootSpec, default_spec, load_bert, load_tokenizer, weights_fingerprint


class ArtifactMissingError(RuntimeError):
    """No calibrated root artifact exists yet."""


@dataclass
class Root:
    """Everything one root serves with: the frozen full model (whose upper layers are shared),
    its tokenizer, the calibrated windowed encoder and the artifact's metadata."""

    spec: RootSpec
    bert: BertModel
    tokenizer: object
    windowed: WindowedEncoder
    artifact_id: str
    meta: dict

    def hplm(self) -> HPLM:
        return HPLM(self.bert, self.windowed)

    @property
    def hidden_size(self) -> int:
        return self.bert.config.hidden_size

    @property
    def l_low(self) -> int:
        return self.spec.l_low

    plot_kind = "encoder"

    @property
    def plot_lower(self) -> WindowedEncoder:
        """What turns windows into PLOT values and merges looked-up values (hmi.plot.paths)."""
        return self.windowed


def roots_dir(home: Path | None = None) -> Path:
    return (home or hmi_home()) / "roots"


def write_artifact(base: Path, name_of, weights: dict[str, torch.Tensor], weights_file: str, config_of,
                   config_file: str, pointer: str | None) -> str:
    """Writes one artifact atomically and returns its folder name: the weights go to a temporary
    folder, ``name_of(digest)`` names the folder from the weights' sha256 (hex), ``config_of(name)``
    gives the metadata (to which ``weights_sha256`` is added); the folder is fsynced and renamed
    into place, then ``pointer`` (if any) is replaced atomically to name it.  Where a whole
    artifact of the same weights is already in place (a recipe run again), it stays as it is, so
    that a process loading it never finds it missing; only ``pointer`` is written."""
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".new-"))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / weights_file))
        digest = sha256_file(tmp / weights_file)
        name = name_of(digest)
        if _weights_sha(base / name / config_file) == digest:
            if pointer is not None:
                atomic_write_text(base / pointer, name)
            return name
        (tmp / config_file).write_text(json.dumps({**config_of(name), "weights_sha256": digest}, indent=1,
                                                  sort_keys=True))
        _place(tmp, base, name, pointer)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return name


def _weights_sha(config_path: Path) -> str | None:
    """The ``weights_sha256`` an artifact's config records (written last, so the folder is whole),
    or None where there is no readable config."""
    try:
        return json.loads(config_path.read_text()).get("weights_sha256")
    except (OSError, ValueError):
        return None


def _place(tmp: Path, base: Path, name: str, pointer: str | None) -> None:
    """Moves the staged folder ``tmp`` (inside ``base``) to ``base/name`` durably, then points ``pointer`` at it."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    final = base / name
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(base)
    if pointer is not None:
        atomic_write_text(base / pointer, name)


def save_artifact(windowed: WindowedEncoder, bert: BertModel, spec: RootSpec, meta: dict, home: Path | None = None,
                  make_current: bool = True) -> str:
    """Writes an encoder root's calibrated windowed encoder as an artifact and returns its id.

    Tensors still equal to the root's (the word embeddings, which calibration keeps) are not
    stored: the config names them (``from_root``) and loading copies them from the root, whose
    identity the config records (``root_fingerprint``)."""
    state = windowed.state_dict()
    initial = WindowedEncoder(bert, spec.l_low).state_dict()
    from_root = sorted(k for k, v in state.items() if torch.equal(v, initial[k]))
    return write_artifact(
        roots_dir(home), lambda digest: f"{spec.prefix}-l{spec.l_low}-{digest[:16]}",
        {k: v for k, v in state.items() if k not in from_root}, "windowed.safetensors",
        lambda name: {**meta, "artifact_id": name, "root": spec.name, "root_source": spec.source, "l_low": spec.l_low,
                      "hidden_size": windowed.lower.hidden_size, "from_root": from_root,
                      "root_fingerprint": weights_fingerprint(bert)},
        "config.json", spec.pointer if make_current else None)


def point_at(artifact_id: str, pointer: str, home: Path | None = None) -> None:
    """Points ``pointer`` (an encoder root's ``RootSpec.pointer``, or ``current_decoder``) at the
    artifact folder ``artifact_id`` already in place, atomically."""
    if not (roots_dir(home) / artifact_id).is_dir():
        raise ArtifactMissingError(f"root artifact {artifact_id!r} not found under {roots_dir(home)}")
    atomic_write_text(roots_dir(home) / pointer, artifact_id)


def current_artifact_id(home: Path | None = None, pointer: str = "current") -> str | None:
    """The artifact a root's pointer names (``RootSpec.pointer``; the default root's: ``current``)."""
    p = roots_dir(home) / pointer
    return p.read_text().strip() if p.exists() else None


def artifact_config(artifact_id: str, home: Path | None = None) -> dict:
    p = roots_dir(home) / artifact_id / "config.json"
    if not p.exists():
        raise ArtifactMissingError(f"root artifact {artifact_id!r} not found under {roots_dir(home)}")
    return json.loads(p.read_text())


class ArtifactMismatchError(RuntimeError):
    """An artifact that does not belong to the root it is loaded with, or whose files are damaged."""


def load_windowed(folder: Path, config: dict, bert: BertModel, l_low: int) -> WindowedEncoder:
    """The calibrated windowed encoder of the artifact in ``folder``, checked against ``bert``:
    the root's fingerprint (when recorded) and the stored tensors plus those taken from the root
    covering the encoder exactly."""
    recorded = config.get("root_fingerprint")
    if recorded is not None and recorded != weights_fingerprint(bert):
        raise ArtifactMismatchError(
            f"root artifact {folder.name!r} was calibrated from another root (fingerprint {recorded[:12]}); "
            f"the installed root is {weights_fingerprint(bert)[:12]}: calibrate this root with `hmi calibrate`")
    windowed = WindowedEncoder(bert, l_low)
    stored = load_file(str(folder / "windowed.safetensors"))
    expected = set(windowed.state_dict())
    from_root = set(config.get("from_root", []))
    if set(stored) | from_root != expected or set(stored) & from_root:
        raise ArtifactMismatchError(
            f"root artifact {folder.name!r} does not fit this root: missing "
            f"{sorted(expected - set(stored) - from_root)[:3]}, unexpected {sorted(set(stored) - expected)[:3]}")
    windowed.load_state_dict(stored, strict=False)
    windowed.eval()
    for p in windowed.parameters():
        p.requires_grad_(False)
    return windowed


def uncalibrated(source: str | None, l_low: int) -> ArtifactMissingError:
    """The error of a root (``RootSpec.source``) split at ``l_low`` that has no calibrated artifact
    in the home, with the command that makes one."""
    if source is None and l_low == DEFAULT_L_LOW:
        # The default root's artifact ships with hmi: installing it takes seconds, calibrating minutes.
        return ArtifactMissingError("no calibrated root yet: run `hmi prepare` first (it installs the calibrated "
                                    "default root shipped with hmi)")
    named = f" --root {source}" if source else ""
    return ArtifactMissingError(f"no calibrated root yet: run `hmi calibrate{named} --l-low {l_low}` first")


def load_root(artifact_id: str | None = None, home: Path | None = None, spec: RootSpec | None = None) -> Root:
    """Loads a root and a calibrated artifact of it: by default the one ``spec``'s pointer names
    (the default root's when no spec is given); without ``spec``, the root the artifact records."""
    artifact_id = artifact_id or current_artifact_id(home, spec.pointer if spec else "current")
    if artifact_id is None:
        raise uncalibrated(spec.source, spec.l_low) if spec else uncalibrated(None, DEFAULT_L_LOW)
    meta = artifact_config(artifact_id, home)
    if spec is None:
        source = meta.get("root_source")
        spec = default_spec(meta["l_low"]) if source is None else root_spec(source, meta["l_low"], home)
    elif spec.l_low != meta["l_low"]:
        raise ArtifactMismatchError(f"root artifact {artifact_id!r} splits at L_low={meta['l_low']}, not {spec.l_low}")
    bert = load_bert(spec.model_dir)
    windowed = load_windowed(roots_dir(home) / artifact_id, meta, bert, spec.l_low)
    return Root(spec, bert, load_tokenizer(spec.model_dir), windowed, artifact_id, meta)


def calibration_shortfall(meta: dict) -> str | None:
    """What an artifact's calibration left out, for an operator: None when it ran every step of
    its recipe (every calibration since the recipe's steps no longer depend on a time budget);
    for an artifact of a budget that held fewer, how many, what that costs and the command that
    runs the whole recipe (continuing from the run's checkpoint where it is kept)."""
    cal = meta.get("calibration", {})
    done, steps = cal.get("steps_done"), cal.get("steps")
    if done is None or not steps or done >= steps:
        return None
    source, l_low = meta.get("root_source"), meta.get("l_low")
    flags = ("" if source is None else f" --root {source}") + (f" --l-low {l_low}" if l_low is not None else "")
    held = f"the time budget ({cal.get('max_minutes')} min) held {done} of the {steps} steps on this machine"
    cost = ("" if "steps_planned" not in cal else  # planned runs decayed their learning rate over the steps held
            ": the learning rate decayed over those. A shortened calibration costs accuracy (mpnet-base 6+6 at 325 "
            "of 800 steps: 4 to 10 points on classification tasks, docs/roots.md)")
    return (f"{held}{cost}. The whole recipe (continuing from the run's checkpoint where it is kept; "
            f"`--max-minutes M` takes it in slices): `hmi calibrate{flags}`")


SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def shipped_folder(pattern: str, config_file: str, weights_file: str, fits, shipped: Path = SHIPPED_DIR) -> Path | None:
    """The first artifact folder shipped with the package whose name matches ``pattern`` and whose
    metadata ``fits`` (root fingerprint, split), checked against its recorded sha256; None when
    none fits.  Encoder and decoder roots ship their calibrated windows this way."""
    for folder in sorted(shipped.glob(pattern)) if shipped.is_dir() else []:
        config = json.loads((folder / config_file).read_text())
        if not fits(config):
            continue
        if sha256_file(folder / weights_file) != config.get("weights_sha256"):
            raise ArtifactMismatchError(f"the shipped root artifact {folder.name} is damaged (its sha256 differs)")
        return folder
    return None


def install_folder(folder: Path, files: tuple[str, ...], base: Path, pointer: str) -> str:
    """Copies a shipped artifact ``folder`` into ``base`` (atomically, as ``write_artifact`` places
    one) and points ``pointer`` at it; returns its name."""
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".new-"))
    try:
        for f in files:
            shutil.copyfile(folder / f, tmp / f)
        _place(tmp, base, folder.name, pointer)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder.name


def find_shipped(bert: BertModel, l_low: int, shipped: Path = SHIPPED_DIR) -> Path | None:
    """The folder of the calibrated artifact shipped with the package for this root (by its
    fingerprint) and split, checked against its recorded sha256; None when none fits."""
    fingerprint = weights_fingerprint(bert)
    return shipped_folder("minilm-l*", "config.json", "windowed.safetensors",
                          lambda c: c.get("l_low") == l_low and c.get("root_fingerprint") == fingerprint, shipped)


def install_shipped(bert: BertModel, l_low: int, home: Path | None = None, shipped: Path = SHIPPED_DIR) -> str | None:
    """Installs the artifact :func:`find_shipped` finds as the current one (``hmi calibrate`` with
    its defaults reproduces it, ``hmi calibrate --check-shipped``); returns its id, or None."""
    folder = find_shipped(bert, l_low, shipped)
    if folder is None:
        return None
    return install_folder(folder, ("windowed.safetensors", "config.json"), roots_dir(home), pointer_name(None, l_low))


def uncalibrated_root(spec: RootSpec | None = None) -> Root:
    """The root with windowed layers copied from the full model, before calibration."""
    spec = spec or default_spec()
    bert = load_bert(spec.model_dir)
    windowed = WindowedEncoder(bert, spec.l_low).eval()
    return Root(spec, bert, load_tokenizer(spec.model_dir), windowed, "uncalibrated", {})
