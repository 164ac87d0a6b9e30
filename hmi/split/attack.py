"""The provider as an attacker: what it can learn of a private tenant's adapter from the calls it
served (the threat model of Symbiosis: the provider tries to extract the adapter's parameters).

The attack here targets a LoRA update of the FFN's first projection, delta W = scaling * B A
(I, H).  Per forward pass the server sees the FFN's input y (the ``ffn_in`` call's rows) and,
one call later, its activated output a = GELU(y (W + delta W)^T + b) (the ``ffn_out`` call's
rows).  Where a > 0 GELU is one-to-one, so z = GELU^-1(a) = y (W + delta W)^T + b is linear in
the unknown: each output unit's row of W + delta W is a least-squares fit over the tokens where
that unit fired; W is the public root's, so delta W follows.

- ``naive``: takes the rows as they arrived.
- ``informed``: knows every noise value the client registered with the server (the inputs of
  its ``nobias`` calls) and, per call, tries each: the FFN's input is a LayerNorm output (every
  row has mean 0 and variance 1 once the norm's public scale and shift are undone) and its
  activated output never falls below GELU's minimum, so the right value is the one that leaves
  rows with that structure.
- ``predicted``, the strongest here: knows what every provider knows, the token ids (the PLOT
  lookup's input) and the public root. Layer by layer it predicts the FFN's input exactly (the
  update sits on the FFN's first projection, so everything before it is the public root's) and
  its activated output as the root alone would give it; the observed activated outputs depart
  from that prediction by the update's effect (small, spread over every direction) and by the
  noise, which a pool of K values confines to K directions: those are the K directions the
  departures vary most in. It replaces the observed rows' component there by the prediction's
  and fits the update on the predicted inputs, then carries the corrected outputs to the next
  layer. The noise's scale and the pool's values do not matter; what it loses is the update's own
  effect within those K directions.
- ``subspace``: against noise it never saw, drawn from a pool of K values per projection (so
  confined to a K-dimensional subspace): it finds that subspace as the directions in which the
  rows it received vary most and replaces each row's component there by the rows' mean, losing
  the true rows' own variation there along with the noise; ``told`` the exact subspaces, it
  bounds what finding them can give.

- ``predicted`` against fresh noise over every direction (``hmi.split.noise.FreshNoise``): there
  is no subspace to take off, so it fits through the noise (``ffn_update_through_noise``),
  linearised around the root's own output; the noise averages out as texts are observed.
- ``labels_from_gradients``: a private fine-tune's labels from the backward calls of its steps
  (the gradients through the frozen projections, which no noise hides): one guess per example.

Two parts of delta W no observation shows.  An output unit the observed tokens never made fire
cannot be fitted from them: an estimate covers the units with enough firing tokens
(``Estimate.covered``).  And every LayerNorm output y satisfies y . (1/gamma) = sum(beta/gamma),
a constant, so a row's component along u = 1/gamma only shifts the unit's bias: it changes no
answer and no attacker can see it.  ``extraction_error`` is ``||estimate - delta W||_F /
||delta W||_F`` over the covered units, both with their component along u removed: near 0 means
the update's whole effect on those units was recovered; 1 is what the estimate 0 scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hmi.model.encoder_layers import Sites, layer_forward
from hmi.model.root import attention_mask

GELU_MIN = -0.17  # GELU's minimum is -0.16997 (at x = -0.7518)


class Recording:
    """Everything the server received from one caller: an observer of the base executor
    (``BaseExecutor.observers``)."""

    def __init__(self, caller: str):
        self.caller = caller
        self.calls: list[tuple[tuple, torch.Tensor]] = []

    def __call__(self, caller: str, call: tuple, tensor: torch.Tensor) -> None:
        if caller == self.caller:
            self.calls.append((call, tensor.detach().clone()))

    def first(self, batches: int) -> Recording:
        """What the server had received by the end of the client's first ``batches`` requests
        (each begins with its ``lower`` call): the same attacks on fewer observed texts."""
        out, seen = Recording(self.caller), 0
        for call, tensor in self.calls:
            seen += call == ("lower",)
            if seen > batches:
                break
            out.calls.append((call, tensor))
        return out

    def rows(self, layer: int, projection: str, operation: str) -> list[torch.Tensor]:
        """The bodies of that projection's calls, in the order they came."""
        return [t for call, t in self.calls if call == (layer, projection, operation)]

    def lowers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(token ids (B, T), mask (B, T)) of each ``lower`` call, in the order they came."""
        return [(t[0], t[1]) for call, t in self.calls if call == ("lower",)]

    def registered(self, layer: int, projection: str) -> torch.Tensor | None:
        """The noise values the client registered for a projection (its ``nobias`` inputs), (K, D)."""
        got = self.rows(layer, projection, "nobias")
        return torch.cat(got) if got else None

    def ffn_pairs(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the FFN's input (N, H), its activated output (N, I)) of each forward pass through
        ``layer``: the c-th ``ffn_in`` call with the c-th ``ffn_out`` call (one client calls in order)."""
        return list(zip(self.rows(layer, "ffn_in", "forward"), self.rows(layer, "ffn_out", "forward")))


