"""Batches of long and short texts: one pass padded to the longest against groups of similar length.

Usage: python benchmarks/bench_lengths.py [--quick]

A server for many tenants mixes tasks in one batch: news articles cut at 128 tokens beside
review sentences of 10 to 40. Padded to its longest, such a batch computes about twice the token
rows it holds. The scheduler runs it as groups of similar length when that computes fewer token
rows, counting each further pass as ``PASS_OVERHEAD_TOKENS`` (``hmi.scheduler.compute.
split_by_length``). Measured here, side by side through the scheduler (PLOT lookup, 100 tenants
with bottleneck adapters, batches of 32, rounds interleaved, medians):

- rows per second with length groups and with one padded pass, for news alone (long, little
  padding), reviews alone (short, varied) and the two mixed half and half;
- the token rows each computes per batch (from the texts' token counts);
- what one more pass costs: the upper layers' and heads' seconds against the token rows of a
  pass, fitted as ``a + b x rows``; ``a / b`` is the overhead in token rows.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_tenants import scheduler_rps, trace, warm_page_cache  # noqa: E402
from benchmarks.common import adapter_variants, cut_texts, finish, prepared_root, round_robin, start, table  # noqa: E402

B, TENANTS, LABELS = 32, 100, tuple("abcde")
SHAPES = ((1, 16), (4, 16), (8, 32), (16, 32), (32, 32), (16, 64), (32, 64), (32, 128))


def pass_cost(bert, l_low: int, spec, variants: list[dict], rounds: int) -> dict:
    """Seconds of the upper layers and heads for passes of ``SHAPES`` (rows, tokens), 32 distinct
    tenants' bottlenecks, and the least-squares fit ``seconds = a + b x token rows``."""
    from hmi.adapters.batched import Group, batched_heads, segment_plan, upper_forward
    from hmi.adapters.pool import SlotPool

    H = bert.config.hidden_size
    pool = SlotPool(spec.signature(H), B, bert.config.num_hidden_layers - l_low, H, bert.config.intermediate_size,
                    max_labels=len(LABELS), scaling=spec.scaling)
    for i in range(B):
        pool.write(i, variants[i])
    layers = torch.nn.ModuleList(bert.encoder.layer[l_low:])
    g = torch.Generator().manual_seed(0)
    fns = {}
    for n, t in SHAPES:
        hidden, mask = torch.randn(n, t, H, generator=g), torch.ones(n, t, dtype=torch.long)
        group = Group(torch.arange(n), torch.arange(n), pool, all_rows=True, plan=segment_plan(list(range(n))))
        flags = torch.zeros(n, dtype=torch.bool)

        def run(hidden=hidden, mask=mask, group=group, flags=flags):
            with torch.no_grad():
                out = upper_forward(layers, hidden, mask, [group])
                return batched_heads(out, [group], flags, mask, ~flags)

        fns[(n, t)] = run
    med = round_robin(fns, rounds, warmup=2)
    rows = np.array([n * t for n, t in SHAPES], dtype=float)
    secs = np.array([med[s] for s in SHAPES])
    b, a = (float(c) for c in np.polyfit(rows, secs, 1))
    return {"ms": {f"{n}x{t}": round(med[(n, t)] * 1e3, 2) for n, t in SHAPES}, "a_ms": round(a * 1e3, 2),
            "b_us_per_token_row": round(b * 1e6, 2), "overhead_token_rows": round(a / b)}


