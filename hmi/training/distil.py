"""Distillation of a tenant's served adapter: a teacher that sees more of the root than serving does
(the full-context root with adapters in every layer) answers the tenant's training texts and
unlabeled texts of its domain; the served adapter, in the upper layers over the PLOT, learns from
those answers (soft targets) beside the labels.  Unlabeled texts carry the teacher's answers alone.

The loss of a batch, with temperature ``t`` and weight ``w`` (Hinton et al., 2015):
``(1 - w) * CE(student, labels) + w * t^2 * KL(softmax(teacher / t) || softmax(student / t))``,
the cross-entropy over the labelled positions of the batch (0 where it has none), the divergence
over every position the teacher answers (a classification example; a word's first sub-token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from hmi.adapters.spec import AdapterSpec
from hmi.training.examples import IGNORE, Example, encode

# A teacher: the logits of each example, (C,) for classification, (T_i, C) for tagging.
Teacher = Callable[[list[Example]], list[torch.Tensor]]


@dataclass
class Distillation:
    teacher: Teacher
    texts: list[str] = field(default_factory=list)  # unlabeled texts of the tenant's domain
    temperature: float = 2.0
    weight: float = 0.5
    # where the student starts: the teacher's adapter of the served layers and its head, canonical
    # (``FullContextModel.upper_weights``); None: a new adapter and head
    start: dict[str, torch.Tensor] | None = None

    def extend(self, tokenizer, train: list[Example], spec: AdapterSpec, max_len: int
               ) -> tuple[list[Example], list[torch.Tensor], list[torch.Tensor]]:
        """The training examples followed by the unlabeled texts (targets IGNORE), the teacher's
        logits of each, and where each is distilled (a bool per example, or per token)."""
        extra = unlabeled(tokenizer, self.texts, spec, max_len)
        tagging = spec.head == "tagging"
        where = [answered(e, tagging) for e in train + extra]
        examples = train + [Example(e.ids, [IGNORE] * len(e.ids) if tagging else IGNORE) for e in extra]
        with torch.no_grad():
            soft = [t.float() for t in self.teacher(examples)]
        return examples, soft, where

    def loss(self, logits: torch.Tensor, y: torch.Tensor, soft: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Shapes: logits and soft (B, C) or (B, T, C); y and where (B,) or (B, T)."""
        c = logits.shape[-1]
        labelled = y != IGNORE
        ce = (F.cross_entropy(logits.reshape(-1, c), y.reshape(-1), ignore_index=IGNORE, reduction="sum")
              / labelled.sum().clamp(min=1))
        t = self.temperature
        kl = F.kl_div(F.log_softmax(logits[where] / t, -1), F.log_softmax(soft[where] / t, -1), log_target=True,
                      reduction="batchmean") * t * t if where.any() else logits.sum() * 0
        return (1 - self.weight) * ce + self.weight * kl

    @staticmethod
    def batch(soft: list[torch.Tensor], where: list[torch.Tensor], idx: list[int], tagging: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's logits and positions of the batch ``idx``, padded as ``collate`` pads:
        (B, C) and (B,), or (B, T, C) and (B, T)."""
        if not tagging:
            return torch.stack([soft[i] for i in idx]), torch.stack([where[i] for i in idx])
        T = max(len(where[i]) for i in idx)
        s = torch.zeros(len(idx), T, soft[idx[0]].shape[-1])
        w = torch.zeros(len(idx), T, dtype=torch.bool)
        for j, i in enumerate(idx):
            n = len(where[i])
            s[j, :n] = soft[i][:n]
            w[j, :n] = where[i]
        return s, w


def unlabeled(tokenizer, texts: list[str], spec: AdapterSpec, max_len: int) -> list[Example]:
    """Unlabeled texts encoded as training rows are (cut to ``max_len``), with the first label as a
    placeholder target: for tagging, the words are the text's whitespace-separated tokens and the
    placeholder marks each word's first sub-token."""
    first = spec.labels[0]
    if spec.head == "tagging":
        rows = [{"tokens": words, "tags": [first] * len(words)} for words in (t.split() for t in texts) if words]
    else:
        rows = [{"text": t, "label": first} for t in texts]
    return encode(tokenizer, rows, spec, max_len)


def answered(example: Example, tagging: bool) -> torch.Tensor:
    """Where the teacher's answer counts: the example (classification), or each position that holds
    a target (tagging: a word's first sub-token)."""
    if not tagging:
        return torch.tensor(True)
    return torch.tensor(example.target) != IGNORE
