"""Noise that hides a private tenant's activations from the server (Symbiosis, section 3.8).

For a frozen projection y = x W^T + b the client sends x + n, receives (x + n) W^T + b and
subtracts n W^T: exact in exact arithmetic, for linear layers only.  Two ways to know n W^T:

- ``ServerNoise``, the paper's: the server computes each noise value's effect once, on its
  bias-free path (``nobias``); so the server has seen every noise value, and an attacker who
  tries them (``hmi.split.attack``) strips the noise off.  One value per call, rotating.
- ``ClientNoise``, what the product ships: the root is public, so the client computes the effects
  itself from the root checkpoint's frozen weights, read once per projection and dropped; the
  server never sees a noise value.  Each row gets its own noise, a fresh random combination
  c N of the pool's values (c ~ N(0, I/K)), whose effect is c (N W^T): no two rows share an
  offset, so rows cannot be grouped by the value they drew, and a row costs the client K (D_in +
  D_out) multiply-adds, against D_in D_out for running the projection itself.

``FreshNoise`` draws every row afresh over the whole space (no pool), at the price of running
each projection on the noise here: it measures what noise could hide at best.

Both pools: per (layer, projection) a pool of ``count`` (K) vectors N of standard deviation ``scale``
drawn once from the client's own generator, seeded from the operating system's randomness
unless a ``seed`` is given (a fixed seed makes the noise anyone's who runs this code with it:
for tests only).  ``hide(layer, projection, x)`` -> (x + n, n W^T)
with shapes x (N, D_in) -> (N, D_in), and (D_out,) or (N, D_out).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import torch
from safetensors import safe_open

# The checkpoint's modules behind each projection the executor serves (``qkv`` is the three
# attention projections stacked along the output, as the server fuses them).
PROJECTION_MODULES = {"qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
                      "attn_out": ("attention.output.dense",), "ffn_in": ("intermediate.dense",),
                      "ffn_out": ("output.dense",)}


def checkpoint_tensor(f, keys: set[str], name: str) -> torch.Tensor:
    """The tensor ``name`` (``encoder.layer...``) of a root checkpoint opened with ``safe_open`` as
    ``f`` whose names are ``keys``, stored with or without the ``bert.`` prefix."""
    key = name if name in keys else f"bert.{name}"
    if key not in keys:
        raise KeyError(f"the root checkpoint has no {name}")
    return f.get_tensor(key)


def read_projection(model_dir: str | Path, layer: int, projection: str) -> torch.Tensor:
    """The frozen weight W (D_out, D_in) of a projection of layer ``layer``, read from the root
    checkpoint (``model.safetensors``)."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        return torch.cat([checkpoint_tensor(f, keys, f"encoder.layer.{layer}.{module}.weight").float()
                          for module in PROJECTION_MODULES[projection]])


def private_generator(seed: int | None) -> torch.Generator:
    """The client's own generator: seeded from the operating system's randomness unless ``seed``
    is given (tests only)."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


class _Pool:
    def __init__(self, scale: float, count: int, seed: int | None):
        self.scale, self.count = scale, count
        self.gen = private_generator(seed)
        self.values: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def pool(self, layer: int, projection: str, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(noise values (K, D_in), their effects (K, D_out)), made on first use."""
        key = (layer, projection)
        if key not in self.values:
            n = torch.randn(self.count, d_in, generator=self.gen) * self.scale
            self.values[key] = (n, self.effects(layer, projection, n))
        return self.values[key]

    def effects(self, layer: int, projection: str, n: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ServerNoise(_Pool):
    """The paper's scheme: the effects asked of the server (one ``nobias`` call per projection,
    which shows it the values); the calls rotate through the pool, one value for all of a call's
    rows."""

    def __init__(self, base, scale: float = 1.0, count: int = 4, seed: int | None = None):
        super().__init__(scale, count, seed)
        self.base = base
        self._turn: dict[tuple[int, str], int] = {}

    def effects(self, layer: int, projection: str, n: torch.Tensor) -> torch.Tensor:
        return self.base.linear(layer, projection, "nobias", n)

    def hide(self, layer: int, projection: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, effects = self.pool(layer, projection, x.shape[-1])
        k = self._turn.get((layer, projection), 0)
        self._turn[layer, projection] = (k + 1) % self.count
        return x + n[k], effects[k]


class ClientNoise(_Pool):
    """The product's scheme: effects computed here from the root checkpoint in ``model_dir``
    (each projection's weight read once, used for the pool, dropped); each row its own random
    combination of the pool's values."""

    def __init__(self, model_dir: str | Path, scale: float = 1.0, count: int = 16, seed: int | None = None):
        super().__init__(scale, count, seed)
        self.model_dir = Path(model_dir)

    def effects(self, layer: int, projection: str, n: torch.Tensor) -> torch.Tensor:
        return n @ read_projection(self.model_dir, layer, projection).T

    def hide(self, layer: int, projection: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, effects = self.pool(layer, projection, x.shape[-1])
        c = torch.randn(*x.shape[:-1], self.count, generator=self.gen) / self.count ** 0.5
        return x + c @ n, c @ effects


class FreshNoise:
    """Noise spanning every direction: each row its own fresh draw from N(0, scale^2 I), its
    effect ``n W^T`` computed here from the root checkpoint's weights, which are therefore kept
    (one projection's weights per (layer, projection) called).  No subspace to find: an attacker
    can only fit through it, whose error falls as more texts are observed (about as one over the
    square root of their number).  The price: the effect costs D_in D_out multiply-adds a row,
    the projection's own work, so a client paying it saves nothing by having the server run the
    projection (``hmi.split.model``'s ``projections`` split); it is here to measure that curve
    (``benchmarks/bench_private.py``), not shipped as a default.
    Shapes: ``hide`` x (N, D_in) -> (x + n (N, D_in), n W^T (N, D_out))."""

    def __init__(self, model_dir: str | Path, scale: float = 1.0, seed: int | None = None):
        self.model_dir, self.scale = Path(model_dir), scale
        self.gen = private_generator(seed)
        self.weights: dict[tuple[int, str], torch.Tensor] = {}

    def hide(self, layer: int, projection: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, projection)
        if key not in self.weights:
            self.weights[key] = read_projection(self.model_dir, layer, projection)
        n = torch.randn(x.shape, generator=self.gen) * self.scale
        return x + n, n @ self.weights[key].T
