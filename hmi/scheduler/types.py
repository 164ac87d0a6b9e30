"""The plain data passed between the dispatcher and the scheduler."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from hmi.adapters.spec import AdapterSpec


class RequestError(Exception):
    """A request that cannot be served; it fails alone, the rest of its batch completes."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down and takes no more work."""


class QueueFullError(RuntimeError):
    """The scheduler's input queue is full; the caller should retry later."""


@dataclass(frozen=True)
class TenantEntry:
    """What serving needs to know of a tenant; ``ROOT`` (no spec: no adapter, no head) stands for
    the shared root itself, whose requests are embeddings."""

    name: str
    spec: AdapterSpec | None
    domain: str = "root"
    version: int = 0  # bumped on update, so stale device copies are replaced
    truncate: bool = False  # the tenant's choice for texts over the limit (a request may override it)
    weight: float = 1.0  # the tenant's share of the batches relative to others (hmi.dispatcher.batcher)


ROOT = TenantEntry("", None)


@dataclass
class InferRequest:
    """One text for one model: a tenant's hPLM (``tenant`` its name) or the shared root
    (``tenant`` None).  The answer is the tenant's head output, or with ``embed`` the sentence
    embedding of the upper layers' output (with the tenant's adapter; the root's pooling)."""

    tenant: str | None
    text: str
    future: Future = field(default_factory=Future)
    truncate: bool = False  # cut a text over the limit (answer marked "truncated") instead of refusing it
    embed: bool = False


@dataclass
class Prepared:
    """A batch after stage R: the valid requests and the upper layers' input."""

    batch_id: int
    requests: list[InferRequest]
    entries: list[TenantEntry]
    hidden: object  # torch.Tensor (B, T, H)
    mask: object  # torch.Tensor (B, T)
    word_starts: list[list[tuple[int, str]]]  # per request: (token position, word) of each word's first sub-token
    weights: dict  # tenant -> host weights
    truncated: list[bool] = field(default_factory=list)  # per request: its text was cut to the limit
