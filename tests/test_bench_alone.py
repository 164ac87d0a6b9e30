"""A benchmark page says what ran beside it (``benchmarks/common.beside_the_run``): other
processes' share of the machine's CPU time and the share other virtual machines took, so that a
timing measured on a busy machine is not read as one measured alone."""

import json
import os
import subprocess
import sys
import time

from benchmarks import common


def test_a_busy_neighbour_process_shows_on_the_page_and_in_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DOCS", tmp_path)
    monkeypatch.setattr(common, "_AT_START", (common.cpu_ticks(), common.own_cpu_seconds()))
    # one core of the machine's kept busy by another process for two seconds, while this one sleeps
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2: pass"])
    time.sleep(2.2)
    common.finish("trial", "a table", {"x": 1}, "python benchmarks/trial.py")
    busy.wait()
    page = (tmp_path / "trial.md").read_text()
    record = json.loads(page.split("```json\n")[1].split("\n```")[0])
    share = record["beside_the_run"]
    assert share["others"] >= 0.6 / os.cpu_count()  # about one core of the machine's (/proc/stat counts them all)
    assert f"other processes {share['others']:.0%} of the CPU time" in page
    assert 0 <= share["stolen"] <= 1


def test_a_page_written_again_from_its_record_keeps_the_machine_and_date_it_was_measured_on(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DOCS", tmp_path)
    common.finish("trial", "a table", {"x": 1, "beside_the_run": {"others": 0.0, "stolen": 0.0}}, "python trial.py")
    first = (tmp_path / "trial.md").read_text()
    page = first.replace(f"Machine: {common.machine()}", "Machine: 2 CPU cores (another machine)").replace(
        common.page_header(first)[1], "Date: 2026-01-01 00:00 UTC; commit 0000000")
    (tmp_path / "trial.md").write_text(page)
    common.finish("trial", "a table, rendered again", {"x": 1}, "python trial.py", common.page_header(page))
    again = (tmp_path / "trial.md").read_text()
    assert common.page_header(again) == ("2 CPU cores (another machine)", "Date: 2026-01-01 00:00 UTC; commit 0000000")
    assert "a table, rendered again" in again
