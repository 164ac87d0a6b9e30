"""Per-tenant LoRA of the decoder's upper layers: the spec, the ``adapters`` library attachment
(training engine and reference), canonical weights, and the stacked device pool.

Canonical weights (upper layer index i counts from 0 at the first upper layer), library shapes:
``layers.i.q_A`` (r, H), ``layers.i.q_B`` (H, r), ``layers.i.v_A`` (r, H), ``layers.i.v_B`` (KV, r)
with KV = key/value heads x head size; the update of a projection is ``scaling * x A^T B^T``,
scaling = alpha / r.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

from hmi.adapters.interop import attach  # noqa: F401 - the library attach serves decoders too (spec.library_config)
from hmi.adapters.spec import SpecError


@dataclass(frozen=True)
class LoraSpec:
    """A decoder tenant's adapter: LoRA of rank r on the query and value projections."""

    rank: int = 8
    alpha: float = 16.0
    kind: str = "lora"
    head: str = "lm"

    def __post_init__(self):
        if not (isinstance(self.rank, int) and 1 <= self.rank <= 256):
            raise SpecError(f"lora rank must be an integer in [1, 256], got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise SpecError(f"lora alpha must be positive, got {self.alpha!r}")
        if self.kind != "lora" or self.head != "lm":
            raise SpecError("decoder tenants use LoRA with the language-model head")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSpec":
        return cls(**{k: d[k] for k in ("rank", "alpha") if k in d})

    def library_config(self, l_low: int):
        from adapters import LoRAConfig

        return LoRAConfig(r=self.rank, alpha=self.alpha, attn_matrices=["q", "v"], leave_out=list(range(l_low)))


def _lib_key(layer: int, proj: str, name: str, part: str) -> str:
    return f"model.layers.{layer}.self_attn.{proj}_proj.loras.{name}.lora_{part}"


def library_copy(model):
    return copy.deepcopy(model)


def from_library(model, name: str, l_low: int) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    out = {}
    for layer in range(l_low, model.config.num_hidden_layers):
        for proj in ("q", "v"):
            for part in ("A", "B"):
                out[f"layers.{layer - l_low}.{proj}_{part}"] = sd[_lib_key(layer, proj, name, part)].detach().clone()
    return out


def to_library(model, name: str, l_low: int, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(l_low, model.config.num_hidden_layers):
            for proj in ("q", "v"):
                for part in ("A", "B"):
                    key = _lib_key(layer, proj, name, part)
                    if key not in params:
                        raise SpecError(f"library model lacks {key}")
                    params[key].copy_(weights[f"layers.{layer - l_low}.{proj}_{part}"].to(params[key].dtype))


class LoraPool:
    """Stacked LoRA weights of the tenants resident on the compute device, LRU over slots.

    Per upper layer: ``qa`` (S, H, r) = A_q^T, ``qb`` (S, r, H) = B_q^T, ``va`` (S, H, r),
    ``vb`` (S, r, KV); slot s holds one tenant.  Slots used by running requests are pinned.
    """

    def __init__(self, slots: int, layers: int, hidden: int, kv: int, rank: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        self.slots, self.layers, self.rank = slots, layers, rank
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        self.qa = [z(slots, hidden, rank) for _ in range(layers)]
        self.qb = [z(slots, rank, hidden) for _ in range(layers)]
        self.va = [z(slots, hidden, rank) for _ in range(layers)]
        self.vb = [z(slots, rank, kv) for _ in range(layers)]
        self.scaling = torch.zeros(slots, device=device, dtype=dtype)
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._retired: set[int] = set()  # slots of evicted tenants still used by running requests
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "loads": 0, "evictions": 0}

    def acquire(self, tenant: str, load) -> int:
        """The tenant's slot, writing its weights (``load()`` -> (spec, weights)) on a miss; pinned."""
        with self._lock:
            return self._acquire(tenant, load)

    def _acquire(self, tenant: str, load) -> int:
        slot = self._lru.get(tenant)
        if slot is not None:
            self._lru.move_to_end(tenant)
            self.stats["hits"] += 1
        else:
            slot = self._free_slot()
            spec, w = load()
            if spec.rank != self.rank:
                raise SpecError(f"tenant {tenant!r} has rank {spec.rank}; this pool holds rank {self.rank}")
            for i in range(self.layers):
                self.qa[i][slot].copy_(w[f"layers.{i}.q_A"].t())
                self.qb[i][slot].copy_(w[f"layers.{i}.q_B"].t())
                self.va[i][slot].copy_(w[f"layers.{i}.v_A"].t())
                self.vb[i][slot].copy_(w[f"layers.{i}.v_B"].t())
            self.scaling[slot] = spec.scaling
            self._lru[tenant] = slot
            self.stats["loads"] += 1
        self._pins[slot] = self._pins.get(slot, 0) + 1
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] -= 1
            if not self._pins[slot]:
                del self._pins[slot]
                self._retired.discard(slot)

    def evict(self, tenant: str) -> None:
        """Forgets a tenant's resident copy (after an update): the next request loads it again.  A
        slot still used by running requests stays reserved until they release it."""
        with self._lock:
            slot = self._lru.pop(tenant, None)
            if slot is not None and slot in self._pins:
                self._retired.add(slot)

    def _free_slot(self) -> int:
        used = set(self._lru.values()) | self._retired
        for s in range(self.slots):
            if s not in used:
                return s
        for tenant, s in self._lru.items():
            if s not in self._pins:
                del self._lru[tenant]
                self.stats["evictions"] += 1
                return s
        raise RuntimeError("every LoRA slot is in use by running requests")
