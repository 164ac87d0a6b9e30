"""Any encoder checkpoint of the BERT, RoBERTa or MPNet family in the one layout HMI runs: BERT's.

The three families share the transformer layer exactly (self-attention with a 1/sqrt(d) scale,
output projection, residual + LayerNorm, GELU FFN, residual + LayerNorm); they differ in
the embeddings and in how positions enter attention:

- RoBERTa and MPNet number positions from ``padding_idx + 1 = 2`` and pad with id 1 while
  id 0 is ``<s>``.  HMI's windows and PLOT keys reserve id 0 for "no token" (padding, the
  sequence's edges), so the conversion swaps ids 0 and 1 in the tokenizer and in the word
  embedding rows (the model computes exactly what it did), and drops the two unused position
  rows (BERT numbers positions from 0).  A token type embedding of zeros stands in where the
  family has none.
- MPNet adds a relative position bias to the attention scores of every layer, the same for all
  layers (``MPNetEncoder.compute_position_bias``).  It is kept as its own tensor
  (``relative_bias.safetensors``) and loaded as :class:`RelativeBias`, which the model code
  adds to the additive attention mask (``hmi.model.root.attention_mask``): a BERT layer adds
  the mask to its scores, so the sum is MPNet's attention.

The converted checkpoint is a folder that ``BertModel.from_pretrained`` and ``AutoTokenizer``
read; ``tests/model/test_convert.py`` compares it with the original model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

from hmi.model.aliases import RootError

FAMILIES = ("bert", "roberta", "mpnet")
RELATIVE_BIAS_FILE = "relative_bias.safetensors"
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class CheckpointError(RootError):
    """A folder that is not an encoder checkpoint HMI can serve as a root."""


class RelativeBias(nn.Module):
    """MPNet's relative position bias: bucketed distance -> one additive score per head.

    Semantics: bias[0, h, i, j] = weight[bucket(j - i), h] (T5-style buckets, 32 by default,
    exact up to distance 8, logarithmic to 128).
    Shapes: positions (T,) int64 -> (1, heads, T, T) float.
    """

    def __init__(self, num_buckets: int, heads: int):
        super().__init__()
        self.num_buckets = num_buckets
        self.weight = nn.Parameter(torch.zeros(num_buckets, heads))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        rel = positions[None, :] - positions[:, None]
        bucket = MPNetEncoder.relative_position_bucket(rel, num_buckets=self.num_buckets)
        return self.weight[bucket].permute(2, 0, 1).unsqueeze(0)


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder} is not a model checkpoint: it has no config.json")
    config = json.loads(path.read_text())
    family = config.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{folder}: model_type {family!r} is not an encoder HMI can split "
                              f"(one of {', '.join(FAMILIES)})")
    return config


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights (pickled weights are not read)")
    out = {}
    for f in files:
        if f.name != RELATIVE_BIAS_FILE:
            out.update(load_file(str(f)))
    return out


def _strip_prefix(weights: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    prefix = f"{family}."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}


def _mpnet_layer_names(key: str) -> str:
    for old, new in ((".attention.attn.q.", ".attention.self.query."), (".attention.attn.k.", ".attention.self.key."),
                     (".attention.attn.v.", ".attention.self.value."), (".attention.attn.o.", ".attention.output.dense."),
                     (".attention.LayerNorm.", ".attention.output.LayerNorm.")):
        key = key.replace(old, new)
    return key


def bert_weights(weights: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A family's state dict in BERT's names and conventions (ids 0 and 1 swapped, positions
    from 0); returns (BERT weights, MPNet's relative bias (buckets, heads) or None)."""
    family = config["model_type"]
    w = _strip_prefix(weights, family)
    if family == "bert":
        return {k: v for k, v in w.items() if not k.startswith(("pooler.", "cls."))}, None
    out, bias = {}, None
    for k, v in w.items():
        if k.startswith(("pooler.", "lm_head.", "embeddings.position_ids")):
            continue
        if k == "encoder.relative_attention_bias.weight":
            bias = v
            continue
        out[_mpnet_layer_names(k) if family == "mpnet" else k] = v
    emb = out["embeddings.word_embeddings.weight"].clone()
    emb[[0, 1]] = emb[[1, 0]]
    out["embeddings.word_embeddings.weight"] = emb
    out["embeddings.position_embeddings.weight"] = out["embeddings.position_embeddings.weight"][2:].clone()
    if "embeddings.token_type_embeddings.weight" not in out:
        out["embeddings.token_type_embeddings.weight"] = torch.zeros(1, emb.shape[1], dtype=emb.dtype)
    return out, bias


