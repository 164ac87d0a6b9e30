"""Kill a process with SIGKILL just before its k-th write step, to test crash safety.

A write step is any call that changes the file system or makes a change durable: ``os.fsync``,
``os.replace``, ``os.rename``, ``os.mkdir``, ``os.rmdir``, ``os.unlink``.  A test runs the same
operation in child processes with k = 1, 2, ... until one completes; after each kill it reopens
the store and checks that it serves the old or the new version, never neither.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

STEPS = ("fsync", "replace", "rename", "mkdir", "rmdir", "unlink")
REPO = Path(__file__).resolve().parents[2]


def arm(k: int) -> dict:
    """In the child: SIGKILL before the k-th write step once ``counter['on']`` is set."""
    counter = {"n": 0, "on": False}
    for name in STEPS:
        real = getattr(os, name)

        def step(*a, _real=real, **kw):
            if counter["on"]:
                counter["n"] += 1
                if counter["n"] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            return _real(*a, **kw)

        setattr(os, name, step)
    return counter


def run_until_complete(script: str, args: list[str], check, most: int = 200) -> int:
    """Runs ``script`` (python code reading k from argv[1]) with k = 1, 2, ... ; after every kill
    calls ``check(k)``. Returns how many kill points were exercised."""
    for k in range(1, most):
        proc = subprocess.run([sys.executable, "-c", script, str(k), *args], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode == 0:
            assert "COMPLETED" in proc.stdout, proc.stdout + proc.stderr
            return k - 1
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        check(k)
    raise AssertionError(f"the operation did not complete within {most} write steps")
