"""A learned back-off for encoder PLOTs (miss policy ``learned``, docs/design.md section 3).

The paper's back-off serves a missed tri-gram ``(l, c, r)`` with the bi-gram ``(0, c, r)`` or the
uni-gram ``(0, c, 0)``: the left row of the window is then zeros (no left token was there) and,
from a uni-gram, the right row too.  ``LearnedBackoff`` estimates the missed window's three states
from what the PLOT does hold: the served back-off rows, the states of ``l`` and ``r`` alone (their
uni-grams' centre rows) and whether a bi-gram served.  It is a residual MLP, trained on the PLOT's
own tri-grams (each one's back-off as if it were missing, the bi-gram withheld for half of them)
against their stored states.  It runs only on the windows no version of the chain holds, a small
matrix product each instead of the windowed lower layers on three tokens (``compute``).

A PLOT's model lives beside its LMDB files (``learned_backoff.safetensors`` and ``.json``);
``hmi.training.backoff`` trains it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from hmi.io import atomic_write_bytes, sha256_file
from hmi.model.aliases import auto_miss_policy
from hmi.model.artifact import SHIPPED_DIR
from hmi.model.kernels import NATIVE_BF16, OneDnnLinear, bf16_matmuls, linear
from hmi.plot.keys import bigram_backoff, pack, unigram_backoff, unpack
from hmi.plot.store import PlotStore

WEIGHTS, CONFIG, CHECKPOINT = "learned_backoff.safetensors", "learned_backoff.json", "learned_backoff.ckpt"
# Serving multiplies in bf16 (fp32 accumulation) where the CPU does so natively: half the time of fp32
# for the same estimate to four digits of cosine (docs/results/bench_backoff.md); fp32 elsewhere.
SERVE_BF16 = NATIVE_BF16
TRAIN_STEPS = 4800  # batches of 512 tri-grams: nine passes over 280k of them (docs/roots.md)


class LearnedBackoffMissingError(RuntimeError):
    """The miss policy ``learned`` was asked of a PLOT chain none of whose versions has a model."""


class LearnedBackoff(nn.Module):
    """The estimate of a missed window's states from its back-off.

    Semantics: out = served + W2 · GELU(W1 · [served rows, state(l), state(r), from_bigram] + b1) + b2,
    where ``served`` is what the paper's back-off serves for the window and ``state(x)`` the centre
    row of the uni-gram ``(0, x, 0)``.  ``W2`` and ``b2`` start at zero: an untrained model serves
    the back-off exactly.
    Shapes: served (N, 3, H); context (N, 2, H) (the states of l and r); from_bigram (N,) ->
    (N, 3, H) float32.
    """

    def __init__(self, hidden_size: int, width: int = 1024):
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        self.inp = OneDnnLinear(5 * hidden_size + 1, width)
        self.out = OneDnnLinear(width, 3 * hidden_size)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, served: torch.Tensor, context: torch.Tensor, from_bigram: torch.Tensor) -> torch.Tensor:
        served = served.float()
        x = torch.cat([served.flatten(1), context.float().flatten(1), from_bigram.float()[:, None]], 1)
        return served + self.out(F.gelu(self.inp(x))).view(served.shape)


def centre_states(store: PlotStore, ids: np.ndarray) -> np.ndarray:
    """The state of each token alone: the centre row of its uni-gram ``(0, x, 0)`` (zeros where the
    PLOT has none). Shapes: ids (N,) int64 -> (N, H) float16."""
    z = np.zeros_like(ids)
    vals, _ = store.get_many(pack(np.stack([z, ids, z], -1)))
    return vals[:, 1]


class CentreTable:
    """Every token's state alone (row ``x`` is ``centre_states(store, [x])[0]``), read from the PLOT
    row by row as serving first needs them and kept: serving gathers a missed window's neighbours
    from it instead of reading two uni-grams from LMDB per window.  Filled lazily because a PLOT
    still being built computes what it does not hold yet (``hmi.plot.pending``): the whole
    vocabulary at start-up would hold the first start up by seconds for rows most texts never
    use.  The uni-grams of a PLOT do not change once written, so a kept row stays right.
    Shapes: table[ids] with ids (...) int64 -> (..., H) float16."""

    def __init__(self, store: PlotStore, vocab_size: int):
        self.store = store
        self.rows = np.zeros((vocab_size, store.meta.hidden_size), dtype=np.float16)  # pages taken as rows are written
        self.known = np.zeros(vocab_size, dtype=bool)
        self._lock = threading.Lock()

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if not self.known[ids].all():
            with self._lock:
                need = np.unique(ids[~self.known[ids]])
                if need.size:
                    self.rows[need] = centre_states(self.store, need)
                    self.known[need] = True
        return self.rows[ids]


class ProjectedBackoff:
    """``LearnedBackoff.forward`` for serving, with its first layer split by its inputs.

    The states of a missed window's neighbours ``l`` and ``r`` enter the first layer only through
    ``W1_l · state(l)`` and ``W1_r · state(r)``, functions of one token each: they are computed the
    first time a token is a neighbour (from its ``CentreTable`` row) and kept, and a window gathers
    them.  The served rows enter through their own columns of ``W1``, each row over the windows
    whose row is not zero (the back-off's left row is zero wherever it served, and its right row
    too where a uni-gram served: a third to a half of the products are left out).  The result is
    ``forward``'s with the first layer's sums in another order (fp32 accumulation either way); with
    ``bf16`` the products round their operands to bf16 as ``forward`` does inside ``bf16_matmuls``.
    Shapes: estimate(served (N, 3, H), l (N,), r (N,) token ids, from_bigram (N,)) -> (N, 3, H) float32."""

    def __init__(self, model: LearnedBackoff, centres: CentreTable, bf16: bool):
        h, w = model.hidden_size, model.inp.weight.detach()
        self.model, self.centres, self.bf16 = model, centres, bf16 and NATIVE_BF16
        self.w_rows = [w[:, k * h:(k + 1) * h].contiguous() for k in range(3)]  # (width, H) each
        self.w_sides = w[:, 3 * h:5 * h].reshape(-1, 2, h).transpose(0, 1).contiguous()  # (2, width, H): l, r
        flag = w[:, 5 * h].contiguous()
        self.w_flag = flag.to(torch.bfloat16).float() if self.bf16 else flag  # a product's operand, rounded alike
        self.bias = model.inp.bias.detach()
        vocab = centres.rows.shape[0]
        # W1_l · state(x) and W1_r · state(x) of token x (row x; pages taken as rows are written)
        self.sides = [torch.zeros(vocab, model.width) for _ in range(2)]
        self.known = np.zeros(vocab, dtype=bool)
        self._lock = threading.Lock()

    def side_terms(self, left: np.ndarray, right: np.ndarray) -> torch.Tensor:
        """``W1_l · state(l) + W1_r · state(r)`` per window. Shapes: left, right (N,) int64 -> (N, width)."""
        ids = np.concatenate([left, right])
        if not self.known[ids].all():
            with self._lock:
                need = np.unique(ids[~self.known[ids]])
                if need.size:
                    states = torch.from_numpy(self.centres[need]).float()
                    with bf16_matmuls(self.bf16):
                        for table, w in zip(self.sides, self.w_sides):
                            table[torch.from_numpy(need)] = linear(states, w, None)
                    self.known[need] = True
        terms = self.sides[0].index_select(0, torch.from_numpy(left))
        return terms.add_(self.sides[1].index_select(0, torch.from_numpy(right)))

    def estimate(self, served: torch.Tensor, left: np.ndarray, right: np.ndarray,
                 from_bigram: torch.Tensor) -> torch.Tensor:
        served = served.float()
        hid = self.side_terms(left, right).add_(self.bias)
        hid.add_(from_bigram.float()[:, None] * self.w_flag)
        with bf16_matmuls(self.bf16):
            for k, w in enumerate(self.w_rows):
                rows = served[:, k].abs().amax(-1) > 0
                if bool(rows.all()):
                    hid.add_(linear(served[:, k].contiguous(), w, None))
                elif bool(rows.any()):
                    idx = rows.nonzero().squeeze(1)
                    hid.index_add_(0, idx, linear(served[idx, k].contiguous(), w, None))
            return served + self.model.out(F.gelu(hid)).view(served.shape)


def neighbour_states(store: PlotStore, keys: np.ndarray, centres: CentreTable | None = None) -> np.ndarray:
    """The states of ``l`` and ``r`` alone for tri-gram ``keys`` ``(l, c, r)``: gathered from
    ``centres`` (a ``CentreTable`` of ``store``) where given, else read from the PLOT.
    Shapes: keys (N,) uint64 -> (N, 2, H) float16."""
    w = unpack(keys)
    if centres is not None:
        return centres[w[:, [0, 2]]]
    return np.stack([centre_states(store, w[:, 0]), centre_states(store, w[:, 2])], 1)


def served_backoff(store: PlotStore, keys: np.ndarray, withhold: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """What the paper's back-off serves for tri-gram ``keys`` of one PLOT: the bi-gram where held
    (and not in ``withhold``, as training serves some windows), else the uni-gram.
    Shapes: keys (N,) uint64; withhold (N,) bool -> values (N, 3, H) float16, from_bigram (N,) bool."""
    bi, held = store.get_many(bigram_backoff(keys))
    uni, _ = store.get_many(unigram_backoff(keys))
    if withhold is not None:
        held = held & ~withhold
    return np.where(held[:, None, None], bi, uni), held


def estimate(model: LearnedBackoff, store: PlotStore, keys: np.ndarray, served: np.ndarray,
             from_bigram: np.ndarray, bf16: bool | None = None, centres: CentreTable | None = None,
             projected: ProjectedBackoff | None = None) -> np.ndarray:
    """The model's states for missed windows ``keys`` given what the back-off served them, its
    products in bf16 where ``bf16`` (default ``SERVE_BF16``) and the CPU has it; the neighbours'
    states from ``centres`` (a ``CentreTable`` of ``store``) where given, else from ``store``;
    through ``projected`` (a ``ProjectedBackoff`` of ``model`` and ``centres``) where given and of
    the same precision, else through ``model.forward`` (the reference).
    Shapes: keys (N,) uint64; served (N, 3, H) float16; from_bigram (N,) bool -> (N, 3, H) float16."""
    use_bf16 = (SERVE_BF16 if bf16 is None else bf16) and NATIVE_BF16
    if projected is not None and projected.bf16 == use_bf16:
        w = unpack(keys)
        with torch.no_grad():
            out = projected.estimate(torch.from_numpy(served), w[:, 0], w[:, 2], torch.from_numpy(from_bigram))
        return out.half().numpy()  # torch's conversion: numpy's rounds alike, several times slower
    context = neighbour_states(store, keys, centres)
    with torch.no_grad(), bf16_matmuls(use_bf16):
        out = model(torch.from_numpy(served), torch.from_numpy(context), torch.from_numpy(from_bigram))
    return out.half().numpy()


def trained(path: Path | str) -> bool:
    """Whether the PLOT at ``path`` has a whole model: its record is written after its weights, so
    weights a training left without one (stopped while writing them) do not count."""
    return (Path(path) / CONFIG).is_file()


class ShippedBackoffDamagedError(RuntimeError):
    """A learned back-off shipped with the package does not match its recorded sha256."""


def install(path: Path | str, shipped: Path) -> bool:
    """Places the model shipped in the folder ``shipped`` (trained on the PLOT that folder's
    artifact builds from the general corpus) beside the PLOT at ``path`` when that PLOT has none:
    the weights checked against their recorded sha256, then written, then the record (``trained``
    reads the record).  Returns whether it placed one."""
    path, shipped = Path(path), Path(shipped)
    if trained(path) or not (shipped / CONFIG).is_file():
        return False
    record = json.loads((shipped / CONFIG).read_text())
    if sha256_file(shipped / WEIGHTS) != record.get("weights_sha256"):
        raise ShippedBackoffDamagedError(f"the learned back-off shipped in {shipped} is damaged (its sha256 differs)")
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path / WEIGHTS, (shipped / WEIGHTS).read_bytes())
    atomic_write_bytes(path / CONFIG, (shipped / CONFIG).read_bytes())
    return True


def resolve_policy(policy: str, version, root) -> str:
    """The miss policy a server of ``root`` (an artifact: its ``artifact_id`` and ``spec``) serves:
    ``policy``, or for ``auto`` the root's choice (``hmi.model.aliases.auto_miss_policy``, a policy
    that reads the learned back-off) where the root PLOT (``version``'s store) has a learned
    back-off, else ``backoff``.  The package ships the learned back-off of its shipped default
    artifact: it is placed beside that artifact's root PLOT first (``install``)."""
    if policy != "auto":
        return policy
    path = place_shipped(version.store, root)
    return auto_choice(path, root.artifact_id, root.spec.source, root.spec.l_low)


def auto_choice(path: Path | str, artifact_id: str, source: str | None, l_low: int) -> str:
    """What ``auto`` serves over the root PLOT at ``path`` of the artifact ``artifact_id`` (of the
    root named by ``source``, split at ``l_low``): the root's choice (``auto_miss_policy``) where
    that PLOT has a learned back-off or the package ships one for the artifact, else ``backoff``."""
    has_model = trained(path) or trained(SHIPPED_DIR / artifact_id)
    return auto_miss_policy(source, l_low) if has_model else "backoff"


def place_shipped(store, root) -> Path:
    """Places the learned back-off shipped for ``root``'s artifact beside its root PLOT ``store``
    where that PLOT has none (``install``), as a server of the root does first; returns the PLOT's
    path."""
    path = Path(getattr(store, "store", store).path)  # a PLOT being built: hmi.plot.pending
    install(path, SHIPPED_DIR / root.artifact_id)
    return path


def fingerprint(path: Path | str) -> str | None:
    """The identity of the model kept beside the PLOT at ``path`` (its weights' sha256, 16 hex
    digits), or None where it has none."""
    return sha256_file(Path(path) / WEIGHTS)[:16] if trained(path) else None


def load(path: Path | str) -> LearnedBackoff | None:
    """The model kept beside the PLOT at ``path`` (an LMDB folder), or None."""
    path = Path(path)
    if not trained(path):
        return None
    cfg = json.loads((path / CONFIG).read_text())
    model = LearnedBackoff(cfg["hidden_size"], cfg["width"])
    model.load_state_dict(load_file(str(path / WEIGHTS)))
    return model.eval()
