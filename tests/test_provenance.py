"""Which commit a benchmark's page names (``benchmarks.common.describe``): the code's, dirty only
when the code differs from it, not when the run has already written its own outputs."""

import subprocess

from benchmarks.common import OUTPUTS, describe


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True)


def test_a_page_names_its_commit_clean_when_only_benchmark_outputs_changed_and_dirty_when_code_did(tmp_path):
    (tmp_path / OUTPUTS).mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / OUTPUTS / "bench.png").write_bytes(b"before")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert describe(tmp_path) == head
    (tmp_path / OUTPUTS / "bench.png").write_bytes(b"after")  # the run's plot, written before its page
    (tmp_path / "untracked.txt").write_text("?")
    assert describe(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert describe(tmp_path) == head + "-dirty"


def test_a_tree_without_git_history_names_no_commit(tmp_path):
    assert describe(tmp_path) == ""
