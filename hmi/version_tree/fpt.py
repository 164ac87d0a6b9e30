"""Further pretraining of a branch's windowed lower layers with masked language modelling.

Only the windowed lower layers, the gate and the merge (and the MLM head's transform) learn; the
shared upper layers stay frozen, so every tenant's adapters keep working on top of a branch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.bert.modeling_bert import BertOnlyMLMHead

from hmi.model.hplm import UpperLayers, WindowedEncoder
from hmi.training.fit import Fit

IGNORE = -100


@dataclass
class FPTConfig:
    steps: int = 150
    batch_size: int = 16
    max_len: int = 128
    lr: float = 1e-4
    mlm_probability: float = 0.15
    seed: int = 0
    eval_lines: int = 64
    head_warmup: float = 0.3  # share of steps that train the fresh MLM head alone, lower side frozen


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


def further_pretrain(bert, tokenizer, encoder: WindowedEncoder, lines: list[str], cfg: FPTConfig,
                     progress: bool = True, should_stop=None, keep_head: list | None = None,
                     on_progress=None) -> dict:
    """Trains ``encoder`` in place; returns held-out MLM loss before and after and timings.
    ``keep_head``, when a list, receives the trained MLM head (for evaluations through a PLOT);
    ``on_progress(fraction, info)`` hears every fifth step; ``should_stop()`` cancels."""
    torch.manual_seed(cfg.seed)
    held, train = lines[-cfg.eval_lines:], lines[:-cfg.eval_lines] or lines
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
    return {"mlm_loss_before": round(before, 4), "mlm_loss_after": round(after, 4), "steps": step,
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