def bert_config(config: dict) -> dict:
    family = config["model_type"]
    if family == "bert":
        return config
    out = {
        "model_type": "bert", "architectures": ["BertModel"],
        "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"], "num_attention_heads": config["num_attention_heads"],
        "intermediate_size": config["intermediate_size"], "hidden_act": config.get("hidden_act", "gelu"),
        "layer_norm_eps": config.get("layer_norm_eps", 1e-12),
        "max_position_embeddings": config["max_position_embeddings"] - 2,
        "type_vocab_size": config.get("type_vocab_size", 1), "pad_token_id": 0,
        "hidden_dropout_prob": config.get("hidden_dropout_prob", 0.1),
        "attention_probs_dropout_prob": config.get("attention_probs_dropout_prob", 0.1),
        "initializer_range": config.get("initializer_range", 0.02),
        "hmi_converted_from": family,
    }
    if family == "mpnet":
        out["relative_attention_num_buckets"] = config.get("relative_attention_num_buckets", 32)
    return out


def _swap01(i: int) -> int:
    return {0: 1, 1: 0}.get(i, i)


def swap_tokenizer_ids(tok: dict) -> dict:
    """A ``tokenizer.json`` with ids 0 and 1 exchanged wherever ids appear (vocabulary, added
    tokens, post-processor, padding)."""
    vocab = tok["model"]["vocab"]
    if isinstance(vocab, dict):
        tok["model"]["vocab"] = {t: _swap01(i) for t, i in vocab.items()}
    else:  # Unigram: a list of [piece, score] in id order
        vocab[0], vocab[1] = vocab[1], vocab[0]
    for t in tok.get("added_tokens", []):
        t["id"] = _swap01(t["id"])
    post = tok.get("post_processor") or {}
    for key in ("sep", "cls"):
        if key in post:
            post[key] = [post[key][0], _swap01(post[key][1])]
    for spec in (post.get("special_tokens") or {}).values():
        spec["ids"] = [_swap01(i) for i in spec["ids"]]
    if tok.get("padding"):
        tok["padding"]["pad_id"] = _swap01(tok["padding"]["pad_id"])
    return tok


def convert_checkpoint(src: Path, dst: Path) -> None:
    """Writes the BERT-layout checkpoint of ``src`` into the (new, empty) folder ``dst``."""
    src, dst = Path(src), Path(dst)
    config = read_config(src)
    if not (src / "tokenizer.json").exists():
        raise CheckpointError(f"{src} has no tokenizer.json (a fast tokenizer is needed)")
    weights, bias = bert_weights(_weights(src), config)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    if bias is not None:
        save_file({"weight": bias.contiguous()}, str(dst / RELATIVE_BIAS_FILE))
    (dst / "config.json").write_text(json.dumps(bert_config(config), indent=1, sort_keys=True))
    tok = json.loads((src / "tokenizer.json").read_text())
    if config["model_type"] != "bert":
        tok = swap_tokenizer_ids(tok)
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    copy_sentence_modules(src, dst)


def copy_sentence_modules(src: Path, dst: Path) -> None:
    """The sentence-transformers pipeline of ``src`` (``modules.json`` and each module's
    ``config.json``), so that the converted root pools its sentence embeddings as the original does
    (``hmi.model.root.sentence_pooling``)."""
    if not (src / "modules.json").exists():
        return
    shutil.copyfile(src / "modules.json", dst / "modules.json")
    for module in json.loads((src / "modules.json").read_text()):
        path = module.get("path", "")
        if path and (src / path / "config.json").exists():
            (dst / path).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / path / "config.json", dst / path / "config.json")


def load_relative_bias(folder: Path, config) -> RelativeBias | None:
    """The converted checkpoint's relative position bias, frozen, or None (BERT, RoBERTa)."""
    path = Path(folder) / RELATIVE_BIAS_FILE
    if not path.exists():
        return None
    weight = load_file(str(path))["weight"]
    bias = RelativeBias(weight.shape[0], config.num_attention_heads)
    bias.weight.data.copy_(weight)
    return bias.requires_grad_(False)
