"""Tenants' adapters that ship with the package (the demo tenants'), each for one root artifact.

A shipped adapter is a folder ``shipped/<tenant>/`` with ``adapter.safetensors`` (the canonical
weights as the adapter store keeps them, fp16) and ``meta.json``: its spec, the root artifact,
root weights and root PLOT it was trained on (its features come from that PLOT), the sha256 of
its weights and the metrics of its fine-tune.  It is served only where all three match and its
sha256 holds; ``hmi demo --check-shipped`` trains it again and compares, bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hmi.adapters.spec import AdapterSpec
from hmi.model.root import tensors_sha256

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


class ShippedAdapterError(RuntimeError):
    """A shipped adapter's files do not match their own record (damaged)."""


@dataclass(frozen=True)
class ShippedAdapter:
    name: str
    spec: AdapterSpec
    weights: dict[str, torch.Tensor]
    meta: dict


def as_shipped(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical weights as they ship (and as the adapter store keeps them): fp16."""
    return {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in weights.items()}


def weights_sha256(weights: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) over canonical weights in name order (``hmi.model.root.tensors_sha256``)."""
    return tensors_sha256(sorted(weights.items()))


def write_shipped(name: str, spec: AdapterSpec, weights: dict[str, torch.Tensor], meta: dict,
                  dest: Path | None = None) -> Path:
    """Writes a shipped adapter (weights in fp16, as the store keeps them); returns its folder."""
    dest = SHIPPED_DIR if dest is None else dest
    weights = as_shipped(weights)
    folder = dest / name
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter.safetensors"))
    record = {**meta, "name": name, "spec": spec.to_dict(), "weights_sha256": weights_sha256(weights)}
    (folder / "meta.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return folder


def read_shipped(name: str, dest: Path | None = None) -> ShippedAdapter | None:
    """The shipped adapter of tenant ``name`` whatever it was trained on, or None; raises
    ShippedAdapterError when its weights differ from their recorded sha256."""
    folder = (SHIPPED_DIR if dest is None else dest) / name
    if not (folder / "meta.json").exists():
        return None
    meta = json.loads((folder / "meta.json").read_text())
    weights = load_file(str(folder / "adapter.safetensors"))
    if weights_sha256(weights) != meta.get("weights_sha256"):
        raise ShippedAdapterError(f"the shipped adapter {name!r} is damaged (its sha256 differs from its record)")
    return ShippedAdapter(name, AdapterSpec.from_dict(meta["spec"]), weights, meta)


def trained_on(root_artifact: str, root_fingerprint: str, store, miss_policy: str) -> dict:
    """What a shipped adapter records it was trained on, and what it must find to be served: the
    root artifact, the root's weights fingerprint, the build fingerprint of the root PLOT
    ``store`` its features come from and the miss policy they were read with (``shipped_for``'s
    keywords)."""
    state = store.get_record("build") or {}
    return {"root_artifact": root_artifact, "root_fingerprint": root_fingerprint,
            "plot_fingerprint": state.get("fingerprint"), "miss_policy": miss_policy}


def shipped_for(name: str, root_artifact: str, root_fingerprint: str, plot_fingerprint: str | None,
                miss_policy: str, dest: Path | None = None) -> ShippedAdapter | None:
    """The shipped adapter of ``name`` when it was trained on this root artifact, root and root
    PLOT (its build's fingerprint) read with this miss policy, else None."""
    found = read_shipped(name, dest)
    if found is None:
        return None
    m = found.meta
    if (m.get("root_artifact"), m.get("root_fingerprint"), m.get("plot_fingerprint"), m.get("miss_policy")) != \
            (root_artifact, root_fingerprint, plot_fingerprint, miss_policy):
        return None
    return found