def gelu_slope(x: torch.Tensor) -> torch.Tensor:
    """GELU'(x) = Phi(x) + x phi(x).  Shapes: (...) -> (...)."""
    return 0.5 * (1 + torch.erf(x / 2 ** 0.5)) + x * (torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5)


def gelu_inverse(a: torch.Tensor, iterations: int = 40) -> torch.Tensor:
    """x >= -0.75 with GELU(x) = a (the branch where GELU is one-to-one), by Newton's method in
    float64.  Shapes: a (...) -> (...)."""
    a = a.double()
    x = a.clone().clamp_min(0.0)
    for _ in range(iterations):
        x = x - (F.gelu(x) - a) / gelu_slope(x)
    return x


@dataclass
class Estimate:
    """An attacker's delta W (I, H), the units (I,) bool it could fit, and the direction u (H,)
    no observation shows (``visible`` removes it)."""

    update: torch.Tensor
    covered: torch.Tensor
    hidden_direction: torch.Tensor

    def visible(self, m: torch.Tensor) -> torch.Tensor:
        """Rows of ``m`` (I, H) without their component along ``hidden_direction``."""
        u = self.hidden_direction / self.hidden_direction.norm()
        return m - (m @ u)[:, None] * u


def ffn_update(pairs: list[tuple[torch.Tensor, torch.Tensor]], w: torch.Tensor, gamma: torch.Tensor,
               fired: float = 0.0, rows_per_weight: float = 2.0, units: torch.Tensor | None = None) -> Estimate:
    """The least-squares estimate of delta W from (input, activated output) pairs: for each output
    unit, the tokens where its activation exceeds ``fired`` (where GELU is one-to-one); a unit
    with fewer than ``rows_per_weight`` times H + 1 such tokens is not fitted, nor one outside
    ``units`` (indices; default all: a fit costs a least-squares solve per unit).  ``gamma``: the
    scale of the LayerNorm whose output feeds the FFN.
    Shapes: pairs of (N_c, H) and (N_c, I); w (I, H) the root's; gamma (H,) -> Estimate."""
    y = torch.cat([p[0] for p in pairs]).double()
    a = torch.cat([p[1] for p in pairs]).double()
    z = gelu_inverse(a)
    design = torch.cat([y, torch.ones(len(y), 1, dtype=y.dtype)], dim=1)
    est = torch.zeros_like(w, dtype=torch.float64)
    covered = torch.zeros(w.shape[0], dtype=torch.bool)
    for j in range(w.shape[0]) if units is None else units.tolist():
        rows = a[:, j] > fired
        if int(rows.sum()) < rows_per_weight * design.shape[1]:
            continue
        est[j] = torch.linalg.lstsq(design[rows], z[rows, j:j + 1], driver="gelsd").solution[:-1, 0] - w[j].double()
        covered[j] = True
    return Estimate(est.float(), covered, 1.0 / gamma.detach().float())


