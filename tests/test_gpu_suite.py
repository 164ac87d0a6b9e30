"""benchmarks/gpu_suite.py, the GPU host's benchmarks in one run: a step past its share of the
minutes is stopped with its whole process group and the next still runs, a step without a JSON
result is a failure, and the headline figures are read from the steps' results."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_suite import Step, headline, run_step  # noqa: E402


def script(tmp_path: Path, name: str, body: str) -> Step:
    (tmp_path / name).write_text(body)
    return Step(name, str(tmp_path / name), (), (), 1.0)


def test_a_step_past_its_share_is_stopped_with_the_processes_it_started(tmp_path):
    (tmp_path / "child.py").write_text("import time\ntime.sleep(60)\n")
    step = script(tmp_path, "slow.py", "import subprocess, sys, time\n"
                  f"subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}])\n"
                  "print('started', flush=True); time.sleep(60)\n")
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        status, took, result = run_step(step, False, tmp_path, 3, log)
    assert status.startswith("stopped") and result is None and time.monotonic() - t0 < 30
    assert "started" in (tmp_path / "log").read_text()
    import subprocess
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "child.py")], capture_output=True, text=True).stdout
    assert not left.strip()


def test_a_step_reads_its_benchmarks_last_line_as_the_result_and_fails_without_one(tmp_path):
    ok = script(tmp_path, "ok.py", "import json, os\nprint('table')\nprint(json.dumps({'docs': os.environ['HMI_BENCH_DOCS']}))\n")
    bad = script(tmp_path, "bad.py", "print('no result')\n")
    crash = script(tmp_path, "crash.py", "raise SystemExit(3)\n")
    with open(tmp_path / "log", "w") as log:
        assert run_step(ok, False, tmp_path / "out", 60, log)[::2] == ("ok", {"docs": str(tmp_path / "out")})
        assert run_step(bad, False, tmp_path, 60, log)[0].startswith("failed (no JSON result")
        assert run_step(crash, False, tmp_path, 60, log)[0].startswith("failed (exit status 3")


def test_the_headline_figures_come_from_the_steps_results_and_are_none_where_a_step_did_not_finish():
    results = {"tenants": {"throughput": {"uniform": {"hBERT": {"100": {"rps": 90.0}}, "hBERT-adapter": {"100": {"rps": 45.0}}}}},
               "peers": {"hmi_over_peft_100": 2.6}, "pipeline": {"pipelined_over_sync_1k": 1.12},
               "overload": None, "private": {"batched_over_unbatched_32": 2.3}}
    h = headline(results, 100)
    assert h["gpu_hbert_over_adapter_100"] == 2.0 and h["gpu_hmi_over_peft_100"] == 2.6
    assert h["gpu_pipelined_over_sync"] == 1.12 and h["cores16_batched_over_unbatched_32"] == 2.3
    assert h["cores16_neighbour_p99_ratio"] is None and h["gpu_hgpt_tokens_per_s_100"] is None


def test_a_run_asked_for_no_time_or_an_unknown_step_is_refused_with_the_reason_and_runs_nothing(tmp_path):
    import subprocess

    suite = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"
    for extra, says in ((["--minutes", "0"], "--minutes must be above 0"), (["--client-cores", "0"], "--client-cores at least 1"),
                        (["--only", "tenants,nope"], "--only: steps among")):
        out = subprocess.run([sys.executable, str(suite), str(tmp_path / "out"), "--dry-run", *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and says in out.stderr, out.stderr
        assert not (tmp_path / "out" / "gpu_suite.log").exists()
