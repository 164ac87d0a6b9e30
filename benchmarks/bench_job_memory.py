"""A domain job's memory over its distillation steps, with and without returning the freed heap.

Usage: python benchmarks/bench_job_memory.py [--quick] [--lines N] [--steps S]

Each configuration runs in a fresh process (RSS is per process), as a job worker does: the tuned
allocator (``hmi.allocator.tune_allocator``), then the real ``VersionTree.create`` of a branch of
the legal corpus (``--lines`` lines, ``--steps`` distillation steps, the default root) into a
temporary home sharing the prepared root PLOT. RSS is read at every progress report (every 5
steps, and through the branch PLOT's build) and sampled every 0.2 s for the peak:

- **kept**: nothing returned (the worker before ``hmi.services.workers.TRIM_EVERY_S``);
- **trimmed**: ``hmi.allocator.release_heap()`` at every report of the distillation (RSS read
  before and after it).

Prints the table of RSS against steps and writes docs/results/bench_job_memory.md (and a plot).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import DOCS, finish, prepared_root, start, table  # noqa: E402

CHILD = "--child"


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(lines_n: int, steps: int, trim: bool) -> None:
    """One configuration, in this process; prints its JSON record last."""
    from hmi.allocator import release_heap, tune_allocator

    tune_allocator()
    from hmi.bootstrap import quiet_transformers

    quiet_transformers()
    from hmi.data import load_corpus
    from hmi.model.artifact import load_root
    from hmi.plot.paths import open_root_version
    from hmi.training.further_pretrain import FPTConfig
    from hmi.version_tree.tree import VersionTree

    root = load_root()
    version = open_root_version(root)
    lines = load_corpus("legal", lines_n)
    peak = {"value": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak["value"] = max(peak["value"], rss_mb())
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    reports = []

    def on_progress(fraction: float, info: dict) -> None:
        stage = "distill" if info.get("stage") == "further pretraining" else "plot"
        before = rss_mb()
        if trim and stage == "distill":
            release_heap()
        reports.append({"stage": stage, "fraction": round(fraction, 3), "rss_mb": round(before, 1),
                        "after_trim_mb": round(rss_mb(), 1)})

    with tempfile.TemporaryDirectory(prefix="hmi-bench-job-memory-") as tmp:
        t0 = time.time()
        tree = VersionTree(root, Path(tmp), root_version=version)
        tree.create("legal", "root", lines, 0.5, FPTConfig(steps=steps), progress=False, on_progress=on_progress)
        seconds = time.time() - t0
    stop.set()
    print(json.dumps({"trim": trim, "lines": lines_n, "steps": steps, "peak_mb": round(peak["value"], 1),
                      "seconds": round(seconds, 1), "reports": reports}), flush=True)


def run(lines_n: int, steps: int, trim: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, CHILD, str(lines_n), str(steps), "1" if trim else "0"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        raise SystemExit(f"the {'trimmed' if trim else 'kept'} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(runs: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        d = [x for x in r["reports"] if x["stage"] == "distill"]
        ax.plot([x["fraction"] * r["steps"] for x in d], [x["rss_mb"] for x in d], marker="o", label=f"{name}: before a report")
        if r["trim"]:
            ax.plot([x["fraction"] * r["steps"] for x in d], [x["after_trim_mb"] for x in d], marker=".",
                    label=f"{name}: after the trim")
    ax.set_xlabel("distillation step")
    ax.set_ylabel("worker RSS (MB)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == CHILD:
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
        return

    def options(ap):
        ap.add_argument("--lines", type=int, help="lines of the legal corpus (default 2,000; 600 with --quick)")
        ap.add_argument("--steps", type=int, help="distillation steps (default 100; 20 with --quick)")

    args = start(__doc__, options)
    prepared_root()
    lines_n = args.lines or (600 if args.quick else 2000)
    steps = args.steps or (20 if args.quick else 100)
    runs = {"kept": run(lines_n, steps, False), "trimmed": run(lines_n, steps, True)}
    rows = []
    for name, r in runs.items():
        d = [x for x in r["reports"] if x["stage"] == "distill"]
        p = [x for x in r["reports"] if x["stage"] == "plot"]
        rows.append((name, r["peak_mb"], d[0]["rss_mb"] if d else "", d[-1]["rss_mb"] if d else "",
                     d[-1]["after_trim_mb"] if d and r["trim"] else "", p[-1]["rss_mb"] if p else "", r["seconds"]))
    text = table(rows, ("heap", "peak MB", "RSS at step 5", f"RSS at step {steps}", "after the last trim",
                        "RSS at the PLOT's end", "seconds"))
    text += (f"\n\nA domain branch of {lines_n} lines of the legal corpus, {steps} distillation steps (batches of 32 "
             "texts of up to 128 tokens), then its PLOT, on the default root; each in a fresh process with the tuned "
             "allocator, as a job worker runs. kept: the freed heap kept for the next steps; trimmed: returned to the "
             "kernel at every progress report (every 5 steps; a job worker does it every 30 s).\n\n![rss](bench_job_memory.png)")
    DOCS.mkdir(exist_ok=True)
    plot(runs, DOCS / "bench_job_memory.png")
    finish("bench_job_memory", text, runs, "python benchmarks/bench_job_memory.py" + (" --quick" if args.quick else "")
           + (f" --lines {args.lines}" if args.lines else "") + (f" --steps {args.steps}" if args.steps else ""))


if __name__ == "__main__":
    main()
