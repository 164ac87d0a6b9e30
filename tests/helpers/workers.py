"""Job workers for tests of the launcher itself (``hmi.services.jobs.ProcessLauncher``): targets
that go through the frame every worker runs in (``hmi.services.workers._run``) and report what
the worker process sees."""

import os

from hmi.services import workers


def environ_worker(ctx, job: dict, progress, cancel) -> None:
    """Reports the worker's value of the environment variable ``job["variable"]``."""
    workers._run(job, progress, cancel, lambda report: {"value": os.environ.get(job["variable"])})


def sum_worker(ctx, job: dict, progress, cancel) -> None:
    """Reports the sum of the tensors its context holds (a list of shared-memory tensors)."""
    workers._run(job, progress, cancel, lambda report: {"sum": float(sum(float(t.sum()) for t in ctx))})
