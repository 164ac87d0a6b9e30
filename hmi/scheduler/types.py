"""The plain data passed between the dispatcher and the scheduler."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from hmi.adapters.spec import AdapterSpec
from hmi.errors import Kind, Refusal


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
    weight: float = 1.0  # the tenant's share of the batches relative to others (hmi.scheduler.batcher)

    @property
    def whole(self) -> bool:
        """Whether the tenant is served on the full root (its spec is ``whole``): its rows read the
        root's embeddings, not the PLOT, and run every layer."""
        return self.spec is not None and self.spec.whole


ROOT = TenantEntry("", None)


class TenantView(Protocol):
    """The scheduler's view of the tenants it serves (``hmi.services.tenants.ServedTenants``)."""

    def entry(self, tenant: str) -> TenantEntry:
        """The tenant's entry as served now; a ``hmi.errors.Refusal`` when it is not served (the
        request fails alone, the rest of its batch completes)."""

    def weight(self, tenant: str) -> float:
        """The tenant's share of the batches relative to the others' (1 unless the admin set it)."""


class LookupSource(Protocol):
    """Where the scheduler finds each domain's PLOT lookup (``hmi.services.domains.Domains``)."""

    def lookup_for(self, domain: str):
        """The ``hmi.plot.lookup.PlotLookup`` of ``domain``'s chain (branch -> parent -> root)."""


@dataclass
class FixedTenants:
    """A fixed set of tenants served through one PLOT lookup, or a domain's tenants through the
    lookup of that domain's chain where ``domains`` has one: a ``TenantView`` and a ``LookupSource``
    for a scheduler outside a server (benchmarks, tests)."""

    entries: dict[str, TenantEntry]
    lookup: object = None
    domains: dict = field(default_factory=dict)  # domain -> the lookup of its chain (branch -> ... -> root)

    def entry(self, tenant: str) -> TenantEntry:
        e = self.entries.get(tenant)
        if e is None:
            raise Refusal(Kind.NOT_FOUND, "unknown_tenant", f"unknown tenant {tenant!r}")
        return e

    def weight(self, tenant: str) -> float:
        e = self.entries.get(tenant)
        return e.weight if e is not None else 1.0

    def lookup_for(self, domain: str):
        return self.domains.get(domain, self.lookup)


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


def fail(req: InferRequest, exc: BaseException) -> None:
    """Fails one request alone (its future gets ``exc``), unless it has its answer already."""
    if not req.future.done():
        req.future.set_exception(exc)


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
