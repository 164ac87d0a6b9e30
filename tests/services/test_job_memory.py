"""Jobs within a memory budget: with room for one job's expected peak, a second job waits (its
record says why) and starts when the first ends; with room for both, they run together; a
class's expected peak is learned from the peaks of its jobs that ran here."""

import os
import time

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from hmi.services.jobs import JOB_PEAK_MB
from tests.helpers.servers import ADMIN, TRAIN, tiny_server


def two_jobs(tmp_path, budget_mb: float) -> tuple[dict, dict, list[str], dict]:
    """Two encoder fine-tunes submitted together to a server running two jobs at once within
    ``budget_mb``; (first job, second job, the second's waiting reasons seen, the peaks then
    expected of an encoder and of a domain job)."""
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path / "home", job_concurrency=2, job_memory_mb=budget_mb)
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    try:
        jobs = [admin.create_tenant(name, ["neg", "pos"], training_data={"train": TRAIN * 20}, epochs=2)["job"]
                for name in ("first", "second")]
        seen = []
        while any(admin.job(j)["state"] in ("queued", "running") for j in jobs):
            seen.append(admin.job(jobs[1]).get("waiting"))
            time.sleep(0.1)
        first, second = (admin.job(j) for j in jobs)
        expected = {kind: server.jobs.memory.expected_mb({"kind": kind}) for kind in ("create", "domain-create")}
    finally:
        stop()
    return first, second, [w for w in seen if w], expected


def test_a_job_that_does_not_fit_the_memory_budget_waits_saying_why_and_starts_when_the_running_one_ends(tmp_path):
    first, second, waiting, expected = two_jobs(tmp_path, budget_mb=1.5 * JOB_PEAK_MB["encoder"])
    assert first["state"] == second["state"] == "succeeded"
    assert waiting and waiting[0].startswith("memory:") and "encoder job" in waiting[0], waiting
    assert second["started"] >= first["finished"] - 0.5 and second.get("waiting") is None
    # What the jobs took at their peak is what the next job of the class is expected to take.
    peaks = [j["metrics"]["worker_memory_kib"]["VmHWM"] / 1024 for j in (first, second)]
    assert expected == {"create": max(peaks), "domain-create": JOB_PEAK_MB["domain"]}  # no domain job ran yet


def test_jobs_that_fit_the_memory_budget_together_run_together(tmp_path):
    first, second, waiting, _ = two_jobs(tmp_path, budget_mb=2.5 * JOB_PEAK_MB["encoder"])
    assert first["state"] == second["state"] == "succeeded" and not waiting
    assert second["started"] < first["finished"]
