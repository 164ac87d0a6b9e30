"""Portable adapter formats: what a tenant brings from elsewhere, or takes away.

* Encoder tenants: the ``adapters`` library's saved folder (``model.save_adapter(dir, name,
  use_safetensors=True)``): ``adapter_config.json`` and ``adapter.safetensors``, with a head either
  the library's own (``head_config.json`` + ``model_head.safetensors``: a classification or
  tagging head of any number of layers with the library's activations, its default
  ``add_classification_head(name, num_labels)`` included) or HMI's (``hmi_head.safetensors`` with
  ``head.w`` (H, C), ``head.b`` (C,) and any hidden layers' ``head.hidden.j.w``/``.b``, and
  ``hmi_spec.json``, which also carries the pooling).
* Decoder tenants: PEFT's LoRA folder (``model.save_pretrained(dir)``): ``adapter_config.json``
  and ``adapter_model.safetensors``.

Over HTTP a folder travels as one zip archive.  Reading is strict: safetensors only (a pickle
file is refused, never loaded), only what the server batches (the adapter variants its kernels
compute, weights in the upper layers only, the root's sizes), and every refusal says what
differs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from hmi.adapters.interop import convert, library_keys, to_library_layout
from hmi.adapters.spec import HEAD_ACTIVATIONS, MAX_HEAD_LAYERS, AdapterSpec, SpecError, lora_sites
from hmi.archive import ArchiveError

# The adapter variants the batched kernels compute (hmi.adapters.batched), as library config values.
REQUIRED = {
    "bottleneck": {"mh_adapter": True, "output_adapter": False, "non_linearity": "relu", "original_ln_before": False,
                   "original_ln_after": True, "residual_before_ln": True, "adapter_residual_before_ln": False,
                   "ln_before": False, "ln_after": False, "is_parallel": False, "scaling": 1.0, "use_gating": False,
                   "phm_layer": False, "cross_adapter": False, "inv_adapter": None},
    "lora": {"composition_mode": "add", "use_gating": False, "use_dora": False, "vera_d": None, "vera_b": None},
    "ia3": {"selfattn_lora": True, "intermediate_lora": True, "output_lora": False, "attn_matrices": ["k", "v"],
            "composition_mode": "scale", "use_gating": False, "use_dora": False, "vera_d": None, "vera_b": None},
}
PEFT_REQUIRED = {"peft_type": "LORA", "bias": "none", "use_rslora": False, "use_dora": False,
                 "modules_to_save": None, "fan_in_fan_out": False}


class PortableError(ArchiveError):
    """An uploaded adapter that cannot be served here (``ArchiveError``'s kinds)."""


@dataclass(frozen=True)
class RootShape:
    """What an adapter must fit: the root's family, sizes and split."""

    model_type: str  # "bert" (encoder roots) or "llama" (the decoder root)
    hidden: int
    layers: int
    l_low: int
    value_width: int  # the value projection's output width (decoders: key/value heads x head size)
    name: str = ""


def _json(files: dict[str, bytes], name: str) -> dict:
    if name not in files:
        raise PortableError("missing_file", f"the archive has no {name}")
    try:
        obj = json.loads(files[name])
    except (ValueError, UnicodeDecodeError):
        raise PortableError("bad_file", f"{name} is not JSON") from None
    if not isinstance(obj, dict):
        raise PortableError("bad_file", f"{name} is not a JSON object")
    return obj


def _tensors(files: dict[str, bytes], name: str) -> dict[str, torch.Tensor]:
    if name not in files:
        raise PortableError("missing_file", f"the archive has no {name}")
    try:
        return {k: v.float() for k, v in load_safetensors(files[name]).items()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the upload's fault
        raise PortableError("bad_file", f"{name} is not a readable safetensors file ({exc})") from None


# -- encoder tenants: the adapters library's format -----------------------------------------------
def _library_config(cfg: dict):
    import adapters  # deferred: importing adapters patches transformers

    try:
        return adapters.AdapterConfig.load(cfg).to_dict()
    except Exception as exc:  # noqa: BLE001 - the library's own message says what it could not read
        raise PortableError("bad_config", f"adapter_config.json is not an adapters-library config ({exc})") from None


def _kind(cfg: dict) -> str:
    arch = cfg.get("architecture")
    if arch in (None, "bottleneck"):
        return "bottleneck"
    if arch == "lora":
        return "ia3" if cfg.get("composition_mode") == "scale" else "lora"
    raise PortableError("unsupported_adapter", f"{arch} adapters are not served here; the server batches bottleneck, "
                        "LoRA and IA3 adapters")


def _check_config(kind: str, cfg: dict) -> None:
    diff = [f"{k}={cfg.get(k)!r} (served: {v!r})" for k, v in REQUIRED[kind].items() if cfg.get(k) != v]
    if diff:
        raise PortableError("unsupported_adapter", f"this {kind} adapter differs from what the server batches: "
                            + ", ".join(diff))


def _lora_targets(cfg: dict) -> tuple[str, ...]:
    """The LoRA sites a library config adapts: its attention matrices (when ``selfattn_lora``), the
    FFN's first layer (``intermediate_lora``) and second (``output_lora``)."""
    attn = list(cfg.get("attn_matrices") or []) if cfg.get("selfattn_lora") else []
    odd = [m for m in attn if m not in ("q", "k", "v")]
    if odd:
        raise PortableError("unsupported_adapter", f"LoRA on attention matrices {odd} is not served; the server batches "
                            "LoRA on q, k, v and the FFN's two layers")
    sites = attn + ["ffn_in"] * bool(cfg.get("intermediate_lora")) + ["ffn_out"] * bool(cfg.get("output_lora"))
    if not sites:
        raise PortableError("unsupported_adapter", "this LoRA adapter adapts no layer (selfattn_lora, intermediate_lora "
                            "and output_lora are all off)")
    return lora_sites(sites)


def _canonical_key(key: str) -> tuple[int, str] | None:
    """(absolute layer, library key with the adapter's name as ``{name}``, without the model's
    prefix), or None for a key that is no adapter weight."""
    m = re.search(r"(?:^|\.)(encoder\.layer\.(\d+)\..+)$", key)
    if m is None:
        return None
    return int(m.group(2)), re.sub(r"\.(adapters|loras)\.[^.]+\.", r".\1.{name}.", m.group(1))


def read_encoder(files: dict[str, bytes], root: RootShape) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """An encoder tenant's spec and canonical weights from an adapters-library folder; an adapter
    with weights in the lower layers is read as in every layer (``AdapterSpec.whole``: its tenant
    is served on the full root)."""
    saved = _json(files, "adapter_config.json")
    cfg = _library_config(saved.get("config", saved))
    if saved.get("model_type", root.model_type) != root.model_type:
        raise PortableError("wrong_root", f"the adapter was saved for a {saved['model_type']} model; this root is "
                            f"{root.model_type}")
    if saved.get("hidden_size", root.hidden) != root.hidden:
        raise PortableError("wrong_root", f"the adapter was saved for hidden size {saved['hidden_size']}; this root "
                            f"has {root.hidden}")
    kind = _kind(cfg)
    _check_config(kind, cfg)
    raw = _tensors(files, "adapter.safetensors")
    head_spec, head = _read_head(files, root)
    params = {"pooling": "cls", **head_spec, "kind": kind,
              "whole": any((k := _canonical_key(key)) is not None and k[0] < root.l_low for key in raw)}
    if kind == "lora":
        params.update(rank=cfg["r"], alpha=cfg["alpha"], targets=_lora_targets(cfg))
    if kind == "bottleneck":
        down = next((v for k, v in raw.items() if k.endswith("adapter_down.0.weight")), None)
        if down is None:
            raise PortableError("missing_weights", "adapter.safetensors has no bottleneck weights (adapter_down)")
        params["reduction_factor"] = max(1, root.hidden // down.shape[0])
    try:
        spec = AdapterSpec(**params)
    except SpecError as exc:
        raise PortableError("invalid_spec", str(exc)) from None
    weights = _library_weights(raw, spec, root)
    return spec, {**weights, **head}


def _library_weights(raw: dict[str, torch.Tensor], spec: AdapterSpec, root: RootShape) -> dict[str, torch.Tensor]:
    found: dict[tuple[int, str], torch.Tensor] = {}
    for key, t in raw.items():
        parsed = _canonical_key(key)
        if parsed is None:
            raise PortableError("unexpected_weights", f"adapter.safetensors holds {key}, which is no adapter weight")
        found[parsed] = t
    first = spec.first_layer(root.l_low)
    out = {}
    for layer in range(first, root.layers):
        for canon, (lib, how) in library_keys(spec, "{name}", layer).items():
            t = found.pop((layer, lib), None)
            if t is None and spec.whole:
                raise PortableError("lower_layer_weights", f"the adapter has weights in some of the layers this server "
                                    f"reads from its PLOT but no {lib}: leave out layers 0-{root.l_low - 1} "
                                    f"(leave_out={list(range(root.l_low))}) or adapt every layer (served on the full root)")
            if t is None:
                raise PortableError("missing_weights", f"the adapter has no {lib} (every upper layer "
                                    f"{root.l_low}-{root.layers - 1} needs its weights)")
            out[f"layers.{layer - first}.{canon}"] = convert(t, how)
    if found:
        extra = sorted(k for _, k in found)[:3]
        raise PortableError("unexpected_weights", f"adapter.safetensors holds weights this kind has no place for: {extra}")
    return out  # shapes: the server's SlotPool.check, as for every stored adapter


def _read_head(files: dict[str, bytes], root: RootShape) -> tuple[dict, dict[str, torch.Tensor]]:
    """The head's spec fields and weights: HMI's head when present, else the library's."""
    if "hmi_head.safetensors" in files or "hmi_spec.json" in files:
        return _read_hmi_head(files, root)
    if "head_config.json" not in files:
        raise PortableError("missing_head", "the archive has no head: save the adapter with its head (with_head=True, a "
                            "classification or tagging head) or add hmi_head.safetensors and hmi_spec.json")
    cfg = _json(files, "head_config.json").get("config", {})
    kind = {"classification": "classification", "tagging": "tagging"}.get(cfg.get("head_type"))
    layers, act = cfg.get("layers"), cfg.get("activation_function")
    if kind is None or cfg.get("use_pooler") or cfg.get("bias") is False or not isinstance(layers, int) \
            or not 1 <= layers <= MAX_HEAD_LAYERS or (act is not None and str(act).lower() not in HEAD_ACTIVATIONS):
        raise PortableError("unsupported_head", f"the server serves classification or tagging heads of 1 to "
                            f"{MAX_HEAD_LAYERS} layers with a bias, without pooler, with one of the activations "
                            f"{', '.join(HEAD_ACTIVATIONS)} (head_config.json says {json.dumps(cfg)[:200]})")
    label2id = cfg.get("label2id") or {}
    labels = [label for label, _ in sorted(label2id.items(), key=lambda kv: kv[1])] or \
             [f"LABEL_{i}" for i in range(int(cfg.get("num_labels", 0)))]
    w = _tensors(files, "model_head.safetensors")
    linears: dict[int, dict[str, torch.Tensor]] = {}  # module index in the head -> weight, bias
    for k, v in w.items():
        m = re.search(r"\.(\d+)\.(weight|bias)$", k)
        if m is None:
            raise PortableError("unsupported_head", f"model_head.safetensors holds {k}, which is no linear layer's")
        linears.setdefault(int(m.group(1)), {})[m.group(2)] = v
    order = [linears[i] for i in sorted(linears)]
    if len(order) != layers or any(set(lin) != {"weight", "bias"} for lin in order):
        raise PortableError("unsupported_head", f"model_head.safetensors must hold the {layers} linear layer(s) of the "
                            "head, each with a weight and a bias")
    out = {}
    for j, lin in enumerate(order):
        last = j == layers - 1
        want = (len(labels), root.hidden) if last else (root.hidden, root.hidden)
        if tuple(lin["weight"].shape) != want:
            raise PortableError("bad_head", f"the head's layer {j + 1} has a weight of shape {tuple(lin['weight'].shape)}; "
                                f"{'its ' + str(len(labels)) + ' labels' if last else 'a hidden layer'} on hidden size "
                                f"{root.hidden} need(s) {want}")
        prefix = "head" if last else f"head.hidden.{j}"
        out[f"{prefix}.w"], out[f"{prefix}.b"] = lin["weight"].t().contiguous(), lin["bias"]
    fields = {"head": kind, "labels": labels}
    if layers > 1:
        fields.update(head_layers=layers, head_activation=act)
    return fields, out


def _read_hmi_head(files: dict[str, bytes], root: RootShape) -> tuple[dict, dict[str, torch.Tensor]]:
    """HMI's own head (``hmi_head.safetensors`` + ``hmi_spec.json``), with the pooling the library's
    head has no place for."""
    spec = _json(files, "hmi_spec.json")
    w = _tensors(files, "hmi_head.safetensors")
    layers = spec.get("head_layers", 1)
    hidden = {f"head.hidden.{j}.{p}" for j in range(layers - 1) for p in "wb"} if isinstance(layers, int) else set()
    if set(w) != {"head.w", "head.b"} | hidden:
        raise PortableError("bad_head", "hmi_head.safetensors must hold head.w (H, C) and head.b (C,), and "
                            "head.hidden.j.w (H, H) and head.hidden.j.b (H,) for each hidden layer j of the head")
    labels = spec.get("labels") or []
    if tuple(w["head.w"].shape) != (root.hidden, len(labels)) or tuple(w["head.b"].shape) != (len(labels),):
        raise PortableError("bad_head", f"the head's shapes {tuple(w['head.w'].shape)}, {tuple(w['head.b'].shape)} "
                            f"do not fit hidden size {root.hidden} and {len(labels)} labels")
    fields = {"head": spec.get("head", "classification"), "labels": labels, "pooling": spec.get("pooling", "cls")}
    if layers != 1:
        fields.update(head_layers=layers, head_activation=spec.get("head_activation"))
    return fields, w


def write_encoder(spec: AdapterSpec, weights: dict[str, torch.Tensor], root: RootShape, name: str) -> dict[str, bytes]:
    """An encoder tenant's adapter as the library saves it (loadable with ``load_adapter`` and
    ``load_head``), plus HMI's head and spec (the pooling has no place in the library's head)."""
    import adapters  # deferred: importing adapters patches transformers

    prefix = "bert."
    lib = {}
    first = spec.first_layer(root.l_low)
    for layer in range(first, root.layers):
        for canon, (key, how) in library_keys(spec, name, layer).items():
            lib[prefix + key] = to_library_layout(weights[f"layers.{layer - first}.{canon}"].float(), how)
    cfg = {"config": spec.library_config(root.l_low).to_dict(), "hidden_size": root.hidden,
           "model_class": "BertAdapterModel", "model_name": root.name, "model_type": root.model_type, "name": name,
           "version": f"adapters.{adapters.__version__}"}
    act = spec.head_activation if spec.head_layers > 1 else None if spec.head == "tagging" else "tanh"
    head_cfg = {"config": {"head_type": spec.head, "num_labels": spec.num_labels, "layers": spec.head_layers,
                           "activation_function": act,
                           "label2id": {label: i for i, label in enumerate(spec.labels)}, "use_pooler": False,
                           "bias": True, "dropout_prob": None},
                "hidden_size": root.hidden, "model_class": "BertAdapterModel", "model_name": root.name,
                "model_type": root.model_type, "name": name, "version": f"adapters.{adapters.__version__}"}
    if spec.head == "tagging":  # the library's tagging head takes neither (its constructor refuses them)
        head_cfg["config"].pop("use_pooler")
        head_cfg["config"].pop("bias")
    return {"adapter_config.json": json.dumps(cfg, indent=1).encode(),
            "adapter.safetensors": save_safetensors(lib),
            "head_config.json": json.dumps(head_cfg, indent=1).encode(),
            "model_head.safetensors": save_safetensors(_library_head(spec, weights, name, act)),
            "hmi_head.safetensors": save_safetensors({k: v.float().contiguous() for k, v in weights.items()
                                                      if k.startswith("head.")}),
            "hmi_spec.json": json.dumps(spec.to_dict(), indent=1).encode()}


def _library_head(spec: AdapterSpec, weights: dict[str, torch.Tensor], name: str, act: str | None) -> dict:
    """The head's linear layers under the library's module indices (``heads.<name>.<i>``: each layer
    is a dropout, the linear layer, then the activation after hidden layers when there is one)."""
    per_layer = 3 if act else 2
    out = {}
    for j in range(spec.head_layers):
        prefix = "head" if j == spec.head_layers - 1 else f"head.hidden.{j}"
        i = j * per_layer + 1
        out[f"heads.{name}.{i}.weight"] = weights[f"{prefix}.w"].float().t().contiguous()
        out[f"heads.{name}.{i}.bias"] = weights[f"{prefix}.b"].float().contiguous()
    return out


# -- decoder tenants: PEFT's LoRA format ----------------------------------------------------------
def _peft_key(layer: int, proj: str, part: str) -> str:
    return f"base_model.model.model.layers.{layer}.self_attn.{proj}_proj.lora_{part}.weight"


def read_decoder(files: dict[str, bytes], root: RootShape, rank: int) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """A decoder tenant's spec and canonical weights from a PEFT LoRA folder."""
    cfg = _json(files, "adapter_config.json")
    diff = [f"{k}={cfg.get(k, v)!r} (served: {v!r})" for k, v in PEFT_REQUIRED.items() if cfg.get(k, v) != v]
    targets = cfg.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else targets
    if targets != ["q_proj", "v_proj"]:
        diff.append(f"target_modules={targets!r} (served: ['q_proj', 'v_proj'])")
    if cfg.get("r") != rank:
        diff.append(f"r={cfg.get('r')!r} (this server batches rank {rank})")
    if diff:
        raise PortableError("unsupported_adapter", "this LoRA differs from what the server batches: " + ", ".join(diff))
    try:
        spec = AdapterSpec.decoder(rank=rank, alpha=float(cfg.get("lora_alpha", 8)))
    except (SpecError, TypeError, ValueError) as exc:
        raise PortableError("invalid_spec", str(exc)) from None
    raw = _tensors(files, "adapter_model.safetensors")
    layers = {int(m.group(1)) for k in raw if (m := re.search(r"\.layers\.(\d+)\.", k))}
    lower = sorted(x for x in layers if x < root.l_low)
    if lower:
        raise PortableError("lower_layer_weights", f"the LoRA has weights in layers {lower}, which this server reads from "
                            f"its PLOT; train it with layers_to_transform={list(range(root.l_low, root.layers))}")
    out = {}
    for layer in range(root.l_low, root.layers):
        for proj in "qv":
            for part in "AB":
                t = raw.pop(_peft_key(layer, proj, part), None)
                if t is None:
                    raise PortableError("missing_weights", f"the LoRA has no {_peft_key(layer, proj, part)}")
                want = (rank, root.hidden) if part == "A" else ((root.hidden if proj == "q" else root.value_width), rank)
                if tuple(t.shape) != want:
                    raise PortableError("wrong_shape", f"{_peft_key(layer, proj, part)} has shape {tuple(t.shape)}; "
                                        f"this root needs {want}")
                out[f"layers.{layer - root.l_low}.lora.{proj}_{part}"] = t
    if raw:
        raise PortableError("unexpected_weights", f"adapter_model.safetensors holds weights the server has no place for: "
                            f"{sorted(raw)[:3]}")
    return spec, out


def write_decoder(spec: AdapterSpec, weights: dict[str, torch.Tensor], root: RootShape) -> dict[str, bytes]:
    """A decoder tenant's LoRA as PEFT saves it (loadable with ``PeftModel.from_pretrained``)."""
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": root.name, "r": spec.rank,
           "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
           "layers_to_transform": list(range(root.l_low, root.layers)), "bias": "none", "fan_in_fan_out": False,
           "modules_to_save": None, "use_rslora": False, "use_dora": False, "inference_mode": True}
    tensors = {_peft_key(layer, proj, part): weights[f"layers.{layer - root.l_low}.lora.{proj}_{part}"].float().contiguous()
               for layer in range(root.l_low, root.layers) for proj in "qv" for part in "AB"}
    return {"adapter_config.json": json.dumps(cfg, indent=1).encode(),
            "adapter_model.safetensors": save_safetensors(tensors)}
