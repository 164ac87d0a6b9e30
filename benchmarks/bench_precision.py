"""The shared upper layers served in fp32 and in bf16 (``hmi serve --upper-precision``), side by side.

Usage: python benchmarks/bench_precision.py [--quick]

The demo tenants' shipped adapters (trained on the default root and its root PLOT) answer their
task's whole test set through the scheduler, the serving path, once in each precision: accuracy,
how many answers keep their label, the largest difference of a score; then rows per second of
each, rounds interleaved on the same batches (32 texts of 64 and of 128 tokens, one tenant and
100 tenants drawn uniformly, LoRA rank 8 on q and v with a head, as ``bench_peers``).  bf16 runs
only where the CPU multiplies it natively (``hmi.model.kernels.NATIVE_BF16``); elsewhere the
script says so and measures nothing.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_tenants import scheduler_rps, trace, warm_page_cache  # noqa: E402
from benchmarks.common import adapter_variants, finish, prepared_root, start, table  # noqa: E402

PRECISIONS = ("fp32", "bf16")
DEMOS = ("demo-news", "demo-reviews")
B = 32


def scheduler(root, lookup, store, entries, precision: str):
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants

    return Scheduler(root.bert, root.spec.l_low, root.tokenizer, store, FixedTenants(entries), FixedTenants(entries, lookup),
                     SchedulerConfig(max_batch=B, pool_slots=128, device="cpu", upper_precision=precision))


def answers(root, lookup, store, entries, precision: str, name: str, texts: list[str]) -> list[dict]:
    """Tenant ``name``'s answers to ``texts`` (cut to the scheduler's token limit, as a tenant
    that truncates is served)."""
    from hmi.scheduler.types import InferRequest

    s = scheduler(root, lookup, store, entries, precision)
    try:
        reqs = [InferRequest(name, t, truncate=True) for t in texts]
        s.submit(reqs)
        return [r.future.result(600) for r in reqs]
    finally:
        s.shutdown()


def quality(root, lookup, store, entries, quick: bool) -> tuple[list[tuple], dict]:
    """Each demo tenant's test set answered in both precisions."""
    from hmi.adapters.shipped import read_shipped
    from hmi.data import load_task
    from hmi.scheduler.types import TenantEntry

    rows, result = [], {}
    for name in DEMOS:
        shipped = read_shipped(name)
        if shipped is None or shipped.meta.get("root_artifact") != root.artifact_id:
            raise SystemExit(f"{name}'s shipped adapter was not trained on {root.artifact_id}")
        store.save(name, shipped.spec, shipped.weights)
        entries[name] = TenantEntry(name, shipped.spec)
        task = shipped.meta["recipe"]["dataset"]
        test = load_task(task, "test")[:200 if quick else None]
        texts, gold = [r["text"] for r in test], [r["label"] for r in test]
        got = {p: answers(root, lookup, store, entries, p, name, texts) for p in PRECISIONS}
        acc = {p: sum(a["label"] == g for a, g in zip(got[p], gold)) / len(gold) for p in PRECISIONS}
        same = sum(a["label"] == b["label"] for a, b in zip(got["fp32"], got["bf16"]))
        diff = max(abs(a["scores"][k] - b["scores"][k]) for a, b in zip(got["fp32"], got["bf16"]) for k in a["scores"])
        result[name] = {"task": task, "texts": len(texts), "accuracy_fp32": round(acc["fp32"], 4),
                        "accuracy_bf16": round(acc["bf16"], 4), "same_label": same, "max_score_diff": round(diff, 5)}
        rows.append((name, task, len(texts), f"{100 * acc['fp32']:.2f}", f"{100 * acc['bf16']:.2f}",
                     f"{same} of {len(texts)}", f"{diff:.1e}"))
        print(rows[-1], flush=True)
    return rows, result


def speed(root, lookup, store, quick: bool) -> tuple[list[tuple], dict]:
    """Rows/s of each precision, rounds interleaved on the same batches."""
    from hmi.adapters.spec import AdapterSpec
    from hmi.data import load_task
    from hmi.scheduler.types import TenantEntry

    tok, counts = root.tokenizer, (1, 100)
    spec = AdapterSpec("lora", rank=8, alpha=8.0, labels=tuple("abcde"))
    variants = adapter_variants(root.bert, root.spec.l_low, spec, 32, seed=1)
    entries = {}
    for i in range(max(counts)):
        store.save(f"t{i:05d}", spec, variants[i % len(variants)])
        entries[f"t{i:05d}"] = TenantEntry(f"t{i:05d}", spec)
    raw = [r["text"] for r in load_task("news-topic", "test")]
    measured, warm, rounds = (3, 1, 1) if quick else (8, 2, 3)
    rows, result = [], {}
    for length in (64, 128):
        texts = [tok.decode(tok(t, truncation=True, max_length=length)["input_ids"][1:-1]) for t in raw]
        for n in counts:
            cell = {p: [] for p in PRECISIONS}
            for r in range(rounds):
                batches = trace(n, "uniform", warm + measured, seed=n + 7919 * r + length)
                for p in PRECISIONS:
                    s = scheduler(root, lookup, store, entries, p)
                    try:
                        cell[p].append(scheduler_rps(s, texts, batches, warm))
                    finally:
                        s.shutdown()
            med = {p: statistics.median(v) for p, v in cell.items()}
            result[f"rows_per_s_{length}_{n}"] = {p: round(v, 1) for p, v in med.items()}
            result[f"bf16_over_fp32_{length}_{n}"] = round(med["bf16"] / med["fp32"], 2)
            rows.append((length, n, f"{med['fp32']:.1f}", f"{med['bf16']:.1f}", f"{med['bf16'] / med['fp32']:.2f}"))
            print(rows[-1], flush=True)
    return rows, result


def main() -> None:
    args = start(__doc__)
    from hmi.adapters.store import AdapterStore
    from hmi.model.kernels import NATIVE_BF16
    from hmi.plot.lookup import PlotLookup
    from hmi.plot.paths import root_plot_path

    if not NATIVE_BF16:
        raise SystemExit("this CPU does not multiply bf16 natively (no avx512_bf16 or amx_bf16): "
                         "hmi serve refuses --upper-precision bf16 here, and there is nothing to compare")
    root, version = prepared_root()
    lookup = PlotLookup([version], policy="backoff")
    warm_page_cache(root_plot_path(root))
    store = AdapterStore(Path(tempfile.mkdtemp(prefix="hmi-bench-precision-")) / "adapters")
    q_rows, q_result = quality(root, lookup, store, {}, args.quick)
    s_rows, s_result = speed(root, lookup, store, args.quick)
    result = {"root_artifact": root.artifact_id, "quality": q_result, **s_result}
    text = "\n\n".join([
        "The demo tenants' shipped adapters on their task's test set, served through the scheduler in each "
        "precision of the shared upper layers (the PLOT, the adapters and the heads stay fp32):\n\n"
        + table(q_rows, ("tenant", "task", "texts", "accuracy fp32 %", "accuracy bf16 %", "same label",
                         "max |score diff|")),
        f"Rows per second through the scheduler, batches of {B} news texts, LoRA rank 8 on q and v with a head "
        "per tenant, tenants drawn uniformly; rounds interleaved, medians:\n\n"
        + table(s_rows, ("tokens", "tenants", "fp32 rows/s", "bf16 rows/s", "bf16 / fp32")),
    ])
    finish("bench_precision", text, result, "python benchmarks/bench_precision.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
