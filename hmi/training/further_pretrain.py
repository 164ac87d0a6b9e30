"""Further pretraining of a branch's windowed lower layers on its domain's corpus.

Only the windowed lower layers, the gate and the merge learn; the shared upper layers stay frozen,
so every tenant's adapters keep working on top of a branch.  Two objectives:

- ``distill`` (the default): the root's full-context model is the teacher on the domain's text,
  with calibration's losses (its layer-``L_low`` states, every upper layer's output, the pooled
  output), each text read as the branch's PLOT will serve it (its held-out half's back-off).  The
  windows learn what the full root makes of this domain's text, which is what a tenant's adapters
  were meant to read (``docs/results/bench_domains.md``: it is the objective that makes a branch help).
- ``mlm`` (the paper's): masked language modelling through the frozen upper layers and a fresh
  MLM head (the packaged roots ship none), trained alone for the first ``head_warmup`` of the steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.bert.modeling_bert import BertOnlyMLMHead

from hmi.io import atomic_write_with
from hmi.model.aliases import calibration_recipe
from hmi.model.artifact import Root
from hmi.model.hplm import UpperLayers, WindowedEncoder
from hmi.model.kernels import bf16_matmuls
from hmi.model.root import weights_fingerprint
from hmi.training.calibrate import CalibrationConfig, HeldOutBackoff, distill_fit, distill_steps, quality, token_lists
from hmi.training.fit import Fit, deterministic
from hmi.training.objectives import DEFAULT_BATCH, DEFAULT_LR, DEFAULT_OBJECTIVE, DEFAULT_STEPS, OBJECTIVES

IGNORE = -100




@dataclass
class FPTConfig:
    steps: int | None = None  # None: the objective's (DEFAULT_STEPS), and so for the batch and the rate
    batch_size: int | None = None
    max_len: int = 128
    lr: float | None = None
    mlm_probability: float = 0.15
    seed: int = 0
    eval_lines: int = 64
    head_warmup: float = 0.3  # share of steps that train the fresh MLM head alone, lower side frozen
    objective: str = DEFAULT_OBJECTIVE
    checkpoint_every: int = 25  # distillation's checkpoints, when it is given a file for them

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown further-pretraining objective {self.objective!r}; use one of {', '.join(OBJECTIVES)}")
        for name, default in (("steps", DEFAULT_STEPS), ("lr", DEFAULT_LR), ("batch_size", DEFAULT_BATCH)):
            if getattr(self, name) is None:
                setattr(self, name, default[self.objective])


def mask_tokens(ids: torch.Tensor, mask: torch.Tensor, tokenizer, gen: torch.Generator,
                prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: 15% of real, non-special tokens are targets; of those 80% become [MASK],
    10% a random token, 10% stay.  Shapes: ids, mask (B, T) -> (masked ids, labels) (B, T)."""
    special = torch.zeros_like(ids, dtype=torch.bool)
    for sid in tokenizer.all_special_ids:
        special |= ids == sid
    candidates = mask.bool() & ~special
    probs = torch.full(ids.shape, prob)
    chosen = (torch.rand(ids.shape, generator=gen) < probs) & candidates
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    roll = torch.rand(ids.shape, generator=gen)
    out = ids.clone()
    out[chosen & (roll < 0.8)] = tokenizer.mask_token_id
    rand_pos = chosen & (roll >= 0.8) & (roll < 0.9)
    out[rand_pos] = torch.randint(999, tokenizer.vocab_size, (int(rand_pos.sum()),), generator=gen)
    return out, labels


def mlm_head(config, encoder: WindowedEncoder):
    """A fresh MLM head (the packaged root ships none: its transform and bias would be new anyway)
    with the decoder tied to the branch's word embeddings."""
    torch.manual_seed(0)
    head = BertOnlyMLMHead(config)
    head.predictions.decoder.weight = encoder.lower.embeddings.word_embeddings.weight
    return head


def _batches(tokenizer, lines, cfg, rng):
    order = rng.permutation(len(lines))
    for s in range(0, len(order), cfg.batch_size):
        enc = tokenizer([lines[i] for i in order[s:s + cfg.batch_size]], truncation=True, max_length=cfg.max_len,
                        padding=True, return_tensors="pt")
        yield enc["input_ids"], enc["attention_mask"]


def mlm_loss(encoder, upper, head, tokenizer, lines, cfg, seed: int = 1) -> float:
    """Held-out MLM loss with a fixed masking (so before/after are comparable)."""
    gen = torch.Generator().manual_seed(seed)
    total, n = 0.0, 0
    encoder.eval()
    with torch.no_grad():
        for ids, mask in _batches(tokenizer, lines, cfg, np.random.default_rng(seed)):
            mids, labels = mask_tokens(ids, mask, tokenizer, gen, cfg.mlm_probability)
            logits = head(upper(encoder(mids, mask), mask))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                                   reduction="sum")
            total += loss.item()
            n += int((labels != IGNORE).sum())
    return total / max(1, n)


