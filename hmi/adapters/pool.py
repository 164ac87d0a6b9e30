"""Device slot pools: pre-allocated stacked adapter tensors, LRU over slots, pinning.

One pool per adapter signature (kind and size), for encoder and decoder tenants alike.  A tenant
is resident when its weights occupy a slot; a batch (or a running generation) pins its slots until
it finishes, so they are never evicted under it.  A batch needing more slots than the pool can
free is refused (the encoder scheduler splits it; the generation engine fails the request).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

import torch

from hmi.adapters.spec import DEFAULT_LORA_SITES, layer_of


class PoolExhaustedError(RuntimeError):
    """More distinct tenants in one batch than the pool has unpinned slots."""


def layer_shapes(signature: tuple, hidden: int, intermediate: int, value_width: int | None = None) -> dict[str, tuple]:
    """Per-layer tensor shapes of one slot, in the pool's (compute-ready) orientation;
    ``value_width`` is the value projection's output width (``hidden`` unless given)."""
    kind = signature[0]
    if kind == "bottleneck":
        r = signature[1]
        return {"down_w": (hidden, r), "down_b": (r,), "up_w": (r, hidden), "up_b": (hidden,)}
    if kind == "lora":
        r = signature[1]
        dims = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, value_width or hidden),
                "ffn_in": (hidden, intermediate), "ffn_out": (intermediate, hidden)}
        shapes = {}
        for site in lora_targets(signature):
            d_in, d_out = dims[site]
            shapes[f"{site}_A"], shapes[f"{site}_B"] = (d_in, r), (r, d_out)
        return shapes
    return {"k": (hidden,), "v": (hidden,), "ffn": (intermediate,)}


def lora_targets(signature: tuple) -> tuple[str, ...]:
    """The sites a LoRA pool adapts: the encoder signature's ``("lora", r, alpha, targets)``, or
    query and value for a decoder pool's ``("lora", r)``."""
    return signature[3] if len(signature) > 3 else DEFAULT_LORA_SITES


