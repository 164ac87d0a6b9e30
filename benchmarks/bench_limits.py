"""What text limits cost.  (1) An over-long request before it is refused: 64 texts of 20,000
characters checked by the token lower bound (``hmi.textlimit.words_exceed``) against tokenizing
them all, as stage R did before (real MiniLM tokenizer, offsets on).  (2) The server's maximum
sequence length (``hmi serve --max-len``): requests per second of the scheduler on real BBC
articles cut to 128, 256 and 512 tokens (``truncate``), the three lengths alternating in rounds.

Usage: python benchmarks/bench_limits.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import adapter_variants, finish, prepared_root, start, table, timeit  # noqa: E402


def main() -> None:
    args = start(__doc__)
    from hmi.data import load_task
    from hmi.model.root import default_spec, load_tokenizer
    from hmi.textlimit import words_exceed

    tok = load_tokenizer(default_spec().model_dir)
    limit = 128 - 2  # the server's default max_len, less [CLS] and [SEP]
    prose = " ".join(r["text"] for r in load_task("news-topic", "train", 40))
    cases = {
        "prose (BBC news), 20,000 chars": [prose[i * 7:i * 7 + 20_000] for i in range(64)],
        "'word ' x 4,000": ["word " * 4000] * 64,
        "one 20,000-char word (fits)": ["x" * 20_000] * 64,
    }
    repeat = 3 if args.quick else 9

    def checked(texts):
        keep = [t for t in texts if not words_exceed(t, limit)]
        return tok(keep, truncation=False, return_offsets_mapping=True) if keep else None

    rows, result = [], {}
    for name, texts in cases.items():
        refused = sum(words_exceed(t, limit) for t in texts)
        new = timeit(lambda: checked(texts), repeat)
        old = timeit(lambda: tok(texts, truncation=False, return_offsets_mapping=True), repeat)
        rows.append((name, f"{refused}/64", f"{new * 1e3:.2f}", f"{old * 1e3:.1f}", f"{old / new:.0f}x"))
        result[name.split(" ")[0].strip("'")] = {"refused": refused, "check_ms": round(new * 1e3, 3),
                                                  "tokenize_all_ms": round(old * 1e3, 2)}
    text = table(rows, ("64 texts", "refused before tokenizing", "check (+ tokenize what fits) ms",
                        "tokenize all ms (before)", "ratio"))
    seq_rows, result["max_len"] = sequence_length_cost(args.quick)
    text += ("\n\nCost of the maximum sequence length: one tenant, batches of 32 real BBC test articles of at "
             "least 512 tokens, each cut to the limit (`truncate`); median requests/s over rounds in which the "
             "limits alternate:\n\n" + table(seq_rows, ("max_len", "requests / s", "ms / request", "cost vs 128")))
    finish("bench_limits", text, result, "python benchmarks/bench_limits.py")


def sequence_length_cost(quick: bool) -> tuple[list[tuple], dict]:
    import statistics
    import tempfile
    import time

    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore
    from hmi.data import load_task
    from hmi.plot.lookup import PlotLookup
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants, InferRequest, TenantEntry

    root, version = prepared_root()
    lookup = PlotLookup([version], policy="backoff")
    texts = [r["text"] for r in load_task("news-topic", "test")]
    texts = [t for t in texts if len(root.tokenizer(t)["input_ids"]) >= 512][:32]
    spec = AdapterSpec("bottleneck", labels=tuple("abcde"))
    entry = TenantEntry("t", spec)
    limits, rounds, n = (128, 256, 512), (2 if quick else 5), (2 if quick else 4)
    rps: dict[int, list[float]] = {m: [] for m in limits}
    with tempfile.TemporaryDirectory() as tmp:
        store = AdapterStore(Path(tmp))
        store.save("t", spec, adapter_variants(root.bert, root.spec.l_low, spec, 1)[0])
        scheds = {m: Scheduler(root.bert, root.spec.l_low, root.tokenizer, store, *[FixedTenants({entry.name: entry}, lookup)] * 2,
                               SchedulerConfig(max_len=m, device="cpu")) for m in limits}
        try:
            for r in range(rounds + 1):  # the first round warms up and is not counted
                for m in limits[r % 3:] + limits[:r % 3]:
                    reqs = [InferRequest("t", t, truncate=True) for _ in range(n) for t in texts]
                    t0 = time.perf_counter()
                    for i in range(0, len(reqs), 32):
                        scheds[m].submit(reqs[i:i + 32])
                    outs = [q.future.result(600) for q in reqs]
                    assert all(o.get("truncated") for o in outs)
                    if r:
                        rps[m].append(len(reqs) / (time.perf_counter() - t0))
        finally:
            for sc in scheds.values():
                sc.shutdown()
    med = {m: statistics.median(v) for m, v in rps.items()}
    rows = [(m, f"{med[m]:.1f}", f"{1e3 / med[m]:.1f}", f"{med[128] / med[m]:.2f}x") for m in limits]
    return rows, {str(m): {"rps": round(med[m], 2), "rounds": [round(x, 2) for x in rps[m]]} for m in limits}


if __name__ == "__main__":
    main()
