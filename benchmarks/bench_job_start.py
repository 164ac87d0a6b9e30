"""How long a tenant's fine-tune job takes from its request to its adapter, with workers forked
from the server's fork server (what ``hmi serve`` does, ``hmi.services.jobs.ProcessLauncher``) and
with workers spawned as new interpreters that import torch and transformers themselves, side by
side in one run.

Usage: python benchmarks/bench_job_start.py [--quick] [--jobs N]

Each way runs in a process of its own (a fork server is one per process, and the first job starts
it): a server on a temporary home sharing the prepared root (``bench_latency.bench_home``), then
``--jobs`` tenants created one after another (news topics, 40 texts, 1 epoch, as the soak's jobs),
each timed from its request until the client sees it succeeded (polled every 20 ms).  The two ways
alternate, twice each.

Results: docs/results/bench_job_start.md.  Run it alone: it measures the machine's cores.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_kind, finish, start, table  # noqa: E402

CHILD = "--child"
METHODS = ("forkserver", "spawn")


def child(method: str, jobs: int) -> None:
    """One way, in this process: prints the seconds of each job as its last line (JSON)."""
    import shutil

    from benchmarks.bench_latency import bench_home
    from hmi.client import Client
    from hmi.data import load_task
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.services.jobs import ProcessLauncher
    from hmi.services.server import ServerConfig

    home, token, root, _ = bench_home("hmi-bench-job-start-", 0)
    rows = load_task("news-topic", "train")[:40]
    labels = sorted({r["label"] for r in rows})
    server = build_server(ServerConfig(), home=home, root=root, job_launcher=ProcessLauncher(method))
    url, stop = run_in_thread(server)
    seconds = []
    try:
        client = Client(url, token)
        for i in range(jobs):
            t = time.perf_counter()
            out = client.create_tenant(f"job-start-{i}", labels, training_data={"train": rows}, epochs=1,
                                        truncate=True)
            done = client.wait_job(out["job"], timeout=900, poll=0.02)
            if done["state"] != "succeeded":
                raise SystemExit(f"job {i} ({method}) ended {done['state']}: {done.get('error')}")
            seconds.append(time.perf_counter() - t)
    finally:
        stop()
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"method": method, "seconds": [round(s, 3) for s in seconds]}), flush=True)


def run(method: str, jobs: int) -> list[float]:
    out = subprocess.run([sys.executable, __file__, CHILD, method, str(jobs)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise SystemExit(f"the {method} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == CHILD:
        child(sys.argv[2], int(sys.argv[3]))
        return
    args = start(__doc__, lambda ap: ap.add_argument("--jobs", type=int, help="jobs per run (default 6; --quick 3)"))
    jobs = args.jobs or (3 if args.quick else 6)
    runs = {m: [] for m in METHODS}
    for _ in range(2):
        for method in METHODS:
            runs[method].append(run(method, jobs))
    per = {}
    for method, rs in runs.items():
        first = [r[0] for r in rs]
        later = [s for r in rs for s in r[1:]]
        per[method] = {"first_job_s": round(statistics.median(first), 2),
                       "later_job_median_s": round(statistics.median(later), 2) if later else None, "runs": rs}
    later_ratio = (per["spawn"]["later_job_median_s"] / per["forkserver"]["later_job_median_s"]
                   if jobs > 1 else None)
    rows = [(m, f"{p['first_job_s']:.2f}", "-" if p["later_job_median_s"] is None else f"{p['later_job_median_s']:.2f}")
            for m, p in per.items()]
    text = (f"A tenant's fine-tune job (news topics, 40 texts, 1 epoch) from its request to its adapter, "
            f"{jobs} jobs one after another per server, two servers per way (CPU: {cpu_kind()}):\n\n"
            + table(rows, ("workers", "first job (s)", "each later job, median (s)"))
            + ("" if later_ratio is None else
               f"\n\nA later job takes {later_ratio:.1f}x as long with spawned workers as with forked ones."))
    result = {"jobs": jobs, "cpu": cpu_kind(), "per_method": per,
              "spawn_over_forkserver_later_job": None if later_ratio is None else round(later_ratio, 2)}
    cmd = "python benchmarks/bench_job_start.py" + (" --quick" if args.quick else "") + \
        (f" --jobs {args.jobs}" if args.jobs else "")
    finish("bench_job_start", text, result, cmd)


if __name__ == "__main__":
    main()
