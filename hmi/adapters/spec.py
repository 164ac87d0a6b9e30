"""Adapter and head specifications of every tenant (encoder and decoder), their validation, and
the ``adapters`` library configs.

A tenant's weights use one canonical naming, independent of the library and of the root (upper
layer index i counts from 0 at the first upper layer):

* bottleneck: ``layers.i.bn.down_w`` (H, r), ``down_b`` (r,), ``up_w`` (r, H), ``up_b`` (H,)
* lora: ``layers.i.lora.{site}_A`` (r, D_in), ``{site}_B`` (D_out, r) for each of the spec's target
  sites (``q``, ``k``, ``v``, ``ffn_in``, ``ffn_out``; default ``q`` and ``v``), with D_in x D_out
  H x H for q and k, H x V for v (V the value projection's width: H on encoders, key/value heads x
  head size on decoders), H x I for ffn_in (the FFN's first projection) and I x H for ffn_out (its
  second); scaling alpha / r
* ia3: ``layers.i.ia3.k`` (H,), ``layers.i.ia3.v`` (H,), ``layers.i.ia3.ffn`` (I,)
* head: ``head.w`` (H, C), ``head.b`` (C,) for classification and tagging; none for ``lm`` (the
  decoder's own language-model head).  A head of ``head_layers`` L > 1 (the ``adapters``
  library's default classification head has 2) has L - 1 hidden layers before it, each
  ``head.hidden.j.w`` (H, H), ``head.hidden.j.b`` (H,) followed by ``head_activation``

A ``whole`` spec's adapter is in every layer of the root and its tenant is served on the full root
(its texts never read the PLOT: the lower layers run on the whole text with the adapter); its layer
index i counts from the root's first layer instead (``first_layer``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

KINDS = ("bottleneck", "lora", "ia3")
HEADS = ("classification", "tagging")  # encoder heads; decoder tenants use "lm"
DECODER_HEAD = "lm"
POOLINGS = ("cls", "mean")
# The projections LoRA can adapt, in canonical order: the attention's query, key and value, and the
# FFN's first (intermediate) and second (output) layer (hmi.adapters.interop.LORA_MODULES places them).
LORA_SITES = ("q", "k", "v", "ffn_in", "ffn_out")
DEFAULT_LORA_SITES = ("q", "v")
ALL_LORA_SITES = "all"  # shorthand for every site, in the API and on the command line
# Activations between a head's layers, by the ``adapters`` library's names (its heads call
# transformers' ``get_activation`` on the lower-cased name; ``leakyrelu`` is its own); None: none.
HEAD_ACTIVATIONS = ("tanh", "relu", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "quick_gelu", "silu", "swish",
                    "mish", "sigmoid", "relu6", "linear", "leakyrelu")
MAX_HEAD_LAYERS = 8


def lora_sites(names) -> tuple[str, ...]:
    """LoRA target sites in canonical order; ``"all"`` (or ``["all"]``) is every site.  Raises
    SpecError for an unknown, repeated or empty list."""
    if isinstance(names, str):
        names = LORA_SITES if names == ALL_LORA_SITES else tuple(n.strip() for n in names.split(","))
    names = tuple(names)
    if names == (ALL_LORA_SITES,):
        names = LORA_SITES
    unknown = [n for n in names if n not in LORA_SITES]
    if unknown:
        raise SpecError(f"unknown LoRA target {unknown[0]!r}; use some of {', '.join(LORA_SITES)} or {ALL_LORA_SITES!r}")
    if not names:
        raise SpecError("LoRA needs at least one target")
    if len(set(names)) != len(names):
        raise SpecError("LoRA targets must be distinct")
    return tuple(n for n in LORA_SITES if n in names)


# Which size options each kind takes, and the adapter a task gets when it names no kind: LoRA of
# rank 16 on every linear layer of the upper half for tagging (+1.6 points of word accuracy over the
# bottleneck on the default root), the bottleneck for classification (docs/roots.md).
KIND_OPTIONS = {"bottleneck": ("reduction_factor",), "lora": ("rank", "alpha", "targets"), "ia3": ()}
HEAD_DEFAULTS = {"classification": {"kind": "bottleneck"},
                 "tagging": {"kind": "lora", "rank": 16, "alpha": 16.0, "targets": LORA_SITES}}


def misplaced_option(kind: str, options) -> tuple[str, str] | None:
    """The first of ``options`` (names of size options) that belongs to another kind than
    ``kind``, with that kind, or None when all fit (KIND_OPTIONS)."""
    for key in options:
        owner = next((kd for kd, keys in KIND_OPTIONS.items() if key in keys), kind)
        if owner != kind:
            return key, owner
    return None


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
    targets: tuple[str, ...] = DEFAULT_LORA_SITES  # lora: the projections it adapts (LORA_SITES)
    head_layers: int = 1  # linear layers of the head (hidden ones H -> H, then H -> C)
    head_activation: str | None = "tanh"  # after each hidden layer of the head (head_layers > 1)
    whole: bool = False  # the adapter is in every layer and the tenant is served on the full root

    def __post_init__(self):
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "targets", lora_sites(self.targets))
        self.validate()

    @classmethod
    def for_task(cls, head: str, labels, kind: str | None = None, **options) -> "AdapterSpec":
        """A tenant's spec from what it asked for: ``kind`` (None: the head's default adapter,
        HEAD_DEFAULTS) and options such as sizes and pooling (None: the defaults).  A size option
        of another kind is refused, so nothing asked for is silently dropped."""
        given = {k: v for k, v in options.items() if v is not None}
        base = dict(HEAD_DEFAULTS[head]) if kind is None and head in HEAD_DEFAULTS else {"kind": kind or cls.kind}
        wrong = misplaced_option(base["kind"], given) if base["kind"] in KIND_OPTIONS else None
        if wrong:
            why = f" (the default adapter of a {head} task; name the kind)" if kind is None else ""
            raise SpecError(f"{wrong[0]} applies to {wrong[1]} adapters, not {base['kind']}{why}")
        return cls(head=head, labels=labels, **{**base, **given})

    @classmethod
    def decoder(cls, rank: int = 8, alpha: float | None = None) -> "AdapterSpec":
        """A decoder tenant's spec: LoRA of rank ``rank`` on the query and value projections
        (alpha 2 x rank unless given), the root's language-model head."""
        return cls(kind="lora", head=DECODER_HEAD, rank=rank, alpha=2.0 * rank if alpha is None else alpha)

    def validate(self) -> None:
        if not isinstance(self.whole, bool):
            raise SpecError(f"whole must be true or false, got {self.whole!r}")
        if self.head == DECODER_HEAD:
            self._validate_lora()
            if self.whole:
                raise SpecError("decoder tenants' LoRA is in the upper layers only")
            if self.kind != "lora" or self.labels:
                raise SpecError("decoder tenants use LoRA with the language-model head, without labels")
            if self.targets != DEFAULT_LORA_SITES:
                raise SpecError("decoder tenants' LoRA adapts the query and value projections only")
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
        if not (isinstance(self.head_layers, int) and not isinstance(self.head_layers, bool)
                and 1 <= self.head_layers <= MAX_HEAD_LAYERS):
            raise SpecError(f"head_layers must be an integer in [1, {MAX_HEAD_LAYERS}], got {self.head_layers!r}")
        if self.head_activation is not None and self.head_activation.lower() not in HEAD_ACTIVATIONS:
            raise SpecError(f"unknown head activation {self.head_activation!r}; use one of {', '.join(HEAD_ACTIVATIONS)} "
                            "or none")
        if self.kind == "bottleneck" and not (isinstance(self.reduction_factor, int) and self.reduction_factor >= 1):
            raise SpecError(f"reduction_factor must be a positive integer, got {self.reduction_factor!r}")
        if self.kind == "lora":
            self._validate_lora()
        elif self.targets != DEFAULT_LORA_SITES:
            raise SpecError(f"targets apply to LoRA adapters, not {self.kind}")

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

    def first_layer(self, l_low: int) -> int:
        """The first layer of the root that holds this adapter when the root is split at ``l_low``:
        0 for a ``whole`` spec, else ``l_low``."""
        return 0 if self.whole else l_low

    def bottleneck_dim(self, hidden: int) -> int:
        return max(1, hidden // self.reduction_factor)

    def pool_key(self, hidden: int) -> tuple:
        """Tenants with the same key share one stacked pool of device slots: the adapter's
        signature, the head's hidden layers and activation when it has any, and whether it is in
        every layer (``whole``: a pool of every layer's weights)."""
        sig = self.signature(hidden)
        sig = sig if self.head_layers == 1 else (*sig, ("head", self.head_layers, self.head_activation))
        return (*sig, ("whole",)) if self.whole else sig

    def signature(self, hidden: int) -> tuple:
        """The adapter's kind and size (what its weights in the upper layers look like)."""
        if self.kind == "bottleneck":
            return ("bottleneck", self.bottleneck_dim(hidden))
        if self.kind == "lora":
            return ("lora", self.rank, float(self.alpha), self.targets)
        return ("ia3",)

    def to_dict(self) -> dict:
        """The spec as JSON; a one-layer head's fields and ``whole`` when false are left out (as
        specs before them read)."""
        d = asdict(self)
        d["labels"] = list(self.labels)
        d["targets"] = list(self.targets)
        if self.head_layers == 1:
            del d["head_layers"], d["head_activation"]
        if not self.whole:
            del d["whole"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AdapterSpec":
        keys = ("kind", "head", "labels", "reduction_factor", "rank", "alpha", "pooling", "targets", "head_layers",
                "head_activation", "whole")
        return cls(**{k: d[k] for k in keys if k in d})

    def library_config(self, lower_layers: int):
        """The ``adapters`` library config of this spec, attached to the upper layers only (to
        every layer when ``whole``)."""
        from adapters import BnConfig, IA3Config, LoRAConfig  # deferred: importing adapters patches transformers

        leave_out = list(range(self.first_layer(lower_layers)))
        if self.kind == "bottleneck":
            return BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=self.reduction_factor,
                            non_linearity="relu", leave_out=leave_out)
        if self.kind == "lora":
            attn = [t for t in self.targets if t in ("q", "k", "v")]
            return LoRAConfig(r=self.rank, alpha=self.alpha, selfattn_lora=bool(attn), attn_matrices=attn or ["q", "v"],
                              intermediate_lora="ffn_in" in self.targets, output_lora="ffn_out" in self.targets,
                              leave_out=leave_out)
        return IA3Config(leave_out=leave_out)


def layer_of(key: str) -> int | None:
    """The upper layer a canonical weight name belongs to (``layers.<i>.<site>.<name>``; counted
    from the split), None for the head's."""
    return int(key.split(".")[1]) if key.startswith("layers.") else None


def canonical_names(weights: dict) -> dict:
    """The weights under today's canonical names: decoder adapters saved before encoder and
    decoder shared one naming called their LoRA ``layers.i.q_A`` instead of ``layers.i.lora.q_A``."""
    return {re.sub(r"^layers\.(\d+)\.([qv]_[AB])$", r"layers.\1.lora.\2", k): v for k, v in weights.items()}
