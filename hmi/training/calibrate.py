"""Root calibration (docs/design.md, section 5): distill the windowed lower stack from the full model.

Trained: the windowed lower layers, the gate, the merge embeddings and LayerNorm.  Targets, from
the frozen full-context root on real text: its layer-``L_low`` hidden states (MSE), the output
of every shared upper layer (MSE) and one minus the cosine of the mean-pooled final output.
Checkpoints let a killed run resume where it stopped.

The recipe (``CalibrationConfig``) fixes the steps and their learning-rate schedule, whatever the
machine: a slow machine takes longer, it does not calibrate less.  A run of hours may take several
invocations: ``calibrate(..., max_minutes=M)`` stops after the first step past M minutes of this
invocation, writes a checkpoint there and raises :class:`CalibrationUnfinished`
(``hmi.timelimit.OutOfTime``); the same call again continues from it.  A run resumed from a
checkpoint ends with the weights of the uninterrupted run (same CPU kind, torch and threads).

Back-off (``CalibrationConfig.backoff``, the default): serving reads a window from the PLOT only
when the corpus held it, and most windows of new text are not there (they back off to a bi-gram
or uni-gram entry).  Calibration trains on exactly that: the corpus is split in two halves and a
text of one half is read as a PLOT built from the other half would serve it, so the bi-gram and
uni-gram entries learn to stand in for the windows they replace.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hmi.home import hmi_home
from hmi.io import atomic_write_text, atomic_write_with
from hmi.model.artifact import Root, artifact_config, load_windowed, point_at, roots_dir, save_artifact
from hmi.model.hplm import HPLM
from hmi.model.kernels import BF16_UNIT, bf16_matmuls
from hmi.model.root import attention_mask, full_forward, mean_pool, weights_fingerprint
from hmi.plot.build import count_ngrams
from hmi.plot.keys import bigram_backoff, pack, served_keys, unpack
from hmi.timelimit import OutOfTime, TimeLimit
from hmi.training.fit import Fit, deterministic
from hmi.training.recipe_folder import recipe_folder


@dataclass
class CalibrationConfig:
    steps: int = 600
    batch_size: int = 32
    max_len: int = 128
    lr: float = 5e-4
    warmup: int = 20
    weight_lower: float = 1.0
    weight_output: float = 1.0
    weight_pooled: float = 2.0
    seed: int = 0
    eval_texts: int = 256
    checkpoint_every: int = 25
    backoff: bool = True
    length_grouped: bool = True  # batches of texts of similar length: little padding in the full-context passes
    # The training steps' GEMMs in bf16 (fp32 accumulation) where the CPU multiplies bf16 natively
    # (hmi.model.kernels.bf16_matmuls), fp32 elsewhere; the quality measures always run in fp32.
    bf16: bool = False
    # The word embeddings stay the root's: the windowed layers learn around them, and the artifact
    # then stores no copy of the largest tensor (hmi.model.artifact stores what differs from the root).
    train_word_embeddings: bool = False
    # Each window on its present tokens alone (``WindowedLower.states``): the masked windows'
    # values and gradients at about half their work (most windows back off to bi- and uni-grams);
    # not bit for bit, so the shipped default recipe keeps it off (docs/roots.md).
    present_tokens: bool = False
    # Each distinct window the back-off serves computed once per batch: the same arithmetic, but
    # one dropout mask for every position it stands for; no recipe uses it (docs/decisions.md).
    served_once: bool = False
    # The text distilled on (``hmi.data.corpus_texts``): ``general`` (the shipped recipe: an equal
    # share of every domain, 1.8M characters) or ``all`` (every domain corpus, about 32M: mpnet-base's).
    corpus: str = "general"


class HeldOutBackoff:
    """The n-grams a PLOT of a corpus holds, and of each half of it (texts ``i % 2``).

    ``serve(fold)`` resolves windows as a PLOT of the *other* half would (a text never finds its
    own rare windows); ``serve(None)`` as the PLOT of the whole corpus does.
    """

    def __init__(self, token_lists: list[list[int]]):
        def tables(lists):
            tri, _ = count_ngrams(lists)
            return tri, np.unique(bigram_backoff(tri))

        self.halves = [tables(token_lists[f::2]) for f in range(2)]
        self.whole = tables(token_lists)

    def serve(self, fold: int | None):
        """Shapes of the returned map: windows (U, 3) int64 -> serving windows (U, 3) int64."""
        tri, bi = self.whole if fold is None else self.halves[1 - fold]
        return lambda windows: unpack(served_keys(pack(windows), tri, bi))


def tokenize(tokenizer, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, truncation=True, max_length=max_len, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def token_lists(tokenizer, texts: list[str], max_len: int, chunk: int = 1000) -> list[list[int]]:
    """Each text's token ids as calibration reads them (``tokenize``, padding dropped)."""
    out = []
    for i in range(0, len(texts), chunk):
        ids, mask = tokenize(tokenizer, texts[i:i + chunk], max_len)
        out.extend(row[m.bool()].tolist() for row, m in zip(ids, mask))
    return out


