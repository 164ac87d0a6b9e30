"""Versioned root artifacts: the calibrated windowed lower layers, gate and merge.

Layout under ``$HMI_HOME/roots/<artifact_id>/``: ``windowed.safetensors`` and ``config.json``;
``$HMI_HOME/roots/current`` names the artifact served by default.  The id is derived from the
weights, so a PLOT records exactly which root produced it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import BertModel

from hmi.home import hmi_home
from hmi.io import atomic_write_text
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


def roots_dir(home: Path | None = None) -> Path:
    return (home or hmi_home()) / "roots"


def save_artifact(windowed: WindowedEncoder, spec: RootSpec, meta: dict, home: Path | None = None,
                  make_current: bool = True) -> str:
    """Writes the artifact atomically (a temporary folder renamed into place) and returns its id."""
    base = roots_dir(home)
    base.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in windowed.state_dict().items()}
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".new-"))
    try:
        save_file(state, str(tmp / "windowed.safetensors"))
        digest = hashlib.sha256((tmp / "windowed.safetensors").read_bytes()).hexdigest()[:16]
        artifact_id = f"minilm-l{spec.l_low}-{digest}"
        config = {**meta, "artifact_id": artifact_id, "root": spec.name, "l_low": spec.l_low,
                  "hidden_size": windowed.lower.hidden_size}
        (tmp / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        final = base / artifact_id
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if make_current:
        atomic_write_text(base / "current", artifact_id)
    return artifact_id


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
