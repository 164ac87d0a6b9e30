"""Calibration of a decoder root: copies of the lower layers learn to produce, from a causal
window alone, the full-context model's hidden state at the split (MSE on real text).  With
``weight_logits`` the frozen upper layers also run on the windowed states and the next-token
distributions are matched to the full model's (KL divergence, the gradient flowing back through
the upper layers into the windows): what perplexity measures, for deeper splits where the state
at the split cannot be matched closely from three tokens.  The calibrated copies become a
versioned artifact under ``HMI_HOME/roots``; the full model's own layers stay untouched (the
upper layers are shared and frozen)."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from hmi.data import held_out_texts, load_corpus
from hmi.io import atomic_write_text, atomic_write_with
from hmi.model.aliases import DECODER_L_LOW
from hmi.model.artifact import SHIPPED_DIR, install_folder, point_at, shipped_folder, write_artifact
from hmi.model.decoder import DecoderRoot, full_hidden, load_decoder, perplexity, upper_logits, window_states
from hmi.model.root import weights_fingerprint
from hmi.model.windows import causal_windows, unique_windows
from hmi.timelimit import TimeLimit
from hmi.training.calibrate import CalibrationUnfinished
from hmi.training.fit import Fit
from hmi.training.recipe_folder import recipe_folder

CHECKPOINT_EVERY = 25  # steps between checkpoints (and one at an invocation's time limit)


@dataclass
class DecoderCalibrationConfig:
    steps: int = 150
    batch_size: int = 8
    lr: float = 3e-4
    max_len: int = 128
    seed: int = 0
    eval_texts: int = 32
    weight_logits: float = 0.0  # 0: the state at the split only (the shipped 2-layer recipe)


def decoder_recipe(l_low: int) -> DecoderCalibrationConfig:
    """The calibration recipe of a split: up to the shipped split (``DECODER_L_LOW``) the state at
    the split alone; deeper, where three tokens cannot reproduce that state closely, the logit
    distillation too (weight 1.0) over 300 steps (``docs/roots.md``, hGPT with 8 windowed layers)."""
    if l_low <= DECODER_L_LOW:
        return DecoderCalibrationConfig()
    return DecoderCalibrationConfig(steps=300, weight_logits=1.0)


def calibrate_decoder(root: DecoderRoot, lines: list[str], cfg: DecoderCalibrationConfig, progress: bool = True,
                      checkpoint: Path | None = None, limit: TimeLimit | None = None) -> tuple[torch.nn.ModuleList, dict]:
    """Trains copies of the lower layers; returns them and the loss history.

    With ``checkpoint`` (a file) the run writes its state there every ``CHECKPOINT_EVERY`` steps
    and continues from it when it holds this recipe on this decoder: the same weights as an
    uninterrupted run.  With ``limit`` it stops after the first step once the limit is spent,
    with a checkpoint there, and raises :class:`CalibrationUnfinished`.
    """
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    lower = copy.deepcopy(root.layers[:root.l_low]).requires_grad_(True).train()
    tok, clock = root.tokenizer, TimeLimit(None)
    fit = Fit(lower.parameters(), cfg.steps, lr=cfg.lr, weight_decay=0.0, desc="calibrate decoder", progress=progress)
    recipe, history, spent_before = {}, [], 0.0
    if checkpoint is not None:
        recipe = {"config": asdict(cfg), "l_low": root.l_low, "root": weights_fingerprint(root.model)}
        history, spent_before = _resume(checkpoint, recipe, lower, fit)
    for _ in range(fit.step_count):  # the batches of the steps already taken
        rng.integers(0, len(lines), cfg.batch_size)

    def spent() -> float:
        return spent_before + clock.elapsed()

    def save() -> None:
        state = {"lower": lower.state_dict(), **fit.state_dict(), **recipe, "history": history,
                 "spent_seconds": spent()}
        atomic_write_with(checkpoint, lambda f: torch.save(state, f))

    with fit:
        while not fit.done:
            batch = [lines[i] for i in rng.integers(0, len(lines), cfg.batch_size)]
            enc = tok(batch, truncation=True, max_length=cfg.max_len, padding=True, return_tensors="pt",
                      add_special_tokens=False)
            ids, mask = enc["input_ids"], enc["attention_mask"]
            with torch.no_grad():
                target = full_hidden(root, ids, mask, root.l_low)
            m = mask.numpy().astype(bool)
            uniq, inv = unique_windows(causal_windows(ids.numpy(), mask.numpy()), mask.numpy())
            pred = window_states(root, torch.from_numpy(uniq), lower)[torch.from_numpy(inv[m])]
            step = fit.step_count
            loss = ((pred - target[torch.from_numpy(m)]) ** 2).mean()
            if cfg.weight_logits:
                loss = loss + cfg.weight_logits * logit_kl(root, pred, target, mask)
            fit.step(loss)
            if step % 10 == 0 or step == cfg.steps - 1:
                history.append([step, round(fit.last_loss, 5)])
            stop = not fit.done and limit is not None and limit.spent()
            if checkpoint is not None and (fit.step_count % CHECKPOINT_EVERY == 0 or stop):
                save()
            if stop:
                pace = spent() / fit.step_count
                raise CalibrationUnfinished(
                    f"{limit.minutes:g} minutes spent: decoder calibration stopped at step {fit.step_count} of "
                    f"{cfg.steps} ({pace:.1f} s a step, about {pace * (cfg.steps - fit.step_count) / 60:.0f} minutes "
                    f"left), its checkpoint in {checkpoint}")
    lower.eval().requires_grad_(False)
    return lower, {"history": history, "train_seconds": round(spent(), 1)}


def _resume(checkpoint: Path, recipe: dict, lower: torch.nn.ModuleList, fit: Fit) -> tuple[list, float]:
    """Loads ``checkpoint`` into ``lower`` and ``fit`` (with torch's random state: a decoder's
    dropout masks to come) when it holds ``recipe`` (configuration, split, decoder); returns (its
    loss history, its training seconds), ([], 0.0) otherwise."""
    if not checkpoint.exists():
        return [], 0.0
    ck = torch.load(checkpoint, weights_only=True)
    if not all(ck.get(k) == v for k, v in recipe.items()):
        return [], 0.0
    lower.load_state_dict(ck["lower"])
    fit.load_state_dict(ck)
    return ck["history"], ck["spent_seconds"]


def logit_kl(root: DecoderRoot, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens of KL(full model || windowed) of the next-token distributions, the
    upper layers run on the target states with the real tokens' ones replaced by ``pred``.
    Shapes: pred (N, H) for the N real tokens in row-major order; target (B, T, H); mask (B, T)."""
    m = mask.bool()
    h = target.clone()
    h[m] = pred
    with torch.no_grad():
        teacher = torch.log_softmax(upper_logits(root, target, mask)[m].float(), -1)
    student = torch.log_softmax(upper_logits(root, h, mask)[m].float(), -1)
    return torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")