@torch.no_grad()
def quality(root: Root, texts: list[str], max_len: int = 128, batch_size: int = 32, serve=None) -> dict:
    """Cosine of the merged representation to the full model's layer-``L_low`` states (per token),
    and of the final mean-pooled output to the full model's (per text), averaged; with ``serve``
    (a PLOT's back-off, ``HeldOutBackoff.serve``) also as that PLOT serves the texts (``*_served``)."""
    hplm = HPLM(root.bert, root.windowed)
    sums = {}
    n_tok, n_txt = 0, 0
    texts = sorted(texts, key=len)  # similar lengths together: less padding, the same averages
    for i in range(0, len(texts), batch_size):
        ids, mask = tokenize(root.tokenizer, texts[i:i + batch_size], max_len)
        hs = full_forward(root.bert, ids, mask)
        m = mask.bool()
        for suffix, fn in (("", None),) + ((("_served", serve),) if serve is not None else ()):
            merged = hplm.windowed(ids, mask, fn)
            out = hplm.upper(merged, mask)
            lower = F.cosine_similarity(merged[m], hs[root.spec.l_low][m], dim=-1).sum().item()
            pooled = F.cosine_similarity(mean_pool(out, mask), mean_pool(hs[-1], mask), dim=-1).sum().item()
            sums["lower_cosine" + suffix] = sums.get("lower_cosine" + suffix, 0.0) + lower
            sums["pooled_cosine" + suffix] = sums.get("pooled_cosine" + suffix, 0.0) + pooled
        n_tok += int(m.sum())
        n_txt += ids.shape[0]
    return {k: round(v / (n_tok if k.startswith("lower") else n_txt), 4) for k, v in sums.items()}


def calibration_loss(root: Root, hplm: HPLM, ids, mask, cfg: CalibrationConfig, serve=None) -> tuple[torch.Tensor, dict]:
    """``serve``: the back-off the texts are read with (None: every window computed)."""
    with torch.no_grad():
        hs = full_forward(root.bert, ids, mask)
    merged = hplm.windowed(ids, mask, serve, served_once=cfg.served_once, masked=False if cfg.present_tokens else None)
    m = mask.bool()
    l_lower = F.mse_loss(merged[m], hs[root.spec.l_low][m])
    # Every upper layer's output is matched, not only the last: the richer signal generalizes better.
    ext = attention_mask(mask, merged.dtype, hplm.upper.relative_bias)
    h, l_out = merged, 0.0
    for i, layer in enumerate(hplm.upper.layers):
        h = layer(h, ext)[0]
        l_out = l_out + F.mse_loss(h[m], hs[root.spec.l_low + 1 + i][m])
    l_out = l_out / len(hplm.upper.layers)
    out = h
    l_pool = (1 - F.cosine_similarity(mean_pool(out, mask), mean_pool(hs[-1], mask), dim=-1)).mean()
    loss = cfg.weight_lower * l_lower + cfg.weight_output * l_out + cfg.weight_pooled * l_pool
    return loss, {"lower": l_lower.item(), "out": l_out.item(), "pool": l_pool.item()}