def ffn_update_through_noise(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor,
                             units: torch.Tensor | None = None) -> Estimate:
    """The least-squares estimate of delta W from inputs ``y`` known exactly (predicted) and
    activated outputs ``a`` observed through zero-mean noise that spans every direction (nothing
    to take off): linearised around the root's own output, a - GELU(y W^T + b) = GELU'(y W^T + b)
    (y delta W^T) + noise + O(delta W^2), each unit a weighted regression over every token.  The
    noise averages out as tokens are added.  Shapes: y (N, H); a (N, I); w (I, H); b (I,); gamma
    (H,) -> Estimate."""
    y, a = y.double(), a.double()
    pre = y @ w.double().T + b.double()
    resid, slope = a - F.gelu(pre), gelu_slope(pre)
    design = torch.cat([y, torch.ones(len(y), 1, dtype=y.dtype)], dim=1)
    est = torch.zeros_like(w, dtype=torch.float64)
    covered = torch.zeros(w.shape[0], dtype=torch.bool)
    if len(y) < 2 * design.shape[1]:  # fewer tokens than twice the unknowns of a unit: no unit is fitted
        return Estimate(est.float(), covered, 1.0 / gamma.detach().float())
    for j in range(w.shape[0]) if units is None else units.tolist():
        g = slope[:, j:j + 1]
        est[j] = torch.linalg.lstsq(g * design, resid[:, j:j + 1], driver="gelsd").solution[:-1, 0]
        covered[j] = True
    return Estimate(est.float(), covered, 1.0 / gamma.detach().float())


def naive(recording: Recording, layer: int, w: torch.Tensor, gamma: torch.Tensor, **fit) -> Estimate:
    """delta W of ``layer``'s ``ffn_in`` from the rows as they arrived (``fit``: ``ffn_update``'s options)."""
    return ffn_update(recording.ffn_pairs(layer), w, gamma, **fit)


