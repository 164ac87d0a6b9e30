"""Training a PLOT's learned back-off (``hmi.plot.learned``): resumable, checkpointed beside the PLOT."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save

from hmi.io import atomic_write_bytes, atomic_write_json, atomic_write_with
from hmi.plot.keys import ngram_order
from hmi.plot.learned import CHECKPOINT, CONFIG, TRAIN_STEPS, WEIGHTS, LearnedBackoff, neighbour_states, served_backoff, trained
from hmi.plot.store import PlotStore
from hmi.training.fit import Fit


@dataclass
class TrainConfig:
    steps: int = TRAIN_STEPS
    batch: int = 512
    lr: float = 1e-3
    width: int = 1024
    samples: int = 300_000  # tri-grams drawn from the PLOT to train on
    held_out: int = 2_000  # tri-grams kept aside to report the estimate's cosine
    drop_bigram: float = 0.5  # share of training windows served their uni-gram, as where no bi-gram is held
    seed: int = 0
    checkpoint_every: int = 100


def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - cosine per row, plus a tenth of the squared error relative to the target's mean square."""
    return (1 - F.cosine_similarity(pred, target, dim=-1)).mean() + 0.1 * F.mse_loss(pred, target) / target.pow(2).mean()


def batch_inputs(store: PlotStore, keys: np.ndarray, drop: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Training inputs and targets for tri-grams ``keys`` the PLOT holds, each served as if missing
    (``drop``: the bi-gram withheld). Shapes: keys, drop (N,) -> served (N, 3, H), context (N, 2, H),
    from_bigram (N,), target (N, 3, H), all float32."""
    target, _ = store.get_many(keys)
    served, held = served_backoff(store, keys, withhold=drop)
    context = neighbour_states(store, keys)
    return tuple(torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in (served, context, held, target))


def draw(pool: np.ndarray, cfg: TrainConfig, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The tri-grams of training step ``step`` and which of them are served without their bi-gram:
    a function of the step alone, so a resumed run draws what an uninterrupted one does (each pass
    over ``pool`` in its own order). Shapes: -> keys (batch,) sorted uint64, drop (batch,) bool."""
    per_epoch = len(pool) // cfg.batch
    order = np.random.default_rng([cfg.seed, step // per_epoch]).permutation(len(pool))
    at = (step % per_epoch) * cfg.batch
    keys = np.sort(pool[order[at:at + cfg.batch]])
    return keys, np.random.default_rng([cfg.seed, 1, step]).random(len(keys)) < cfg.drop_bigram


def train(store: PlotStore, cfg: TrainConfig = TrainConfig(), progress: bool = True) -> dict:
    """Trains (or resumes, or confirms) the learned back-off of the PLOT ``store`` and
    keeps it beside the PLOT; returns its record (steps, seconds, held-out cosine of the back-off
    and of the estimate). A run stopped on the way continues from its last checkpoint; the same
    command after a finished run returns the record without training. A model trained with another
    configuration (``cfg``) is trained again; it is served until the new one replaces it whole."""
    path = Path(store.path)
    if trained(path):
        record = json.loads((path / CONFIG).read_text())
        if record.get("train_config") == asdict(cfg):
            return {**record, "up_to_date": True}
    if store.meta.n != 3:
        raise ValueError("a learned back-off is for encoder PLOTs (three states per window); this one is causal")
    keys = store.keys()
    tri = keys[ngram_order(keys) == 3]
    if len(tri) < cfg.held_out + cfg.batch:
        raise ValueError(f"the PLOT holds {len(tri)} tri-grams; a learned back-off needs at least "
                         f"{cfg.held_out + cfg.batch} to train on")
    rng = np.random.default_rng(cfg.seed)
    chosen = tri[rng.permutation(len(tri))[:cfg.samples + cfg.held_out]]
    held_out, pool = chosen[:cfg.held_out], chosen[cfg.held_out:]
    torch.manual_seed(cfg.seed)
    model = LearnedBackoff(store.meta.hidden_size, cfg.width)
    warmup = max(1, cfg.steps // 20)

    def schedule(step: int) -> float:  # linear warm-up, then linear decay to zero
        return min(1.0, (step + 1) / warmup) * max(0.0, (cfg.steps - step) / max(1, cfg.steps - warmup))

    fit = Fit(model.parameters(), cfg.steps, lr=cfg.lr, weight_decay=0.01, schedule=schedule,
              desc="learned back-off", progress=progress)
    seconds = 0.0
    ckpt = path / CHECKPOINT
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["config"] == asdict(cfg):
            model.load_state_dict(state["model"])
            fit.load_state_dict(state["fit"])
            seconds = state["seconds"]

    def save_checkpoint() -> None:
        state = {"config": asdict(cfg), "model": model.state_dict(), "fit": fit.state_dict(), "seconds": seconds}
        atomic_write_with(ckpt, lambda f: torch.save(state, f))

    with fit:
        while not fit.done:
            t0 = time.time()
            served, context, held, target = batch_inputs(store, *draw(pool, cfg, fit.step_count))
            fit.step(loss_fn(model(served, context, held), target))
            seconds += time.time() - t0
            if fit.step_count % cfg.checkpoint_every == 0 and not fit.done:
                save_checkpoint()
    model.eval()
    record = {"hidden_size": store.meta.hidden_size, "width": cfg.width, "steps": cfg.steps,
              "train_config": asdict(cfg), "seconds": round(seconds, 1), "tri_grams": int(len(tri)),
              **held_out_cosine(model, store, held_out, cfg.seed)}
    # whole weights replace whole weights: a model trained before keeps serving until this one is written
    atomic_write_bytes(path / WEIGHTS, save({k: v.contiguous() for k, v in model.state_dict().items()}))
    atomic_write_json(path / CONFIG, record)  # written last: the weights are whole when it is there
    ckpt.unlink(missing_ok=True)
    return record


def held_out_cosine(model: LearnedBackoff, store: PlotStore, keys: np.ndarray, seed: int) -> dict:
    """Mean cosine per window row of the back-off and of the model's estimate to the stored states of
    tri-grams it did not train on, each served as if missing (half of them without their bi-gram)."""
    drop = np.random.default_rng([seed, 2]).random(len(keys)) < 0.5
    served, context, held, target = batch_inputs(store, np.sort(keys), drop)
    with torch.no_grad():
        est = model(served, context, held)
    cos = lambda a: [round(float(v), 4) for v in F.cosine_similarity(a, target, dim=-1).mean(0)]  # noqa: E731
    return {"held_out_cosine_backoff": cos(served), "held_out_cosine_learned": cos(est)}