class CalibrationUnfinished(OutOfTime):
    """A calibration stopped at its invocation's time limit; its checkpoint holds the steps done."""


def schedule(cfg: CalibrationConfig):
    """The learning-rate factor of step ``s``: linear warm-up over ``cfg.warmup`` steps, then a
    linear decay to 5% at ``cfg.steps``."""
    return lambda s: min(1.0, (s + 1) / max(1, cfg.warmup)) * max(0.05, 1 - s / max(1, cfg.steps))


def length_grouped(order: np.ndarray, lengths: list[int], batch: int, rng: np.random.Generator,
                   group: int = 50) -> np.ndarray:
    """``order`` rearranged so that each run of ``batch`` consecutive texts has similar lengths:
    chunks of ``batch * group`` texts are sorted by length, cut into batches, and the batches of
    a chunk shuffled.  Every text keeps its place in the epoch's chunk; padding nearly vanishes
    (the general corpus's lines are 25 tokens at the median, 128 at most)."""
    out = []
    for s in range(0, len(order), batch * group):
        chunk = sorted(order[s:s + batch * group], key=lambda i: lengths[i])
        batches = [chunk[b:b + batch] for b in range(0, len(chunk), batch)]
        for b in rng.permutation(len(batches)):
            out.extend(batches[b])
    return np.array(out, dtype=np.int64)


def distill_fit(windowed, cfg: CalibrationConfig, desc: str, **fit_options) -> Fit:
    """Makes every parameter of the windowed lower side trainable but the word embeddings (unless
    ``cfg.train_word_embeddings``: they stay the root's, shared with it) and returns the ``Fit``
    that trains them with calibration's optimizer settings and ``schedule(cfg)``."""
    for p in windowed.parameters():
        p.requires_grad_(True)
    windowed.lower.embeddings.word_embeddings.weight.requires_grad_(cfg.train_word_embeddings)
    return Fit([p for p in windowed.parameters() if p.requires_grad], cfg.steps, lr=cfg.lr, weight_decay=0.01,
               clip=1.0, desc=desc, schedule=schedule(cfg), **fit_options)


def distill_steps(root: Root, train_texts: list[str], cfg: CalibrationConfig, fit: Fit, backoff: HeldOutBackoff | None,
                  lengths: list[int], checkpoint, limit: TimeLimit | None = None) -> bool:
    """The calibration steps from ``fit.step_count`` to the end, calling ``checkpoint()`` every
    ``cfg.checkpoint_every`` steps and at the end.  With a ``limit``, the steps stop after the
    first one run once it is spent (at least one step per call), with a checkpoint there.
    Returns whether the steps reached the end.  With back-off, a step's texts come from one half
    (alternating), read as the other half's PLOT serves them."""
    rng = np.random.default_rng(cfg.seed)
    folds = [np.arange(f, len(train_texts), 2) for f in range(2)] if backoff else [np.arange(len(train_texts))]
    orders = [rng.permutation(f) for f in folds]
    if cfg.length_grouped:
        orders = [length_grouped(o, lengths, cfg.batch_size, rng) for o in orders]
    hplm = HPLM(root.bert, root.windowed)
    root.windowed.train()
    with fit:
        while not fit.done:
            fit.check()
            fold = fit.step_count % len(orders)
            order, turn = orders[fold], fit.step_count // len(orders)
            idx = [order[(turn * cfg.batch_size + k) % len(order)] for k in range(cfg.batch_size)]
            ids, mask = tokenize(root.tokenizer, [train_texts[i] for i in idx], cfg.max_len)
            loss, parts = calibration_loss(root, hplm, ids, mask, cfg, backoff.serve(fold) if backoff else None)
            fit.step(loss, **{k: f"{v:.4f}" for k, v in parts.items()})
            stop = not fit.done and limit is not None and limit.spent()
            if fit.step_count % cfg.checkpoint_every == 0 or fit.done or stop:
                checkpoint()
            if stop:
                return False
    return True


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def same_recipe(saved: dict, config: dict) -> bool:
    """Whether a checkpoint's configuration is this one's.  Checkpoints written while a time
    budget was part of the recipe (``max_minutes``) match on the rest: a budget never changed
    what a step computes, and their runs continue to the recipe's end."""
    defaults = asdict(CalibrationConfig())  # settings added since: their defaults are the earlier behaviour
    return {**defaults, **{k: v for k, v in saved.items() if k != "max_minutes"}} == {**defaults, **config}


