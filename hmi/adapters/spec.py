"""Adapter and head specifications, their validation, and the ``adapters`` library configs.

A tenant's weights use one canonical naming, independent of the library (upper layer index i
counts from 0 at the first upper layer):

* bottleneck: ``layers.i.bn.down_w`` (H, r), ``down_b`` (r,), ``up_w`` (r, H), ``up_b`` (H,)
* lora: ``layers.i.lora.{q,v}_A`` (r, H), ``layers.i.lora.{q,v}_B`` (H, r); scaling alpha / r
* ia3: ``layers.i.ia3.k`` (H,), ``layers.i.ia3.v`` (H,), ``layers.i.ia3.ffn`` (I,)
* head: ``head.w`` (H, C), ``head.b`` (C,)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("bottleneck", "lora", "ia3")
HEADS = ("classification", "tagging")
POOLINGS = ("cls", "mean")


class SpecError(ValueError):
    """An adapter or head specification is invalid."""


@dataclass(frozen=True)
class AdapterSpec:
    """What a tenant's adapter and head look like."""

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

    def validate(self) -> None:
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
        if self.kind == "lora" and not (isinstance(self.rank, int) and 1 <= self.rank <= 256):
            raise SpecError(f"lora rank must be an integer in [1, 256], got {self.rank!r}")
        if self.kind == "lora" and not self.alpha > 0:
            raise SpecError(f"lora alpha must be positive, got {self.alpha!r}")

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
        from adapters import BnConfig, IA3Config, LoRAConfig

        leave_out = list(range(lower_layers))
        if self.kind == "bottleneck":
            return BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=self.reduction_factor,
                            non_linearity="relu", leave_out=leave_out)
        if self.kind == "lora":
            return LoRAConfig(r=self.rank, alpha=self.alpha, attn_matrices=["q", "v"], leave_out=leave_out)
        return IA3Config(leave_out=leave_out)
