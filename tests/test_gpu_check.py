"""``make gpu-check`` on a machine without a GPU, as CI runs: it says so and exits 0 having run
nothing; the tests it runs on a GPU are collected here (and skipped)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_without_a_gpu_says_so_and_exits_cleanly_having_run_nothing(tmp_path):
    path = ":".join(p for p in os.environ["PATH"].split(":")
                    if not (Path(p) / "nvidia-smi").exists())  # this machine's view, whatever it has
    env = {**os.environ, "PATH": path, "GPU_CHECK_DOCS": str(tmp_path / "docs"), "GPU_CHECK_VENV": str(tmp_path / "venv")}
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "no GPU on this machine" in out.stdout and "nothing was run" in out.stdout
    assert not (tmp_path / "docs").exists() and not (tmp_path / "venv").exists()


def cuda_test_ids(session) -> list[str]:
    """The ids of the tests ``pytest -m cuda tests`` (what ``make gpu-check`` runs) selects: read
    from this run's own collection when it collected the whole tree (``make test``), else from
    that command run here."""
    from tests.conftest import DESELECTED

    collected = session.items + session.config.stash.get(DESELECTED, [])
    if {p.relative_to(REPO) for p in (REPO / "tests").rglob("test_*.py")} <= {i.path.relative_to(REPO) for i in collected}:
        return [i.nodeid for i in collected if i.get_closest_marker("cuda")]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                          "tests"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_gpu_checks_tests_are_collected_here_and_skipped_without_a_gpu(request):
    ids = cuda_test_ids(request.session)
    for part in ("test_batched.py", "test_pipeline.py", "test_generation.py", "test_residency_ordering.py",
                 "test_base_executor.py"):
        assert any(part in i for i in ids), part
    assert all("cuda" in i or "gpu" in i for i in ids)
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                              "tests/split/test_base_executor.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "skipped" in run.stdout and "passed" not in run.stdout, run.stdout[-2000:]