def resume(ckpt_path: Path, cfg: CalibrationConfig, fingerprint: str, windowed, fit: Fit, log) -> tuple[dict | None, float]:
    """Loads a checkpoint of this recipe on this root into ``windowed`` and ``fit`` (with torch's
    random state, so the dropout masks to come are an uninterrupted run's); returns (the quality
    before calibration it recorded, its training seconds), (None, 0.0) when there is none."""
    if not ckpt_path.exists():
        return None, 0.0
    ck = torch.load(ckpt_path, weights_only=True)
    if not same_recipe(ck["config"], asdict(cfg)) or ck.get("root") != fingerprint:
        return None, 0.0
    windowed.load_state_dict(ck["model"])
    fit.load_state_dict(ck)
    log(f"resuming calibration at step {fit.step_count}/{cfg.steps}")
    return json.loads(ck["before"]), ck.get("spent_seconds", 0.0)


def finished_run(work_dir: Path, cfg: CalibrationConfig, fingerprint: str, home: Path | None) -> tuple[str, dict] | None:
    """(artifact id, its config) of the artifact a finished run of this recipe on this root wrote
    into ``work_dir`` (its ``done`` file names it), None when there is none: no ``done`` file, the
    artifact gone or unreadable, or calibrated with another recipe, root or number of steps."""
    try:
        artifact_id = (work_dir / "done").read_text().strip()
        meta = artifact_config(artifact_id, home)
        recorded = meta["calibration"], meta["quality"]
    except (OSError, ValueError, RuntimeError, KeyError):
        return None
    recipe = {k: v for k, v in recorded[0].items() if k in asdict(cfg)}  # the settings, not what the run recorded
    if (meta.get("root_fingerprint") != fingerprint or not same_recipe(recipe, asdict(cfg))
            or recorded[0].get("steps_done") != cfg.steps):
        return None
    return artifact_id, meta


def default_work_dir(root: Root, cfg: CalibrationConfig, home: Path | None) -> Path:
    """Where a calibration of ``root`` keeps its checkpoint and ``done`` file: one folder per
    root, split, seed and recipe under ``$HMI_HOME/calibration`` (:mod:`recipe_folder`)."""
    run = f"l{root.spec.l_low}" if root.spec.source is None else root.spec.pointer.removeprefix("current-")
    return recipe_folder((home or hmi_home()) / "calibration", f"{run}-seed{cfg.seed}", cfg, CalibrationConfig(),
                         lambda folder: holds_recipe(folder / "checkpoint.pt", cfg))


def holds_recipe(ckpt_path: Path, cfg: CalibrationConfig) -> bool:
    """Whether ``ckpt_path`` is a checkpoint of recipe ``cfg`` (read memory-mapped: its config only)."""
    try:
        return same_recipe(torch.load(ckpt_path, weights_only=True, mmap=True)["config"], asdict(cfg))
    except (OSError, RuntimeError, KeyError):
        return False