def decoder_roots_dir(home: Path) -> Path:
    return Path(home) / "roots"


def save_decoder_artifact(root: DecoderRoot, lower: torch.nn.ModuleList, meta: dict, home: Path) -> str:
    """Writes the calibrated lower layers as an artifact (hmi.model.artifact's format) and marks
    them current; returns the root's name (the artifact folder is ``<name>-l<l_low>``)."""
    name_of = lambda digest: f"{root.name}-cal{digest[:12]}-l{root.l_low}"  # noqa: E731
    folder = write_artifact(decoder_roots_dir(home), name_of, lower.state_dict(), "lower.safetensors",
                            lambda f: {"name": f.rsplit("-l", 1)[0], "l_low": root.l_low, **meta}, "meta.json",
                            "current_decoder")
    return folder.rsplit("-l", 1)[0]


def load_calibrated_decoder(home: Path, root: DecoderRoot | None = None) -> DecoderRoot | None:
    """The current calibrated decoder root (on ``root``, the packaged decoder as loaded, when
    given), or None when there is none yet."""
    cur = decoder_roots_dir(home) / "current_decoder"
    if not cur.exists():
        return None
    return load_decoder_folder(decoder_roots_dir(home) / cur.read_text().strip(), root)


def load_decoder_folder(folder: Path, root: DecoderRoot | None = None) -> DecoderRoot:
    """The decoder root with the calibrated windows of artifact ``folder`` (on ``root`` when its
    split is the artifact's)."""
    meta = json.loads((folder / "meta.json").read_text())
    root = root if root is not None and root.l_low == meta["l_low"] else load_decoder(l_low=meta["l_low"])
    lower = copy.deepcopy(root.layers[:root.l_low])
    lower.load_state_dict(load_file(str(folder / "lower.safetensors")))
    root.windowed = lower.eval().requires_grad_(False)
    root.name = meta["name"]
    return root


def decoder_folders(home: Path, l_low: int) -> list[Path]:
    """The calibrated decoder artifacts of split ``l_low`` in ``home``, newest first."""
    found = [f for f in decoder_roots_dir(home).glob(f"*-l{l_low}") if (f / "meta.json").exists()]
    return sorted(found, key=lambda f: (f / "meta.json").stat().st_mtime, reverse=True)