def to_pool_layout(kind: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """Canonical weights (see hmi.adapters.spec) to the pool's orientation: LoRA A and B are
    stored transposed so that ``x @ A^T @ B^T`` becomes two plain ``bmm``."""
    if kind == "lora":
        return t.t()
    return t


class SlotPool:
    """Stacked weights of ``n_slots`` tenants of one signature, for ``n_layers`` upper layers.

    ``scaling`` is the LoRA factor shared by the pool (encoder pools: alpha is in the signature);
    ``scales`` (S,) holds each slot's own factor (decoder pools: one rank, any alpha).  A pool with
    ``max_labels=0`` holds no head (decoder tenants use the root's language-model head).  Heads of
    ``head_layers`` > 1 hold ``head_layers - 1`` hidden layers (H -> H, then ``head_activation``)
    before the labels' layer: ``head_hidden_w`` (S, L - 1, H, H), ``head_hidden_b`` (S, L - 1, H).
    """

    def __init__(self, signature: tuple, n_slots: int, n_layers: int, hidden: int, intermediate: int,
                 max_labels: int = 32, device: str | torch.device = "cpu", dtype=torch.float32,
                 scaling: float = 1.0, value_width: int | None = None, head_layers: int = 1,
                 head_activation: str | None = None):
        self.signature = signature
        self.kind = signature[0]
        self.n_slots = n_slots
        self.max_labels = max_labels
        self.device = torch.device(device)
        self.scaling = scaling
        self.targets = lora_targets(signature) if self.kind == "lora" else ()
        shapes = layer_shapes(signature, hidden, intermediate, value_width)
        self.layers = [{k: torch.zeros((n_slots, *s), device=self.device, dtype=dtype) for k, s in shapes.items()}
                       for _ in range(n_layers)]
        self.scales = torch.full((n_slots,), float(scaling), device=self.device, dtype=dtype)
        self.hidden = hidden
        self.head_w = torch.zeros(n_slots, hidden, max_labels, device=self.device, dtype=dtype)
        self.head_b = torch.zeros(n_slots, max_labels, device=self.device, dtype=dtype)
        self.head_layers, self.head_activation = head_layers, head_activation
        self.head_hidden_w = torch.zeros(n_slots, head_layers - 1, hidden, hidden, device=self.device, dtype=dtype)
        self.head_hidden_b = torch.zeros(n_slots, head_layers - 1, hidden, device=self.device, dtype=dtype)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._free = list(range(n_slots - 1, -1, -1))
        self._pins: Counter = Counter()
        self._retired: set[int] = set()  # slots of evicted tenants still pinned by a batch
        self._lock = threading.Lock()
        self.stats = Counter()

    @classmethod
    def for_spec(cls, spec, n_slots: int, n_layers: int, hidden: int, intermediate: int, max_labels: int = 32,
                 device: str | torch.device = "cpu", dtype=torch.float32) -> "SlotPool":
        """The pool of tenants of ``spec``'s ``pool_key`` (an encoder spec: adapter and head)."""
        return cls(spec.signature(hidden), n_slots, n_layers, hidden, intermediate, max_labels, device, dtype,
                   scaling=spec.scaling, head_layers=spec.head_layers,
                   head_activation=spec.head_activation if spec.head_layers > 1 else None)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self.layers[i]

    def slot_of(self, tenant: str) -> int | None:
        return self._slot_of.get(tenant)

    def acquire(self, tenants: list[str]) -> tuple[dict[str, int], list[str]]:
        """Pins a slot for every distinct tenant; returns the slots and the tenants whose weights
        must be written (newly assigned).  Raises PoolExhaustedError, pinning nothing, when the
        pool cannot hold them all at once."""
        with self._lock:
            distinct = list(dict.fromkeys(tenants))
            missing = [t for t in distinct if t not in self._slot_of]
            evictable = [t for t in self._slot_of if self._pins[self._slot_of[t]] == 0 and t not in distinct]
            if len(missing) > len(self._free) + len(evictable):
                raise PoolExhaustedError(
                    f"{len(distinct)} distinct tenants in one batch but only "
                    f"{len(self._free) + len(evictable) + len(distinct) - len(missing)} slots can be used")
            for t in missing:
                if not self._free:
                    victim = evictable.pop(0)
                    self._free.append(self._slot_of.pop(victim))
                    self.stats["evictions"] += 1
                self._slot_of[t] = self._free.pop()
            for t in distinct:
                self._slot_of.move_to_end(t)
                self._pins[self._slot_of[t]] += 1
            self.stats["device_hits"] += len(distinct) - len(missing)
            self.stats["device_misses"] += len(missing)
            return {t: self._slot_of[t] for t in distinct}, missing

    def release(self, slots: dict[str, int]) -> None:
        with self._lock:
            for s in slots.values():
                self._pins[s] -= 1
                if self._pins[s] <= 0:
                    del self._pins[s]
                    if s in self._retired:
                        self._retired.discard(s)
                        self._free.append(s)

    def evict(self, tenant: str) -> None:
        """Forgets a tenant (deleted or updated); its slot is reused once no batch pins it."""
        with self._lock:
            slot = self._slot_of.pop(tenant, None)
            if slot is not None:
                if self._pins[slot]:
                    self._retired.add(slot)
                else:
                    self._free.append(slot)

    def evict_slot(self, slot: int) -> None:
        """Forgets whichever tenant holds ``slot`` (its weights may be incomplete)."""
        with self._lock:
            for t, s in list(self._slot_of.items()):
                if s == slot:
                    del self._slot_of[t]
                    if self._pins[slot]:
                        self._retired.add(slot)
                    else:
                        self._free.append(slot)

    def check(self, weights: dict[str, torch.Tensor], num_labels: int) -> None:
        """Raises ValueError unless ``weights`` (canonical layout) fill a slot of this pool: every
        layer's tensors present with their shapes, and a head of ``num_labels`` <= max_labels."""
        for li, dst in enumerate(self.layers):
            for name, t in dst.items():
                key = f"layers.{li}.{self._site}.{name}"
                want = tuple(t.shape[1:])[::-1] if self.kind == "lora" else tuple(t.shape[1:])
                got = weights.get(key)
                if got is None:
                    raise ValueError(f"{key} is missing")
                if tuple(got.shape) != want:
                    raise ValueError(f"{key} has shape {tuple(got.shape)}, expected {want}")
        beyond = sorted(k for k in weights if (layer := layer_of(k)) is not None and layer >= len(self.layers))
        if beyond:  # an adapter of more upper layers (trained at a lower split) would be served in part
            raise ValueError(f"{beyond[0]} is beyond the {len(self.layers)} upper layer(s) this server serves")
        if not self.max_labels:
            return
        hidden = self.hidden
        if num_labels > self.max_labels:
            raise ValueError(f"a head of {num_labels} labels; this server serves at most {self.max_labels}")
        shapes = [("head.w", (hidden, num_labels)), ("head.b", (num_labels,))]
        for j in range(self.head_layers - 1):
            shapes += [(f"head.hidden.{j}.w", (hidden, hidden)), (f"head.hidden.{j}.b", (hidden,))]
        extra = sorted(k for k in weights if k.startswith("head.hidden.") and k not in dict(shapes))
        if extra:
            raise ValueError(f"{extra[0]} does not belong to a head of {self.head_layers} layer(s)")
        for key, want in shapes:
            got = weights.get(key)
            if got is None or tuple(got.shape) != want:
                raise ValueError(f"{key} has shape {None if got is None else tuple(got.shape)}, expected {want}")

    def write_layer(self, slot: int, layer: int, weights: dict[str, torch.Tensor], non_blocking: bool = False) -> None:
        """Copies one upper layer of a tenant's canonical weights into its slot."""
        dst = self.layers[layer]
        for name in dst:
            src = weights[f"layers.{layer}.{self._site}.{name}"]
            dst[name][slot].copy_(to_pool_layout(self.kind, name, src), non_blocking=non_blocking)

    def write_head(self, slot: int, weights: dict[str, torch.Tensor], non_blocking: bool = False) -> None:
        w, b = weights["head.w"], weights["head.b"]
        c = w.shape[1]
        if c > self.max_labels:
            raise ValueError(f"head with {c} labels; this pool holds at most {self.max_labels}")
        self.head_w[slot].zero_()
        self.head_b[slot].zero_()
        self.head_w[slot, :, :c].copy_(w, non_blocking=non_blocking)
        self.head_b[slot, :c].copy_(b, non_blocking=non_blocking)
        for j in range(self.head_layers - 1):
            self.head_hidden_w[slot, j].copy_(weights[f"head.hidden.{j}.w"], non_blocking=non_blocking)
            self.head_hidden_b[slot, j].copy_(weights[f"head.hidden.{j}.b"], non_blocking=non_blocking)

    def write(self, slot: int, weights: dict[str, torch.Tensor], scaling: float | None = None) -> None:
        """Writes a tenant's whole canonical weights (and its own LoRA factor) into its slot."""
        for li in range(len(self.layers)):
            self.write_layer(slot, li, weights)
        if self.max_labels:
            self.write_head(slot, weights)
        self.scales[slot] = self.scaling if scaling is None else scaling

    def read(self, slot: int, num_labels: int) -> dict[str, torch.Tensor]:
        """A slot's weights in the canonical layout (the inverse of ``write``), copied."""
        out = {f"layers.{li}.{self._site}.{name}": to_pool_layout(self.kind, name, t[slot]).detach().clone()
               for li, layer in enumerate(self.layers) for name, t in layer.items()}
        if self.max_labels:
            out["head.w"] = self.head_w[slot, :, :num_labels].detach().clone()
            out["head.b"] = self.head_b[slot, :num_labels].detach().clone()
            for j in range(self.head_layers - 1):
                out[f"head.hidden.{j}.w"] = self.head_hidden_w[slot, j].detach().clone()
                out[f"head.hidden.{j}.b"] = self.head_hidden_b[slot, j].detach().clone()
        return out

    @property
    def _site(self) -> str:
        return {"bottleneck": "bn", "lora": "lora", "ia3": "ia3"}[self.kind]

    def resident(self) -> list[str]:
        return list(self._slot_of)