def further_pretrain(root: Root, encoder: WindowedEncoder, lines: list[str], cfg: FPTConfig,
                     progress: bool = True, should_stop=None, keep_head: list | None = None,
                     on_progress=None, checkpoint: Path | None = None) -> dict:
    """Trains ``encoder`` (a copy of the parent's lower side) in place with ``cfg.objective`` on
    ``lines`` but their last ``cfg.eval_lines``, which measure it; returns the measures before and
    after (``summary`` words them) and timings.  ``keep_head``, when a list, receives the trained
    MLM head (``mlm``, for evaluations through a PLOT); ``on_progress(fraction, info)`` hears every
    fifth step; ``should_stop()`` cancels.  With ``checkpoint`` (a file), distillation saves its
    state there every ``cfg.checkpoint_every`` steps and, called again with the same arguments
    after a stop, continues from it (``distill_pretrain``)."""
    held, train = lines[-cfg.eval_lines:], lines[:-cfg.eval_lines] or lines
    if cfg.objective == "distill":
        return distill_pretrain(root, encoder, held, train, cfg, progress, should_stop, on_progress, checkpoint)
    return mlm_pretrain(root.bert, root.tokenizer, encoder, held, train, cfg, progress, should_stop, keep_head,
                        on_progress)


def text_digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def load_checkpoint(path: Path | None, recipe: dict) -> dict | None:
    """A distillation checkpoint at ``path`` made by the same ``recipe``; None when there is none,
    it is unreadable or it belongs to another recipe (the run then starts from its beginning)."""
    if path is None or not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - a damaged checkpoint only costs the steps it held
        return None
    return saved if saved.get("recipe") == json.dumps(recipe, sort_keys=True) else None


def summary(metrics: dict) -> str:
    """What a branch's further pretraining achieved, in words (CLI and listings)."""
    if metrics.get("objective", "mlm") == "mlm":
        return f"MLM loss {metrics.get('mlm_loss_before')} -> {metrics.get('mlm_loss_after')}"
    return (f"pooled cosine to the full root on held-out domain text as served "
            f"{metrics.get('pooled_cosine_before')} -> {metrics.get('pooled_cosine_after')}")


# What a root's calibration recipe says of how a step computes (not of how many steps, at which
# rate): a domain branch's distillation runs its steps the same way.
STEP_KERNELS = ("bf16", "present_tokens")


def step_kernels(root: Root) -> dict:
    """How the root's own calibration computes a step (``STEP_KERNELS`` of its recipe, e.g. bf16
    GEMMs and windows on their present tokens for mpnet-base); {} for the default root."""
    recipe = calibration_recipe(root.spec.source) if root.spec.source else {}
    return {k: recipe[k] for k in STEP_KERNELS if k in recipe}


