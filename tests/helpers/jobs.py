"""Waiting for a job to reach a state through the HTTP API."""

import time


def wait_state(client, job, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = client.job(job)
        if got["state"] in states and (got["state"] != "running" or got.get("progress", 0) > 0):
            return got
        time.sleep(0.2)
    raise AssertionError(f"job {job} never reached {states}: {got}")