def layernorm_misfit(y: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> float:
    """How far rows are from a LayerNorm's output: with the norm's scale and shift undone, each row
    has mean 0 and variance 1.  Shapes: y (N, H); gamma, beta (H,)."""
    keep = gamma.abs() > 1e-3
    t = (y[:, keep] - beta[keep]) / gamma[keep]
    return float((t.mean(1) ** 2 + (t.var(1, unbiased=False) - 1) ** 2).mean())


def below_gelu(a: torch.Tensor) -> int:
    """How many entries no GELU can output."""
    return int((a < GELU_MIN - 1e-4).sum())


def informed(recording: Recording, layer: int, w: torch.Tensor, gamma: torch.Tensor,
             beta: torch.Tensor, **fit) -> Estimate:
    """delta W of ``layer``'s ``ffn_in`` after taking off each call the registered noise value
    that leaves its rows a LayerNorm's output (the input) or a GELU's (the activated output);
    where none was registered, the rows as they arrived.  ``gamma``, ``beta``: the public root's
    attention-output LayerNorm of ``layer`` (what feeds the FFN)."""
    n_in, n_out = recording.registered(layer, "ffn_in"), recording.registered(layer, "ffn_out")
    pairs = []
    for y, a in recording.ffn_pairs(layer):
        if n_in is not None:
            y = min((y - n for n in n_in), key=lambda c: layernorm_misfit(c, gamma, beta))
        if n_out is not None:
            a = min((a - n for n in n_out), key=below_gelu)
        pairs.append((y, a))
    return ffn_update(pairs, w, gamma, **fit)


def varied_most(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` orthonormal directions (k, D) along which ``rows`` (N, D) vary most (their
    principal components)."""
    centred = rows.double() - rows.double().mean(0)
    return torch.linalg.svd(centred, full_matrices=False).Vh[:k]


def flattened(rows: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``rows`` (N, D) with their component along ``directions`` (k, D) replaced by the rows' mean's."""
    rows = rows.double()
    return rows - ((rows - rows.mean(0)) @ directions.T) @ directions


def subspace(recording: Recording, layer: int, w: torch.Tensor, gamma: torch.Tensor, k: int,
             told: tuple[torch.Tensor, torch.Tensor] | None = None, **fit) -> Estimate:
    """delta W of ``layer``'s ``ffn_in`` from rows with their ``k`` most varying directions (where
    noise drawn from a pool of ``k`` values lies) flattened, in the input and in the activated
    output alike.  ``told``: the pools' values (K, H) and (K, I) themselves, for an attacker told
    the exact subspaces (the bound on what finding them can give)."""
    pairs = recording.ffn_pairs(layer)
    if told is not None:
        d_in, d_out = (torch.linalg.qr(v.double().T).Q.T for v in told)
    else:
        d_in = varied_most(torch.cat([y for y, _ in pairs]), k)
        d_out = varied_most(torch.cat([a for _, a in pairs]), k)
    return ffn_update([(flattened(y, d_in), flattened(a, d_out)) for y, a in pairs], w, gamma, **fit)


class _Substitute(Sites):
    """The public root's layer, with the FFN's activated output replaced by given rows (the
    attacker's corrected observation) and the FFN's input and predicted activation kept."""

    def __init__(self, real: torch.Tensor, activated: torch.Tensor | None = None):
        self.real, self.activated = real, activated
        self.ffn_input = self.predicted = None

    def projections(self, li, sites, x, linears):
        if sites == ("ffn_in",):
            self.ffn_input = x[self.real]
        if sites == ("ffn_out",):
            self.predicted = x[self.real]
            if self.activated is not None:
                x = x.clone()
                x[self.real] = self.activated.to(x.dtype)
        return super().projections(li, sites, x, linears)


def predicted(recording: Recording, lower, layers, l_low: int, k: int, relative_bias=None,
              units: torch.Tensor | None = None, **fit) -> dict[int, Estimate]:
    """delta W of every upper layer's ``ffn_in`` (the ``predicted`` attacker above): ``lower(ids,
    mask)`` is the server's own lookup (what it answered the ``lower`` calls with, (B, T, H));
    ``layers`` the public root's upper layers (``l_low`` the first one's index); ``k`` the noise's
    pool size (the scheme is public; 0 for rows sent without noise; None for fresh noise over every
    direction: then it fits through the noise, ``ffn_update_through_noise``, and carries the root's
    output with its estimate to the next layer).  One client's calls, in order.
    What it cannot recover is about the update's component within the noise's K directions (its
    effect there is indistinguishable from noise: ``noise_floor``; through GELU a little more).
    The corrected rows carry that component as an error of a few hundredths, which could take a
    unit's row from GELU's far branch (z well below -0.75, GELU(z) just under 0) to just over 0:
    a unit counts as fired above ``fired`` = 0.1 unless told otherwise.  Returns {layer: Estimate}."""
    fit.setdefault("fired", 0.1)
    lowers = recording.lowers()
    hidden = [lower(ids, mask) for ids, mask in lowers]
    reals = [mask.bool() for _, mask in lowers]
    exts = [attention_mask(mask, h.dtype, relative_bias) for (_, mask), h in zip(lowers, hidden)]  # every layer's
    out = {}
    with torch.no_grad():
        for li, layer in enumerate(layers):
            index = l_low + li
            seen = recording.rows(index, "ffn_out", "forward")
            inputs, guesses = [], []
            for h, ext, real in zip(hidden, exts, reals):
                probe = _Substitute(real)
                layer_forward(li, layer, h, ext, probe)
                inputs.append(probe.ffn_input)
                guesses.append(probe.predicted)
            dense, gamma = layer.intermediate.dense, layer.attention.output.LayerNorm.weight
            y, a = torch.cat(inputs).double(), torch.cat(seen).double()
            guess = torch.cat(guesses).double()
            if k is None:  # nothing to take off: fit through it, carry the estimate's own output
                est = ffn_update_through_noise(y, a, dense.weight, dense.bias, gamma, units)
                out[index] = est
                clean = F.gelu(y @ (dense.weight.double() + est.update.double()).T + dense.bias.double())
            else:
                if k:
                    directions = torch.linalg.svd(a - guess, full_matrices=False).Vh[:k]  # (k, I)
                    clean = a - ((a - guess) @ directions.T) @ directions
                else:
                    clean = a
                out[index] = ffn_update([(y, clean)], dense.weight, gamma, units=units, **fit)
            parts = clean.split([len(t) for t in inputs])
            hidden = [layer_forward(li, layer, h, ext, _Substitute(real, part))
                      for h, ext, real, part in zip(hidden, exts, reals, parts)]
    return out


def noise_floor(true: torch.Tensor, directions: torch.Tensor, estimate: Estimate) -> float:
    """The extraction error of an attacker that recovers all of the update ``true`` (I, H) but its
    component within the noise's ``directions`` (k, I), on the units ``estimate`` covers: no fit
    of the activated outputs separates that component's effect from the noise."""
    q = torch.linalg.qr(directions.double().T).Q  # (I, k) orthonormal
    seen = true.double() - q @ (q.T @ true.double())
    return extraction_error(Estimate(seen.float(), estimate.covered, estimate.hidden_direction), true)


def extraction_error(estimate: Estimate, true: torch.Tensor, units: torch.Tensor | None = None) -> float:
    """``||estimate - true||_F / ||true||_F`` over the rows of ``units`` (I,) bool (default: the
    units the estimate covers); 1.0 when it covers none."""
    units = estimate.covered if units is None else units
    if not bool(units.any()):
        return 1.0
    true = estimate.visible(true)[units]
    return float((estimate.visible(estimate.update)[units] - true).norm() / true.norm())


def lora_update(weights: dict[str, torch.Tensor], li: int, site: str, scaling: float) -> torch.Tensor:
    """The true update scaling * B A of a LoRA site of upper layer ``li`` (canonical weights)."""
    return scaling * weights[f"layers.{li}.lora.{site}_B"] @ weights[f"layers.{li}.lora.{site}_A"]


def labels_from_gradients(recording: Recording, layer: int) -> torch.Tensor | None:
    """The provider's guess of a private fine-tune's labels (binary classification) from the
    backward calls it served: one 0/1 guess per training example, in the order it saw them, up to
    one global flip; None where it saw no backward call (nothing to read them from).

    The backward call of the last upper layer's ``ffn_out`` carries dL/dy for each real token's
    row.  With a head on [CLS], only [CLS]'s row is non-zero (the LayerNorm after it works row by
    row), one per example in batch order; there dL/dy = J (softmax(z) - onehot(y)) W_head, which
    for two labels is (p - y) J (w_1 - w_0): rows of one label lie on one side of the direction
    they vary most along.  The guess is the sign of each row along the top singular direction of
    all of them (uncentred).  Shapes: calls' rows (N_rows, H) -> guesses (N_examples,) int64."""
    calls = recording.rows(layer, "ffn_out", "backward")
    if not calls:
        return None
    rows = torch.cat([c[c.norm(dim=-1) > 0] for c in calls]).double()
    direction = torch.linalg.svd(rows, full_matrices=False).Vh[0]
    return (rows @ direction > 0).long()


def label_recovery(guesses: torch.Tensor | None, labels: torch.Tensor) -> float:
    """The share of ``labels`` (N,) a provider's ``guesses`` (N,) recover, up to one global flip
    (the better of the two readings); without guesses, the majority class's share (the best a
    provider does knowing only how labels are spread)."""
    labels = labels.long()
    majority = float(max(labels.float().mean(), 1 - labels.float().mean()))
    if guesses is None:
        return majority
    if guesses.shape != labels.shape:
        raise ValueError(f"{guesses.shape[0]} guesses for {labels.shape[0]} labels: the calls were not one example a row")
    same = float((guesses == labels).float().mean())
    return max(same, 1 - same)
