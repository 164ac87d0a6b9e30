"""Prometheus metrics of the server (its own registry, so tests can run several servers)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MAX_TENANT_LABELS = 100


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hmi_http_requests_total", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("hmi_http_request_seconds", "HTTP latency", ["route"], registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.batch_size = Histogram("hmi_batch_size", "requests per closed batch", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64))
        self.queue_depth = Gauge("hmi_queue_depth", "batches waiting in the scheduler", registry=r)
        self.stage_seconds = Gauge("hmi_stage_seconds_total", "time spent per pipeline stage", ["stage"], registry=r)
        self.plot_hits = Gauge("hmi_plot_hits_total", "distinct windows served per PLOT level (level:version) for the "
                               "tenants of each domain", ["domain", "level"], registry=r)
        self.plot_kept = Gauge("hmi_plot_kept_entries", "windows the miss policy compute+insert keeps in each "
                               "domain's PLOT (its first version's)", ["domain"], registry=r)
        self.plot_keeper = Gauge("hmi_plot_keeper_windows_total", "windows of compute+insert by what became of them: "
                                 "queued to be kept, added to a PLOT, evicted past the budget, failed to be written",
                                 ["event"], registry=r)
        self.adapter_hits = Gauge("hmi_adapter_residency_total", "adapter lookups per tier", ["tier"], registry=r)
        self.host_cache = Gauge("hmi_adapter_host_cache_bytes", "adapter weights held in host memory (bounded by "
                                "ServerConfig.host_cache_mb)", registry=r)
        self.jobs = Gauge("hmi_jobs", "jobs by state", ["state"], registry=r)
        self.tenant_infer = Counter("hmi_tenant_infer_total", "infer inputs per tenant (first tenants only)",
                                    ["tenant"], registry=r)
        self._tenants: set[str] = set()

    def tenant_label(self, tenant: str) -> str:
        if tenant in self._tenants or len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        return "_other"

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The series the console charts (hmi/dispatcher/console/console.js, ``snapshot``).
CHARTED = ("hmi_http_requests_total", "hmi_http_request_seconds_bucket", "hmi_plot_hits_total",
           "hmi_adapter_residency_total")


class History:
    """The last ``span_s`` seconds of the series the console charts, one sample every
    ``interval_s`` (a ring buffer in memory: a restart starts it empty), so that a console opened
    now draws the last hour at once.  A sample: ``{"t": unix seconds, "metrics": [[name, labels,
    value], ...], "jobs": {"<kind> <tenant or domain>": progress of each running job}}``."""

    def __init__(self, interval_s: float = 10.0, span_s: float = 3600.0):
        if not interval_s > 0:
            raise ValueError(f"the history's interval must be above 0 s, got {interval_s:g}")
        self.interval_s = interval_s
        self.samples: deque[dict] = deque(maxlen=max(1, int(span_s / interval_s)))

    def record(self, metrics: Metrics, jobs: dict[str, float], t: float | None = None) -> None:
        charted = [[sample.name, dict(sample.labels), sample.value] for family in metrics.registry.collect()
                   for sample in family.samples if sample.name in CHARTED]
        self.samples.append({"t": time.time() if t is None else t, "metrics": charted, "jobs": dict(jobs)})

    def as_json(self) -> dict:
        return {"interval_s": self.interval_s, "samples": list(self.samples)}