def find_shipped_decoder(root: DecoderRoot, shipped: Path = SHIPPED_DIR) -> Path | None:
    """The calibrated windows shipped with the package for this decoder (by its fingerprint) and
    split, checked against their sha256; None when none fits."""
    fingerprint = weights_fingerprint(root.model)
    return shipped_folder(f"{root.name}-cal*-l{root.l_low}", "meta.json", "lower.safetensors",
                          lambda m: m.get("l_low") == root.l_low and m.get("root_fingerprint") == fingerprint, shipped)


def install_shipped_decoder(home: Path, root: DecoderRoot, shipped: Path = SHIPPED_DIR) -> str | None:
    """Installs the shipped calibrated windows that fit ``root`` as the current decoder artifact
    (``hmi calibrate --decoder`` with its defaults reproduces them, ``--check-shipped``); returns
    the decoder root's name, or None when none fits."""
    folder = find_shipped_decoder(root, shipped)
    if folder is None:
        return None
    return install_folder(folder, ("lower.safetensors", "meta.json"), decoder_roots_dir(home),
                          "current_decoder").rsplit("-l", 1)[0]


def finished_decoder_run(work: Path, cfg: DecoderCalibrationConfig, root: DecoderRoot,
                         home: Path) -> tuple[DecoderRoot, dict] | None:
    """The decoder root with the artifact a finished run of this recipe on this decoder wrote
    (``work``'s ``done`` file names its folder), made current, and what that run returned; None
    when there is none: no ``done`` file, the artifact gone, or another recipe or decoder."""
    try:
        folder = decoder_roots_dir(home) / (work / "done").read_text().strip()
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    recipe = {**asdict(DecoderCalibrationConfig()), **meta.get("config", {})}
    if recipe != asdict(cfg) or meta.get("root_fingerprint") != weights_fingerprint(root.model):
        return None
    root = load_decoder_folder(folder, root)
    point_at(folder.name, "current_decoder", home)
    return root, {k: v for k, v in meta.items() if k not in ("name", "l_low", "weights_sha256")}


def holds_decoder_recipe(folder: Path, cfg: DecoderCalibrationConfig) -> bool:
    """Whether work ``folder`` holds a stopped run of recipe ``cfg`` (its checkpoint's configuration)."""
    try:
        return torch.load(folder / "checkpoint.pt", weights_only=True, mmap=True)["config"] == asdict(cfg)
    except (OSError, RuntimeError, KeyError):
        return False


def calibrate_and_save(home: Path, l_low: int, cfg: DecoderCalibrationConfig, progress: bool = True,
                       max_minutes: float | None = None) -> tuple[DecoderRoot, dict]:
    """The whole ``hmi calibrate --decoder``: calibrate on the general corpus, measure, save.
    Resumes from (and, past ``max_minutes``, stops at) its checkpoint under ``HMI_HOME/calibration``;
    once finished, the same call returns its artifact at once (made current again)."""
    limit = TimeLimit(max_minutes)
    root = load_decoder(l_low=l_low)
    work = recipe_folder(Path(home) / "calibration", f"decoder-l{l_low}-seed{cfg.seed}", cfg,
                         DecoderCalibrationConfig(), lambda folder: holds_decoder_recipe(folder, cfg))
    if finished := finished_decoder_run(work, cfg, root, home):
        return finished
    texts = held_out_texts(cfg.eval_texts)
    with torch.no_grad():
        ppl_full = perplexity(root, texts, "full")
        ppl_naive = perplexity(root, texts, "windowed")
    work.mkdir(parents=True, exist_ok=True)
    lower, info = calibrate_decoder(root, load_corpus("general"), cfg, progress, work / "checkpoint.pt", limit)
    with torch.no_grad():
        ppl_cal = perplexity(root, texts, "windowed", lower=lower)
    quality = {"ppl_full": round(ppl_full, 3), "ppl_naive_window": round(ppl_naive, 3),
               "ppl_calibrated": round(ppl_cal, 3), "eval_texts": len(texts)}
    meta = {"config": asdict(cfg), "quality": quality, "root_fingerprint": weights_fingerprint(root.model), **info}
    root.name = save_decoder_artifact(root, lower, meta, home)
    root.windowed = lower
    atomic_write_text(work / "done", f"{root.name}-l{l_low}")
    (work / "checkpoint.pt").unlink(missing_ok=True)  # done: the artifact holds it
    return root, meta