def main() -> None:
    args = start(__doc__)
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore
    from hmi.data import load_task
    from hmi.plot.lookup import PlotLookup
    from hmi.plot.paths import root_plot_path
    from hmi.scheduler.compute import PASS_OVERHEAD_TOKENS, split_by_length
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants, TenantEntry

    root, version = prepared_root()
    tok, bert, l_low = root.tokenizer, root.bert, root.spec.l_low
    spec = AdapterSpec("bottleneck", labels=LABELS, pooling="mean")
    variants = adapter_variants(bert, l_low, spec, B, seed=1)
    lookup = PlotLookup([version], policy="backoff")
    warm_page_cache(root_plot_path(root))
    store = AdapterStore(Path(tempfile.mkdtemp(prefix="hmi-bench-lengths-")) / "adapters")
    for i in range(TENANTS):
        store.save(f"t{i:05d}", spec, variants[i % B])
    entries = {f"t{i:05d}": TenantEntry(f"t{i:05d}", spec) for i in range(TENANTS)}
    news, reviews = (cut_texts(tok, [r["text"] for r in load_task(task, "test")], 128)
                     for task in ("news-topic", "review-sentiment"))
    mixed = [t for pair in zip(news, reviews) for t in pair]
    workloads = {"news (long)": news, "reviews (short)": reviews, "news and reviews, half and half": mixed}
    measured, warm, rounds = (4, 1, 1) if args.quick else (12, 2, 5)

    rows, result = [], {"pass_overhead_tokens": PASS_OVERHEAD_TOKENS}
    for name, texts in workloads.items():
        lengths = [len(ids) for ids in tok(texts)["input_ids"]]
        batches = trace(TENANTS, "uniform", warm + measured, seed=7)
        padded = grouped = 0
        for bi in range(len(batches)):
            ls = [lengths[(bi * B + j) % len(texts)] for j in range(B)]
            padded += B * max(ls)
            grouped += sum(len(g) * max(ls[r] for r in g) for g in split_by_length(list(range(B)), ls, PASS_OVERHEAD_TOKENS))
        cell = {"groups": [], "padded": []}
        for _ in range(rounds):
            for key, on in (("groups", True), ("padded", False)):
                s = Scheduler(bert, l_low, tok, store, FixedTenants(entries), FixedTenants(entries, lookup),
                              SchedulerConfig(max_batch=B, pool_slots=64, length_groups=on))
                try:
                    cell[key].append(scheduler_rps(s, texts, batches, warm))
                finally:
                    s.shutdown()
        med = {k: statistics.median(v) for k, v in cell.items()}
        result[name] = {"rows_per_s": {k: round(v, 1) for k, v in med.items()}, "groups_over_padded": round(
            med["groups"] / med["padded"], 2), "token_rows_per_batch": {"groups": round(grouped / len(batches)),
                                                                        "padded": round(padded / len(batches))}}
        rows.append((name, f"{statistics.mean(lengths):.0f}", f"{padded / len(batches):.0f}", f"{grouped / len(batches):.0f}",
                     f"{med['padded']:.1f}", f"{med['groups']:.1f}", f"{med['groups'] / med['padded']:.2f}"))
        print(rows[-1], flush=True)
    t0 = time.perf_counter()
    cost = pass_cost(bert, l_low, spec, variants, 3 if args.quick else 9)
    result["pass_cost"] = cost
    print(cost, f"({time.perf_counter() - t0:.0f} s)", flush=True)
    text = table(rows, ("texts", "mean tokens", "token rows per batch, one padded pass", "token rows per batch, length groups",
                        "rows/s, one padded pass", "rows/s, length groups", "groups / padded"))
    text += (f"\n\nBatches of {B} requests from {TENANTS} tenants drawn uniformly (bottleneck adapters, heads on the token "
             f"mean), texts of the tasks' test sets cut at 128 tokens, through the scheduler with its PLOT lookup; "
             f"{rounds} rounds that run both sides in turn on the same trace, medians; a further pass counted as "
             f"{PASS_OVERHEAD_TOKENS} token rows (`PASS_OVERHEAD_TOKENS`).\n\n"
             "What one pass through the upper layers and heads costs (32 distinct tenants' bottlenecks, median of "
             "rounds):\n\n"
             + table([(f"{n} x {t}", n * t, cost["ms"][f"{n}x{t}"]) for n, t in SHAPES], ("rows x tokens", "token rows", "ms"))
             + f"\n\nFitted: {cost['a_ms']} ms a pass + {cost['b_us_per_token_row']} us a token row; a pass costs as much "
             f"as {cost['overhead_token_rows']} token rows.")
    finish("bench_lengths", text, result, "python benchmarks/bench_lengths.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