def reuse_finished_run(root: Root, work_dir: Path, cfg: CalibrationConfig, fingerprint: str,
                       home: Path | None, log=print) -> tuple[str, dict] | None:
    """What ``calibrate`` returned when it finished this run before (see :func:`finished_run`),
    with that artifact's weights loaded into ``root.windowed`` and the root's pointer naming it;
    None when there is no such run."""
    if (finished := finished_run(work_dir, cfg, fingerprint, home)) is None:
        return None
    artifact_id, config = finished
    root.windowed.load_state_dict(
        load_windowed(roots_dir(home) / artifact_id, config, root.bert, root.spec.l_low).state_dict())
    root.windowed.eval().requires_grad_(False)
    point_at(artifact_id, root.spec.pointer, home)
    log(f"already calibrated: {artifact_id} ({cfg.steps} steps)")
    return artifact_id, {k: config[k] for k in ("calibration", "quality")}


def calibrate(root: Root, train_texts: list[str], eval_texts: list[str], cfg: CalibrationConfig,
              work_dir: Path | None = None, home: Path | None = None, log=print,
              max_minutes: float | None = None) -> tuple[str, dict]:
    """Runs (or resumes) calibration, saves the artifact and returns (artifact id, its metadata).
    ``max_minutes`` limits this invocation: past it, the run stops at a checkpoint and raises
    :class:`CalibrationUnfinished`; the same call again continues."""
    limit = TimeLimit(max_minutes)
    work_dir = work_dir or default_work_dir(root, cfg, home)
    work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = work_dir / "checkpoint.pt"
    fingerprint = weights_fingerprint(root.bert)  # a checkpoint resumes only on its own root
    if finished := reuse_finished_run(root, work_dir, cfg, fingerprint, home, log):
        return finished
    seed_everything(cfg.seed)

    windowed = root.windowed
    fit = distill_fit(windowed, cfg, "calibrate")

    # Quality is always also measured as the corpus's PLOT serves it; training reads it so with ``backoff``.
    lists = token_lists(root.tokenizer, train_texts, cfg.max_len)
    held = HeldOutBackoff(lists)
    backoff = held if cfg.backoff else None
    serve_whole = held.serve(None)
    before, spent_before = resume(ckpt_path, cfg, fingerprint, windowed, fit, log)
    if before is None:
        windowed.eval()
        before = quality(root, eval_texts, cfg.max_len, serve=serve_whole)
        log(f"before calibration: {before}")

    started = limit.elapsed()

    def spent() -> float:
        return spent_before + limit.elapsed() - started

    def checkpoint() -> None:
        state = {"model": windowed.state_dict(), **fit.state_dict(), "config": asdict(cfg),
                 "before": json.dumps(before), "root": fingerprint, "spent_seconds": spent()}
        atomic_write_with(ckpt_path, lambda f: torch.save(state, f))

    with deterministic(), bf16_matmuls(cfg.bf16) as bf16:
        finished = distill_steps(root, train_texts, cfg, fit, backoff, [len(x) for x in lists], checkpoint, limit)
    step, seconds = fit.step_count, spent()
    if not finished:
        pace = seconds / max(1, step)
        raise CalibrationUnfinished(
            f"{max_minutes:g} minutes spent: calibration stopped at step {step} of {cfg.steps} ({pace:.1f} s a step, "
            f"about {pace * (cfg.steps - step) / 60:.0f} minutes left), its checkpoint in {work_dir}")
    windowed.eval().requires_grad_(False)
    after = quality(root, eval_texts, cfg.max_len, serve=serve_whole)
    log(f"after calibration: {after}")
    meta = {"calibration": {**asdict(cfg), "steps_done": step,
                            "train_seconds_this_run": round(seconds - spent_before, 1),
                            "train_seconds": round(seconds, 1),
                            "bf16_matmuls": bf16, "bf16_unit": BF16_UNIT if bf16 else None,
                            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                            "cpu_capability": torch.backends.cpu.get_cpu_capability()},
            "quality": {"before": before, "after": after, "eval_texts": len(eval_texts)}}
    artifact_id = save_artifact(windowed, root.bert, root.spec, meta, home)
    atomic_write_text(work_dir / "done", artifact_id)
    return artifact_id, meta