def distill_pretrain(root: Root, encoder: WindowedEncoder, held: list[str], train: list[str], cfg: FPTConfig,
                     progress: bool = True, should_stop=None, on_progress=None, checkpoint: Path | None = None) -> dict:
    """Distillation from the full-context root on the domain's ``train`` lines (calibration's
    losses and back-off, ``hmi.training.calibrate``), starting from ``encoder``'s weights.
    Measured: the cosine of the merged lower output and of the pooled final output to the full
    root's, on the ``held`` lines read as a PLOT of the training lines serves them.

    With ``checkpoint``, the state (weights, optimizer and schedule, the random generator, the
    measure before) is written there every ``cfg.checkpoint_every`` steps, atomically; a call
    that finds a checkpoint of the same recipe (config, lines, starting weights) continues from
    it, and ends with the weights an uninterrupted run gives (tested bit for bit).  Its steps
    compute as the root's calibration does (``step_kernels``)."""
    branch = dataclasses.replace(root, windowed=encoder)
    kernels = step_kernels(root)
    ccfg = CalibrationConfig(steps=cfg.steps, batch_size=cfg.batch_size, max_len=cfg.max_len, lr=cfg.lr, seed=cfg.seed,
                             warmup=max(1, min(20, cfg.steps // 10)),
                             checkpoint_every=cfg.checkpoint_every, **kernels)
    lists = token_lists(root.tokenizer, train, cfg.max_len)
    backoff = HeldOutBackoff(lists)
    recipe = {"config": asdict(cfg), "held": text_digest(held), "train": text_digest(train),
              "start": weights_fingerprint(encoder), **({"kernels": kernels} if kernels else {})}
    fit = distill_fit(encoder, ccfg, "further pretraining (distillation)", progress=progress, should_stop=should_stop,
                      on_progress=on_progress, report_every=5)
    saved = load_checkpoint(checkpoint, recipe)
    encoder.eval()
    if saved is None:
        before = quality(branch, held, cfg.max_len, cfg.batch_size, serve=backoff.serve(None))
        torch.manual_seed(cfg.seed)
    else:
        encoder.load_state_dict(saved["model"])
        fit.load_state_dict(saved)  # torch's random state too
        before = json.loads(saved["before"])
    resumed_at = fit.step_count

    def save() -> None:
        if checkpoint is not None:
            state = {"model": encoder.state_dict(), **fit.state_dict(),
                     "before": json.dumps(before), "recipe": json.dumps(recipe, sort_keys=True)}
            atomic_write_with(checkpoint, lambda f: torch.save(state, f))

    t0 = time.time()
    with deterministic(), bf16_matmuls(ccfg.bf16):  # distill_steps enters ``fit``; the measures stay fp32
        distill_steps(branch, train, ccfg, fit, backoff, [len(x) for x in lists], save)
    step = fit.step_count
    encoder.eval().requires_grad_(False)
    after = quality(branch, held, cfg.max_len, cfg.batch_size, serve=backoff.serve(None))
    out = {"objective": "distill", "steps": step, "seconds": round(time.time() - t0, 1), "config": asdict(cfg)}
    if resumed_at:
        out["resumed_at_step"] = resumed_at
    if kernels:
        out["step_kernels"] = kernels
    for k in ("pooled_cosine", "lower_cosine"):
        out[f"{k}_before"], out[f"{k}_after"] = before[f"{k}_served"], after[f"{k}_served"]
    return out


def mlm_pretrain(bert, tokenizer, encoder: WindowedEncoder, held: list[str], train: list[str], cfg: FPTConfig,
                 progress: bool = True, should_stop=None, keep_head: list | None = None, on_progress=None) -> dict:
    """Masked language modelling on the ``train`` lines through the frozen upper layers and a fresh
    MLM head; returns the MLM loss on the ``held`` lines before and after."""
    torch.manual_seed(cfg.seed)
    upper = UpperLayers(bert, encoder.l_low)
    for p in upper.parameters():
        p.requires_grad_(False)
    head = mlm_head(bert.config, encoder)
    before = mlm_loss(encoder, upper, head, tokenizer, held, cfg)
    head_params = [p for n, p in head.named_parameters() if "decoder.weight" not in n]
    params = list(encoder.parameters()) + head_params
    warmup_steps = int(cfg.head_warmup * cfg.steps)
    # The root ships no MLM head: a fresh head first learns to read the calibrated representations,
    # so that its early, large gradients do not pull the lower side away from what the upper
    # layers (and every tenant's adapters) expect.
    for p in encoder.parameters():
        p.requires_grad_(warmup_steps == 0)
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    t0 = time.time()
    upper.eval()
    with Fit(params, cfg.steps, lr=cfg.lr, weight_decay=0.01, clip=1.0, desc="further pretraining (MLM)",
             progress=progress, should_stop=should_stop, on_progress=on_progress, report_every=5) as fit:
        while not fit.done:
            for ids, mask in _batches(tokenizer, train, cfg, rng):
                if fit.done:
                    break
                fit.check()
                if fit.step_count == warmup_steps and warmup_steps:
                    for p in encoder.parameters():
                        p.requires_grad_(True)
                encoder.train()
                mids, labels = mask_tokens(ids, mask, tokenizer, gen, cfg.mlm_probability)
                logits = head(upper(encoder(mids, mask), mask))
                fit.step(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE))
    step = fit.step_count
    encoder.eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    after = mlm_loss(encoder, upper, head, tokenizer, held, cfg)
    if keep_head is not None:
        keep_head.append(head)
    return {"objective": "mlm", "mlm_loss_before": round(before, 4), "mlm_loss_after": round(after, 4), "steps": step,
            "seconds": round(time.time() - t0, 1), "config": asdict(cfg)}


def mlm_loss_through(lookup, upper, head, tokenizer, lines: list[str], cfg: FPTConfig, seed: int = 1) -> float:
    """Held-out MLM loss when the lower side comes from PLOT lookups (``lookup.merged``) instead of
    computed windows: what serving a pruned branch costs the language model."""
    gen = torch.Generator().manual_seed(seed)
    total, n = 0.0, 0
    with torch.no_grad():
        for ids, mask in _batches(tokenizer, lines, cfg, np.random.default_rng(seed)):
            mids, labels = mask_tokens(ids, mask, tokenizer, gen, cfg.mlm_probability)
            logits = head(upper(lookup.merged(mids.numpy(), mask.numpy()), mask))
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                                     reduction="sum").item()
            n += int((labels != IGNORE).sum())
    return total / max(1, n)
