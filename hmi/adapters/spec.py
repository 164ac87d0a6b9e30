"""Adapter and head specifications of every tenant (encoder and decoder), their validation, and
the ``adapters`` library configs.

A tenant's weights use one canonical naming, independent of the library and of the root (upper
layer index i counts from 0 at the first upper layer):

* bottleneck: ``layers.i.bn.down_w`` (H, r), ``down_b`` (r,), ``up_w`` (r, H), ``up_b`` (H,)
* lora: ``layers.i.lora.q_A`` (r, H), ``q_B`` (H, r), ``v_A`` (r, H), ``v_B`` (V, r) with V the
  value projection's width (H on encoders; key/value heads x head size on decoders); scaling alpha / r
* ia3: ``layers.i.ia3.k`` (H,), ``layers.i.ia3.v`` (H,), ``layers.i.ia3.ffn`` (I,)
* head: ``head.w`` (H, C), ``head.b`` (C,) for classification and tagging; none for ``lm`` (the
  decoder's own language-model head)
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

KINDS = ("bottleneck", "lora", "ia3")
HEADS = ("classification", "tagging")  # encoder heads; decoder tenants use "lm"
DECODER_HEAD = "lm"
POOLINGS = ("cls", "mean")


class SpecError(ValueError):
    """An adapter or head specification is invalid."""


@dataclass(frozen=True)
class AdapterSpec:
    """What a tenant's adapter and head look like: an encoder tenant's adapter of any kind with a
    classification or tagging head, or a decoder tenant's LoRA with the language-model head."""

    kind: str = "bottleneck"
    head: str = "classification"
    labels: tuple[str, ...] = field(default_factory=tuple)
    reduction_factor: int = 16  # bottleneck
    rank: int = 8  # lora
    alpha: float = 8.0  # lora
    pooling: str = "cls"  # classification: the [CLS] vector, or the mean of the text's tokens

    def __post_init__(self):
        object.__setattr__(self, "labels", tuple(self.labels))
        self.validate()

    @classmethod
    def decoder(cls, rank: int = 8, alpha: float | None = None) -> "AdapterSpec":
        """A decoder tenant's spec: LoRA of rank ``rank`` on the query and value projections
        (alpha 2 x rank unless given), the root's language-model head."""
        return cls(kind="lora", head=DECODER_HEAD, rank=rank, alpha=2.0 * rank if alpha is None else alpha)

    def validate(self) -> None:
        if self.head == DECODER_HEAD:
            self._validate_lora()
            if self.kind != "lora" or self.labels:
                raise SpecError("decoder tenants use LoRA with the language-model head, without labels")
            return
        if self.kind not in KINDS:
            raise SpecError(f"unknown adapter kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.head not in HEADS:
            raise SpecError(f"unknown head {self.head!r}; use one of {', '.join(HEADS)}")
        if self.pooling not in POOLINGS:
            raise SpecError(f"unknown pooling {self.pooling!r}; use one of {', '.join(POOLINGS)}")
        if self.head == "tagging" and self.pooling != "cls":
            raise SpecError("pooling applies to classification heads; a tagging head reads every token")
        if len(self.labels) < 2:
            raise SpecError(f"a {self.head} head needs at least 2 labels, got {len(self.labels)}")
        if len(set(self.labels)) != len(self.labels):
            raise SpecError("labels must be distinct")
        if any(not isinstance(x, str) or not x for x in self.labels):
            raise SpecError("labels must be non-empty strings")
        if self.kind == "bottleneck" and not (isinstance(self.reduction_factor, int) and self.reduction_factor >= 1):
            raise SpecError(f"reduction_factor must be a positive integer, got {self.reduction_factor!r}")
        if self.kind == "lora":
            self._validate_lora()

    def _validate_lora(self) -> None:
        if not (isinstance(self.rank, int) and not isinstance(self.rank, bool) and 1 <= self.rank <= 256):
            raise SpecError(f"lora rank must be an integer in [1, 256], got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0):
            raise SpecError(f"lora alpha must be positive, got {self.alpha!r}")

    @property
    def is_decoder(self) -> bool:
        return self.head == DECODER_HEAD

    @property
    def scaling(self) -> float:
        """The factor of a LoRA update (alpha / r); 1 for the other kinds."""
        return self.alpha / self.rank if self.kind == "lora" else 1.0

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def bottleneck_dim(self, hidden: int) -> int:
        return max(1, hidden // self.reduction_factor)

    def signature(self, hidden: int) -> tuple:
        """Tenants with the same signature share one stacked pool of device slots."""
        if self.kind == "bottleneck":
            return ("bottleneck", self.bottleneck_dim(hidden))
        if self.kind == "lora":
            return ("lora", self.rank, float(self.alpha))
        return ("ia3",)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["labels"] = list(self.labels)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AdapterSpec":
        known = {k: d[k] for k in ("kind", "head", "labels", "reduction_factor", "rank", "alpha", "pooling") if k in d}
        return cls(**known)

    def library_config(self, lower_layers: int):
        """The ``adapters`` library config of this spec, attached to the upper layers only."""
        from adapters import BnConfig, IA3Config, LoRAConfig  # deferred: importing adapters patches transformers

        leave_out = list(range(lower_layers))
        if self.kind == "bottleneck":
            return BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=self.reduction_factor,
                            non_linearity="relu", leave_out=leave_out)
        if self.kind == "lora":
            return LoRAConfig(r=self.rank, alpha=self.alpha, attn_matrices=["q", "v"], leave_out=leave_out)
        return IA3Config(leave_out=leave_out)


def canonical_names(weights: dict) -> dict:
    """The weights under today's canonical names: decoder adapters saved before encoder and
    decoder shared one naming called their LoRA ``layers.i.q_A`` instead of ``layers.i.lora.q_A``."""
    return {re.sub(r"^layers\.(\d+)\.([qv]_[AB])$", r"layers.\1.lora.\2", k): v for k, v in weights.items()}
