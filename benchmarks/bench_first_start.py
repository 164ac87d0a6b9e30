"""The first start as a new user meets it: a fresh clone of this repository's last commit, pip's
cache unused (``PIP_NO_CACHE_DIR=1``: every package downloaded, from the registry or from a
wheel folder the machine's pip is configured with, ``PIP_FIND_LINKS``, which the record names), ``make
setup-serve`` (what ``make serve`` installs), then ``hmi serve`` on an empty ``HMI_HOME`` (as
``make serve`` runs it, on a free port), timed until its first demo answer
(``POST /v1/tenants/demo-news/infer`` answering 200).

Usage: python benchmarks/bench_first_start.py
Results: docs/results/bench_first_start_<avx2|avx512>.md, one page per CPU kind (``HMI_BENCH_DOCS`` elsewhere).  Run it alone: it measures
the machine's cores and its network.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_kind, finish, start, table  # noqa: E402
from hmi.dispatcher.gate import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "first-start-admin-token"


def call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def until(deadline: float, proc: subprocess.Popen, check) -> float:
    """Seconds since the epoch when ``check()`` first held; fails when the server exits or time runs out."""
    while time.time() < deadline:
        if check():
            return time.time()
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.2)
    raise SystemExit("the server did not answer in time")


def main() -> None:
    start(__doc__)
    work = Path(tempfile.mkdtemp(prefix="hmi-first-start-"))
    clone, home = work / "hmi", work / "home"
    # no pip cache; a wheel folder the machine's pip is configured with (PIP_FIND_LINKS) is kept and named
    # and Python writes the bytecode of what it imports, as it does for a user (no PYTHONDONTWRITEBYTECODE)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HMI_DATA_DIR", "HMI_HOME", "PYTHONDONTWRITEBYTECODE")}
    env.update(PIP_NO_CACHE_DIR="1", HMI_HOME=str(home), HMI_ADMIN_TOKEN=TOKEN, HF_HUB_OFFLINE="1")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    proc = None
    try:
        t0 = time.time()
        setup = subprocess.run(["make", "setup-serve"], cwd=clone, env=env, capture_output=True, text=True)
        if setup.returncode:
            raise SystemExit(f"make setup-serve failed:\n{setup.stdout[-2000:]}\n{setup.stderr[-2000:]}")
        t_setup = time.time()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(work / "server.log", "w")
        proc = subprocess.Popen([str(clone / ".venv" / "bin" / "hmi"), "serve", "--port", str(port)], cwd=clone,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 1800
        t_health = until(deadline, proc, lambda: call(url, "/healthz")[0] == 200)
        text = {"inputs": ["Shares rose after the bank beat forecasts."]}
        t_answer = until(deadline, proc, lambda: call(url, "/v1/tenants/demo-news/infer", text)[0] == 200)
        _, health = call(url, "/healthz")
        _, answer = call(url, "/v1/tenants/demo-news/infer", text)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    res = {"commit": commit, "pip_cache": "unused", "pip_find_links": os.environ.get("PIP_FIND_LINKS"), "setup_s": round(t_setup - t0, 1),
           "serve_to_healthz_s": round(t_health - t_setup, 1), "serve_to_first_answer_s": round(t_answer - t_setup, 1),
           "first_answer_s": round(t_answer - t0, 1), "preparing_at_first_answer": health.get("preparing"),
           "first_answer": answer.get("outputs", [None])[0]}
    rows = [("set-up: `make setup-serve` (venv, torch CPU, the package, the root package)",
             res["setup_s"], res["setup_s"]),
            ("`hmi serve` until `/healthz` answers (data fetched and prepared, the shipped root installed)",
             res["serve_to_healthz_s"], round(t_health - t0, 1)),
            ("until the first demo answer (`demo-news`)", round(t_answer - t_health, 1), res["first_answer_s"])]
    text = (f"A fresh clone of {commit}, pip's cache unused, an empty `HMI_HOME`.\n\n"
            + table(rows, ("stage", "seconds", "at")) + f"\n\nFirst demo answer after **{res['first_answer_s']} s**; "
            f"the server's preparation then: `{json.dumps(res['preparing_at_first_answer'])}`.")
    finish(f"bench_first_start_{cpu_kind()}", text, res, "python benchmarks/bench_first_start.py")


if __name__ == "__main__":
    main()
