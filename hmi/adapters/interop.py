"""Conversion between the ``adapters`` library's modules and the canonical tenant weights.

The library is the reference implementation and the training engine; serving reads canonical
weights (see hmi.adapters.spec).  Export/import use the library's own saved format
(``adapter_config.json`` + safetensors weights) so adapters move to and from other tools.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import BertModel

from hmi.adapters.spec import AdapterSpec, SpecError

# Where each LoRA site (hmi.adapters.spec.LORA_SITES) sits in a BERT-layout layer.
LORA_MODULES = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
                "ffn_in": "intermediate.dense", "ffn_out": "output.dense"}


def library_keys(spec: AdapterSpec, name: str, layer: int) -> dict[str, tuple[str, bool]]:
    """Canonical key suffix -> (library state-dict key, transpose?) for one absolute layer."""
    if spec.is_decoder:
        s = f"model.layers.{layer}.self_attn"
        return {f"lora.{p}_{part}": (f"{s}.{p}_proj.loras.{name}.lora_{part}", False) for p in "qv" for part in "AB"}
    base = f"encoder.layer.{layer}"
    if spec.kind == "bottleneck":
        a = f"{base}.attention.output.adapters.{name}"
        return {"bn.down_w": (f"{a}.adapter_down.0.weight", True), "bn.down_b": (f"{a}.adapter_down.0.bias", False),
                "bn.up_w": (f"{a}.adapter_up.weight", True), "bn.up_b": (f"{a}.adapter_up.bias", False)}
    if spec.kind == "lora":
        return {f"lora.{site}_{part}": (f"{base}.{LORA_MODULES[site]}.loras.{name}.lora_{part}", False)
                for site in spec.targets for part in "AB"}
    s = f"{base}.attention.self"
    return {"ia3.k": (f"{s}.key.loras.{name}.lora_B", None), "ia3.v": (f"{s}.value.loras.{name}.lora_B", None),
            "ia3.ffn": (f"{base}.intermediate.dense.loras.{name}.lora_B", None)}


def convert(t: torch.Tensor, how) -> torch.Tensor:
    if how is True:
        return t.t().contiguous()
    if how is None:  # IA3 vectors are stored (H, 1) by the library
        return t.reshape(-1).contiguous()
    return t.contiguous()


def to_library_layout(t: torch.Tensor, how) -> torch.Tensor:
    """The inverse of :func:`convert`: a canonical tensor as the library stores it (transposed,
    IA3 vectors as (H, 1) columns, or as is)."""
    if how is True:
        return t.t().contiguous()
    if how is None:
        return t.reshape(-1, 1).contiguous()
    return t.contiguous()


def attach(model, name: str, spec: AdapterSpec, l_low: int, train: bool = False) -> None:
    """Adds the spec's adapter to the upper layers of a root model (encoder or decoder) with the library."""
    import adapters  # deferred: importing adapters patches transformers

    if not hasattr(model, "adapters_config"):
        adapters.init(model)
    model.add_adapter(name, config=spec.library_config(l_low))
    if train:
        model.train_adapter(name)
    model.set_active_adapters(name)


def library_model(model):
    """A private copy of the root (encoder or decoder) for the library to modify (training,
    reference runs)."""
    return copy.deepcopy(model)


def from_library(model, name: str, spec: AdapterSpec, l_low: int) -> dict[str, torch.Tensor]:
    """Canonical adapter weights (no head) of a library adapter (from layer ``spec.first_layer(l_low)``)."""
    sd = model.state_dict()
    out = {}
    l_low = spec.first_layer(l_low)
    for layer in range(l_low, model.config.num_hidden_layers):
        for key, (lib, how) in library_keys(spec, name, layer).items():
            out[f"layers.{layer - l_low}.{key}"] = convert(sd[lib].detach(), how).clone()
    return out


def to_library(model, name: str, spec: AdapterSpec, l_low: int, weights: dict[str, torch.Tensor]) -> None:
    """Loads canonical weights into an attached library adapter (from layer ``spec.first_layer(l_low)``)."""
    sd = {}
    params = dict(model.named_parameters())
    l_low = spec.first_layer(l_low)
    for layer in range(l_low, model.config.num_hidden_layers):
        for key, (lib, how) in library_keys(spec, name, layer).items():
            t = weights[f"layers.{layer - l_low}.{key}"]
            target = params.get(lib)
            if target is None:
                raise SpecError(f"library model lacks {lib}")
            sd[lib] = to_library_layout(t, how).reshape(target.shape).to(target.dtype)
    with torch.no_grad():
        for k, v in sd.items():
            params[k].copy_(v)


def export_library_format(root_bert: BertModel, spec: AdapterSpec, l_low: int, weights: dict[str, torch.Tensor],
                          out_dir: Path, name: str = "tenant") -> Path:
    """Writes the adapter in the library's saved format, plus the head and the HMI spec beside it."""
    model = library_model(root_bert)
    attach(model, name, spec, l_low)
    to_library(model, name, spec, l_low, weights)
    out_dir = Path(out_dir)
    model.save_adapter(str(out_dir), name, with_head=False, use_safetensors=True)
    save_file({k: v.contiguous() for k, v in weights.items() if k.startswith("head.")}, str(out_dir / "hmi_head.safetensors"))
    (out_dir / "hmi_spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    return out_dir


def import_library_format(root_bert: BertModel, in_dir: Path, l_low: int,
                          spec: AdapterSpec | None = None) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """Reads an adapter saved by the library (``adapter_config.json`` + weights) into canonical
    weights.  The head comes from ``hmi_head.safetensors`` when present; otherwise the tenant's
    spec must be given and the head starts at zero (to be trained)."""
    in_dir = Path(in_dir)
    cfg_path = in_dir / "adapter_config.json"
    if not cfg_path.exists():
        raise SpecError(f"{in_dir} has no adapter_config.json: not an adapters-library adapter")
    if spec is None:
        if not (in_dir / "hmi_spec.json").exists():
            raise SpecError("the adapter has no hmi_spec.json: give its head and labels")
        spec = AdapterSpec.from_dict(json.loads((in_dir / "hmi_spec.json").read_text()))
    model = library_model(root_bert)
    import adapters

    adapters.init(model)
    name = model.load_adapter(str(in_dir), load_as="imported", set_active=True, use_safetensors=True)
    lib_cfg = model.adapters_config.get(name)
    arch = lib_cfg.get("architecture") if isinstance(lib_cfg, dict) else getattr(lib_cfg, "architecture", None)
    kind = {"lora": "ia3" if getattr(lib_cfg, "composition_mode", "add") == "scale" else "lora"}.get(arch, "bottleneck")
    if kind != spec.kind:
        raise SpecError(f"the adapter is a {kind} adapter, the spec says {spec.kind}")
    weights = from_library(model, name, spec, l_low)
    head_path = in_dir / "hmi_head.safetensors"
    if head_path.exists():
        weights.update(load_file(str(head_path)))
    else:
        weights["head.w"] = torch.zeros(root_bert.config.hidden_size, spec.num_labels)
        weights["head.b"] = torch.zeros(spec.num_labels)
    return spec, weights

