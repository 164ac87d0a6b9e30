"""A minute of the soak (benchmarks/soak.py --quick): the real server under the mixed workload
(Zipf inference over 20 tenants, streams some of which the client drops, a fine-tune job, a
domain job, tenant churn) answers without a server error, finishes its jobs, and stops cleanly on
SIGTERM; the samples it takes are there to be read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_minute_of_the_soak_ends_without_a_server_error_a_lost_job_or_an_unclean_stop(tmp_path, soak_home):
    from tests.helpers.shared import link_home

    home = link_home(soak_home, tmp_path / "home")  # prepared once per run
    env = {**os.environ, "HMI_HOME": str(home), "HMI_BENCH_DOCS": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick", "--minutes", "1", "--tenants", "20",
                           "--no-demo"],
                          env=env, capture_output=True, text=True, timeout=1500)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("{"), f"the soak ended without its result (exit code {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(last)
    assert proc.returncode == 0 and result["ok"], (result["failed"], proc.stderr[-3000:])
    assert result["counts"]["infer"] > 0 and result["counts"]["streams_dropped"] > 0 and not result["errors"]
    assert result["stop"] == {**result["stop"], "exit_code": 0, "children_left": 0}
    assert (tmp_path / "soak_quick.md").exists() and (tmp_path / "soak_quick.png").exists()
