"""Versioned root artifacts: the calibrated windowed lower layers (of an encoder root: with gate
and merge; of a decoder root: the window copies of its lower layers).

One format for every root, written by :func:`write_artifact`: a folder ``$HMI_HOME/roots/<id>/``
holding one safetensors file of weights and one JSON file of metadata, placed by one rename, and
a pointer file naming the artifact served by default (``roots/current`` for the encoder,
``roots/current_decoder`` for the decoder).  The id is derived from the weights, so a PLOT records
exactly which root produced it.
"""

from __future__ import annotations

import hashlib
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
from hmi.io import atomic_write_text, fsync_dir
from hmi.model.hplm import HPLM, WindowedEncoder
from hmi.model.root import RootSpec, default_spec, load_bert, load_tokenizer


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
    gives the metadata; the folder is fsynced and renamed into place, then ``pointer`` (if any)
    is replaced atomically to name it."""
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".new-"))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / weights_file))
        name = name_of(hashlib.sha256((tmp / weights_file).read_bytes()).hexdigest())
        (tmp / config_file).write_text(json.dumps(config_of(name), indent=1, sort_keys=True))
        for f in (weights_file, config_file):
            with open(tmp / f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        final = base / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(base)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if pointer is not None:
        atomic_write_text(base / pointer, name)
    return name


def save_artifact(windowed: WindowedEncoder, spec: RootSpec, meta: dict, home: Path | None = None,
                  make_current: bool = True) -> str:
    """Writes an encoder root's calibrated windowed encoder as an artifact and returns its id."""
    return write_artifact(
        roots_dir(home), lambda digest: f"minilm-l{spec.l_low}-{digest[:16]}", windowed.state_dict(),
        "windowed.safetensors",
        lambda name: {**meta, "artifact_id": name, "root": spec.name, "l_low": spec.l_low,
                      "hidden_size": windowed.lower.hidden_size},
        "config.json", "current" if make_current else None)


def current_artifact_id(home: Path | None = None) -> str | None:
    p = roots_dir(home) / "current"
    return p.read_text().strip() if p.exists() else None


def artifact_config(artifact_id: str, home: Path | None = None) -> dict:
    p = roots_dir(home) / artifact_id / "config.json"
    if not p.exists():
        raise ArtifactMissingError(f"root artifact {artifact_id!r} not found under {roots_dir(home)}")
    return json.loads(p.read_text())


def load_root(artifact_id: str | None = None, home: Path | None = None, spec: RootSpec | None = None) -> Root:
    """Loads the packaged root and a calibrated artifact (the current one by default)."""
    artifact_id = artifact_id or current_artifact_id(home)
    if artifact_id is None:
        raise ArtifactMissingError("no calibrated root yet: run `hmi calibrate` first")
    meta = artifact_config(artifact_id, home)
    spec = spec or default_spec(meta["l_low"])
    bert = load_bert(spec.model_dir)
    windowed = WindowedEncoder(bert, spec.l_low)
    windowed.load_state_dict(load_file(str(roots_dir(home) / artifact_id / "windowed.safetensors")))
    windowed.eval()
    for p in windowed.parameters():
        p.requires_grad_(False)
    return Root(spec, bert, load_tokenizer(spec.model_dir), windowed, artifact_id, meta)


def uncalibrated_root(spec: RootSpec | None = None) -> Root:
    """The root with windowed layers copied from the full model, before calibration."""
    spec = spec or default_spec()
    bert = load_bert(spec.model_dir)
    windowed = WindowedEncoder(bert, spec.l_low).eval()
    return Root(spec, bert, load_tokenizer(spec.model_dir), windowed, "uncalibrated", {})
