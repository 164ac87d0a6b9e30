"""Kill a process with SIGKILL just before its k-th write step, to test crash safety.

A write step is any call that changes the file system or makes a change durable: ``os.fsync``,
``os.replace``, ``os.rename``, ``os.mkdir``, ``os.rmdir``, ``os.unlink``.  A test runs the same
operation with k = 1, 2, ... until one completes; after each kill it reopens the store and checks
that it serves the old or the new version, never neither.

The operation runs in a driver process that imports what it needs once and forks a child per k
(``kill_each_step``): each child starts from the same imported state, as a fresh process would,
without paying for the imports again.  The driver runs with one OpenMP thread, so that no thread
pool exists across a fork.
"""

import os
import signal
import subprocess
import sys
import tempfile
import traceback
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


def kill_each_step(operation, most: int = 200) -> None:
    """In the driver: for k = 1, 2, ... forks a child that arms ``arm(k)`` and calls
    ``operation(counter)`` (which sets ``counter['on']`` where counting starts). After a child
    killed at its k-th step the driver prints ``KILLED k`` and waits for a line on stdin (the test
    checks the files and puts them back meanwhile); when one completes it prints ``COMPLETED n``
    (n kill points exercised) and returns."""
    for k in range(1, most):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                operation(arm(k))
            except BaseException:  # noqa: BLE001 - the driver reports it as a failed child
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            print(f"COMPLETED {k - 1}", flush=True)
            return
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            print(f"FAILED at k={k} with wait status {status}", flush=True)
            return
        print(f"KILLED {k}", flush=True)
        sys.stdin.readline()
    print(f"FAILED: the operation did not complete within {most} write steps", flush=True)


def run_until_complete(script: str, args: list[str], check) -> int:
    """Runs ``script`` (python code that calls ``kill_each_step``) in a driver process with
    ``args``; after every kill calls ``check(k)``. Returns how many kill points were exercised."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        line = ""
        try:
            for line in proc.stdout:
                if line.startswith("KILLED "):
                    check(int(line.split()[1]))
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                elif line.startswith("COMPLETED "):
                    assert proc.wait(60) == 0
                    return int(line.split()[1])
                elif line.startswith("FAILED"):
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        raise AssertionError(f"the driver ended without completing the operation: {line.strip()}\n{err.read()[-3000:]}")
