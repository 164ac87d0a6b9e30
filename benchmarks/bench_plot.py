"""PLOT lookup + merge against computing the lower layers it replaces (batch 32 x 128, real text).

Usage: python benchmarks/bench_plot.py [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, prepared_root, real_batch, start, table, timeit  # noqa: E402


def main() -> None:
    args = start(__doc__)
    from hmi.plot.build import Selection, build, count_ngrams, plan_keys
    from hmi.plot.keys import encoder_windows, unique_windows
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.paths import plot_meta
    from hmi.plot.store import PlotStore

    repeat = 2 if args.quick else 10
    root, version = prepared_root()
    ids, mask = real_batch(root.tokenizer)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    tokens = int(mask.sum())
    bert, enc = root.bert, root.windowed
    lookup = PlotLookup([version], policy="backoff")
    lookup_compute = PlotLookup([version], policy="compute")

    with torch.no_grad():
        def full_lower():
            h = bert.embeddings(input_ids=ids_t)
            ext = (1.0 - mask_t[:, None, None, :].float()) * torch.finfo(torch.float32).min
            for layer in bert.encoder.layer[: root.spec.l_low]:
                h = layer(h, ext)[0]
            return h

        t_full = timeit(full_lower, repeat)
        t_windowed = timeit(lambda: enc(ids_t, mask_t), repeat)
        t_lookup = timeit(lambda: lookup.merged(ids, mask), repeat)
        t_lookup_c = timeit(lambda: lookup_compute.merged(ids, mask), repeat)
        t_merge = timeit(lambda: enc.merge(lookup.represent(ids, mask).reps), repeat) - timeit(
            lambda: lookup.represent(ids, mask), repeat)

    uniq, _ = unique_windows(encoder_windows(ids, mask), mask)
    lookup.hits.clear()
    lookup.merged(ids, mask)
    hits = dict(lookup.hits)
    tri = sum(v for k, v in hits.items() if k.startswith("trigram"))

    # Exactness and build speed: a PLOT of exactly this batch's windows, then lookup vs compute.
    tmp = Path(tempfile.mkdtemp())
    try:
        store = PlotStore(tmp / "p", meta=plot_meta(root), readonly=False)
        keys, counts = count_ngrams([list(r) for r in ids])
        plan = plan_keys(keys, counts, Selection("all"), 0, with_backoff=False)
        t0 = time.perf_counter()
        build(store, enc, plan, progress=False)
        build_rate = len(plan) / (time.perf_counter() - t0)
        exact = PlotLookup([PlotVersion("batch", store, enc)], policy="backoff")
        with torch.no_grad():
            got = exact.merged(ids, mask)
            want = enc(ids_t, mask_t)
        max_err = float((got - want).abs().max())
        scale = float(want.abs().max())
        store.close()
    finally:
        shutil.rmtree(tmp)
    stats = version.store.stats()
    per_tok = lambda t: round(t / tokens * 1e6, 2)
    result = {
        "lookup_us_per_token": per_tok(t_lookup),
        "lookup_compute_on_miss_us_per_token": per_tok(t_lookup_c),
        "windowed_lower_us_per_token": per_tok(t_windowed),
        "full_lower_us_per_token": per_tok(t_full),
        "merge_us_per_token": per_tok(max(t_merge, 0.0)),
        "speedup_vs_full_lower": round(t_full / t_lookup, 2),
        "speedup_vs_windowed_lower": round(t_windowed / t_lookup, 2),
        "max_abs_err": round(max_err, 5),
        "output_abs_max": round(scale, 3),
        "bytes_per_entry": round(stats["file_bytes"] / max(1, stats["entries"]), 1),
        "value_bytes_per_entry": version.store.meta.value_bytes,
        "build_ngrams_per_s": round(build_rate, 1),
        "root_plot_entries": stats["entries"],
        "trigram_hit_rate": round(tri / len(uniq), 4),
        "batch": list(ids.shape),
    }
    rows = [
        ("full-context lower layers (reference)", result["full_lower_us_per_token"], "1.00"),
        ("windowed lower layers, computed", result["windowed_lower_us_per_token"], f"{t_full / t_windowed:.2f}"),
        ("PLOT lookup + merge (back-off on miss)", result["lookup_us_per_token"], f"{t_full / t_lookup:.2f}"),
        ("PLOT lookup + merge (compute on miss)", result["lookup_compute_on_miss_us_per_token"], f"{t_full / t_lookup_c:.2f}"),
    ]
    text = table(rows, ("lower side for a 32 x 128 batch of real text", "us / token", "speed-up vs full"))
    text += (f"\n\nRoot PLOT: {stats['entries']} entries ({stats['trigrams']} tri-grams, {stats['bigrams']} bi-grams, "
             f"{stats['unigrams']} uni-grams), {stats['file_bytes'] / 2**20:.0f} MiB on disk, "
             f"{result['bytes_per_entry']} bytes per entry ({result['value_bytes_per_entry']} of value).\n"
             f"Distinct windows in the batch: {len(uniq)}; served from tri-grams: {result['trigram_hit_rate']:.1%}; "
             f"levels: {hits}.\n"
             f"Exactness: lookup + merge vs windowed computation, max |diff| {max_err:.5f} "
             f"(outputs up to {scale:.2f}; fp16 storage).\nBuild rate: {build_rate:.0f} n-grams/s.")
    finish("bench_plot", text, result, "python benchmarks/bench_plot.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
