"""Property-based fuzzing of a live server from its OpenAPI document (schemathesis, every check).

It runs for HMI_FUZZ_SECONDS seconds when that is set (`make test` sets 60; `make fuzz` runs 120 by default) and is skipped
otherwise, so that a plain `pytest` stays quick; `make fuzz` runs the same script on its own.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run.sh")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HMI_FUZZ_SECONDS"), reason="set HMI_FUZZ_SECONDS to fuzz the live server")
def test_fuzzing_the_live_server_finds_no_failure_and_no_unhandled_error():
    run = subprocess.run(
        ["bash", str(SCRIPT), os.environ["HMI_FUZZ_SECONDS"]],
        env={**os.environ, "PY": sys.executable},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"schemathesis or the server reported a failure:\n{run.stdout[-8000:]}\n{run.stderr[-4000:]}"
