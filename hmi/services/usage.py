"""Per-tenant usage as the console and the tenant listing show it."""

from __future__ import annotations


class Usage:
    """Counts each tenant's answered requests and their latency, and says where its adapter is
    now: ``device`` (a pool slot), ``host`` (the memory cache), ``disk``, or ``client`` (a private
    tenant's, on its own side)."""

    def __init__(self, residency, store, decoders):
        self.residency, self.store, self.decoders = residency, store, decoders
        self._counts: dict[str, tuple[int, float]] = {}  # tenant -> (requests answered, seconds summed)

    def record(self, tenant: str, requests: int, seconds: float) -> None:
        """Counts ``requests`` answered for ``tenant`` in ``seconds`` each."""
        n, total = self._counts.get(tenant, (0, 0.0))
        self._counts[tenant] = (n + requests, total + seconds * requests)

    def forget(self, tenant: str) -> None:
        self._counts.pop(tenant, None)

    def report(self, tenant: str, rec: dict) -> dict:
        """Requests answered since start, their mean latency, and the adapter's tier."""
        n, total = self._counts.get(tenant, (0, 0.0))
        if rec.get("model") == "private":
            return {"residency": "client", "requests": n, "latency_ms": None}
        if rec.get("model") == "decoder":
            on_device = self.decoders.on_device(tenant)
        else:
            on_device = self.residency.resident(tenant)
        tier = "device" if on_device else "host" if self.store.cached(tenant) else "disk"
        return {"residency": tier, "requests": n, "latency_ms": round(1000 * total / n, 2) if n else None}
