"""The one training loop: calibration (encoder and decoder roots), further pretraining of domains,
tenant fine-tuning (encoder and decoder) and the benchmarks' full fine-tune all step through it.

A :class:`Fit` owns what every loop shares: AdamW over the trained parameters (an optional
learning-rate schedule and gradient clipping), the step count against a total, a progress bar,
progress callbacks and cancellation (``should_stop()`` true -> :class:`Cancelled` before the next
step).  What differs between loops (how a batch is drawn, what the loss is, checkpoints) stays
with the caller; :func:`early_stopping` runs epochs and keeps the best one's state.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.utils.deterministic
from tqdm import tqdm


@contextmanager
def deterministic():
    """Training that repeats bit for bit on one machine (same CPU kind, torch build and thread
    count): torch's kernels that accumulate in arrival order (the backward of index gathers,
    ``index_put_`` with accumulate) take their ordered variants inside the block.

    Deterministic mode also fills every new tensor's memory with NaN by default
    (``torch.utils.deterministic.fill_uninitialized_memory``), a safeguard against kernels that
    read memory they did not write; without it a 12-layer calibration step takes 0.91 of the
    time (``benchmarks/bench_calibration_step.py``). It is off inside the block: the kernels
    write what they return, so the results are the same bits (the shipped root artifact is
    reproduced, ``hmi calibrate --check-shipped``)."""
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


class Cancelled(RuntimeError):
    """A training run was asked to stop (its job was cancelled)."""


class Fit:
    """Optimizer steps with their bookkeeping; ``with Fit(...) as fit:`` closes the bar."""

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict], total: int, *, lr: float,
                 weight_decay: float = 0.0,
                 clip: float | None = None, schedule: Callable[[int], float] | None = None, desc: str = "train",
                 progress: bool = True, should_stop: Callable[[], bool] | None = None,
                 on_progress: Callable[[float, dict], None] | None = None, report_every: int = 1, start: int = 0):
        groups = list(params)  # tensors, or torch's parameter groups (dicts with a "params" list and options)
        self.params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        self.total, self.step_count, self.clip = total, start, clip
        self.opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule) if schedule is not None else None
        self.should_stop, self.on_progress, self.report_every = should_stop, on_progress, report_every
        self.bar = tqdm(total=total, initial=start, desc=desc, unit="step", disable=not progress)
        self.last_loss: float | None = None

    @property
    def done(self) -> bool:
        return self.step_count >= self.total

    def check(self) -> None:
        """Raises :class:`Cancelled` when the run was asked to stop."""
        if self.should_stop is not None and self.should_stop():
            self.close()
            raise Cancelled("cancelled")

    def step(self, loss: torch.Tensor, info: dict | None = None, **postfix) -> None:
        """One optimizer step on ``loss`` (backward, clipping, AdamW, schedule), then the bar and,
        every ``report_every`` steps and at the last, ``on_progress(fraction done, {**info, "loss": ...})``."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.step_count += 1
        self.last_loss = loss.item()
        self.bar.update(1)
        self.bar.set_postfix(**postfix, loss=f"{self.last_loss:.4f}")
        if self.on_progress is not None and (self.step_count % self.report_every == 0 or self.done):
            self.on_progress(self.step_count / max(1, self.total), {**(info or {}), "loss": round(self.last_loss, 4)})

    def state_dict(self) -> dict:
        """What a checkpoint needs to go on as an uninterrupted run would: the optimizer, the
        schedule, the step count and torch's random state (the dropout masks still to be drawn)."""
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict() if self.sched else None,
                "step": self.step_count, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if self.sched is not None and state.get("scheduler") is not None:
            self.sched.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
        if "rng" in state:  # checkpoints written before the random state was kept have none
            torch.set_rng_state(state["rng"])
        self.bar.reset(total=self.total)
        self.bar.update(self.step_count)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Fit":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def head_groups(body: list[torch.nn.Parameter], head: list[torch.nn.Parameter],
                head_lr: float | None) -> list[torch.nn.Parameter] | list[dict]:
    """What :class:`Fit` trains when a classification or tagging head learns at a rate of its own
    (``head_lr``; None: the body's rate, one group): the body's parameters (adapters, or all of a
    model's) in one group at the fit's rate, the head's in another at ``head_lr``."""
    if head_lr is None:
        return body + head
    return [{"params": body}, {"params": head, "lr": head_lr}]


def early_stopping(epochs: int, patience: int, run_epoch: Callable[[int], dict], score: Callable[[dict], float],
                   snapshot: Callable[[], dict], best: float = float("-inf"), best_state: dict | None = None
                   ) -> tuple[float, dict | None, list[dict]]:
    """Runs up to ``epochs`` epochs (``run_epoch(epoch)`` -> that epoch's record, ``{"stop": True}``
    in it ends the run after the epoch); after each, ``score(record)`` is compared with the best so
    far (higher is better): a better epoch's ``snapshot()`` is kept, ``patience`` epochs without
    one end the run.  Returns (best score, best state, the records)."""
    history, bad = [], 0
    for epoch in range(epochs):
        record = run_epoch(epoch)
        stop = record.pop("stop", False)
        history.append(record)
        s = score(record)
        if s > best:
            best, best_state, bad = s, snapshot(), 0
        else:
            bad += 1
            if bad >= patience:
                break
        if stop:
            break
    return best, best_state, history
