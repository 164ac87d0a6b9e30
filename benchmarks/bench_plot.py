"""PLOT lookup + merge against computing the lower layers it replaces (batch 32 x 128, real text),
where the lookup's time goes, and the hot tier (``hmi.plot.hot``) in front of LMDB at several
budgets: the tier's entries are the root PLOT's keys most read by the general corpus's first
lines (not the measured texts), so its hit rate is what a server would see on the tasks' texts.

Usage: python benchmarks/bench_plot.py [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, prepared_root, real_batch, round_robin, start, table  # noqa: E402
from benchmarks.common import timeit as timed  # noqa: E402


def main() -> None:
    args = start(__doc__)
    from hmi.plot.build import Selection, build, count_ngrams, plan_keys
    from hmi.plot.keys import encoder_windows, unique_windows
    from hmi.plot.learned import fingerprint as learned_fingerprint
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.paths import plot_meta
    from hmi.plot.store import PlotStore

    repeat = 2 if args.quick else 10
    # Each path warmed up three times: a lookup's first two calls (first-touch memory of the
    # merge, the PLOT's pages) take 3 to 7 times a warm one; one warm-up left --quick's figures
    # at a quarter of the steady speed.
    timeit = partial(timed, warmup=3)
    root, version = prepared_root()
    ids, mask = real_batch(root.tokenizer)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    tokens = int(mask.sum())
    bert, enc = root.bert, root.windowed
    lookup = PlotLookup([version], policy="backoff")
    lookup_compute = PlotLookup([version], policy="compute")
    # the learned back-off where the root PLOT has one (`hmi plot learn-backoff`)
    lookup_learned = PlotLookup([version], policy="learned") if learned_fingerprint(version.store.path) else None

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
        t_lookup_l = timeit(lambda: lookup_learned.merged(ids, mask), repeat) if lookup_learned else None
        # how close each lower side comes to the windowed lower layers computed on every window
        computed, real = enc(ids_t, mask_t), mask_t.bool()
        fidelity = {name: float(torch.nn.functional.cosine_similarity(lk.merged(ids, mask)[real], computed[real], dim=-1).mean())
                    for name, lk in (("backoff", lookup), ("learned", lookup_learned)) if lk is not None}
        t_merge = timeit(lambda: enc.merge(lookup.represent(ids, mask).reps), repeat) - timeit(
            lambda: lookup.represent(ids, mask), repeat)

    # Where the lookup's time goes: windows, PLOT reads (LMDB and decoding), merge.
    with torch.no_grad():
        t_windows = timeit(lambda: unique_windows(encoder_windows(ids, mask), mask), repeat)
        uniq, inverse = unique_windows(encoder_windows(ids, mask), mask)
        t_reads = timeit(lambda: lookup.window_reps(uniq), repeat)
        reps_u = torch.from_numpy(lookup.window_reps(uniq)[0])
        t_merge_u = timeit(lambda: enc.merge.forward_unique(reps_u, torch.from_numpy(inverse)), repeat)
    hot_rows, hot_result = hot_tier(root, version, ids, mask, tokens, t_full, repeat, args.quick)

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
        **({"lookup_learned_backoff_us_per_token": per_tok(t_lookup_l),
            "learned_backoff": learned_fingerprint(version.store.path)} if t_lookup_l else {}),
        **{f"merged_cosine_to_computed_{k}": round(v, 4) for k, v in fidelity.items()},
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
        "windows_us_per_token": per_tok(t_windows),
        "plot_reads_us_per_token": per_tok(t_reads),
        "merge_unique_us_per_token": per_tok(t_merge_u),
        **hot_result,
    }
    rows = [
        ("full-context lower layers (reference)", result["full_lower_us_per_token"], "1.00"),
        ("windowed lower layers, computed", result["windowed_lower_us_per_token"], f"{t_full / t_windowed:.2f}"),
        ("PLOT lookup + merge (back-off on miss)", result["lookup_us_per_token"], f"{t_full / t_lookup:.2f}"),
        ("PLOT lookup + merge (compute on miss)", result["lookup_compute_on_miss_us_per_token"], f"{t_full / t_lookup_c:.2f}"),
    ]
    if t_lookup_l:
        rows.append(("PLOT lookup + merge (learned back-off on miss)", result["lookup_learned_backoff_us_per_token"],
                     f"{t_full / t_lookup_l:.2f}"))
    text = table(rows, ("lower side for a 32 x 128 batch of real text", "us / token", "speed-up vs full"))
    text += ("\n\nMean cosine per token of the merged lower side to the windowed lower layers computed on every "
             "window: back-off " + f"{fidelity['backoff']:.4f}"
             + (f", learned back-off {fidelity['learned']:.4f}" if "learned" in fidelity else
                " (the root PLOT has no learned back-off: `hmi plot learn-backoff` trains one)") + ".")
    text += (f"\n\nRoot PLOT: {stats['entries']} entries ({stats['trigrams']} tri-grams, {stats['bigrams']} bi-grams, "
             f"{stats['unigrams']} uni-grams), {stats['file_bytes'] / 2**20:.0f} MiB on disk, "
             f"{result['bytes_per_entry']} bytes per entry ({result['value_bytes_per_entry']} of value).\n"
             f"Distinct windows in the batch: {len(uniq)}; served from tri-grams: {result['trigram_hit_rate']:.1%}; "
             f"levels: {hits}.\n"
             f"Exactness: lookup + merge vs windowed computation, max |diff| {max_err:.5f} "
             f"(outputs up to {scale:.2f}; {version.store.meta.dtype} storage).\nBuild rate: {build_rate:.0f} n-grams/s.")
    text += ("\n\nWhere PLOT lookup + merge spends its time (us / token): windows and their distinct set "
             f"{result['windows_us_per_token']}, PLOT reads (LMDB, decoding the {version.store.meta.dtype} values) "
             f"{result['plot_reads_us_per_token']}, merge of the distinct windows {result['merge_unique_us_per_token']}.")
    text += ("\n\nHot tier in front of LMDB, measured side by side (every variant warmed up, the PLOT in the page "
             "cache, rounds interleaved; entries chosen by the general corpus's first lines; the batch above; "
             f"{result['hot_mb_per_million_entries']:.0f} MB per million entries):\n\n"
             + table(hot_rows, ("hot tier budget", "entries", "distinct windows served from it", "lookup + merge us / token",
                                "speed-up vs LMDB alone", "speed-up vs full")))
    finish("bench_plot", text, result, "python benchmarks/bench_plot.py" + (" --quick" if args.quick else ""))


def hot_tier(root, version, ids, mask, tokens: int, t_full: float, repeat: int, quick: bool) -> tuple[list, dict]:
    """Lookup + merge through hot tiers of several budgets and LMDB alone, side by side: every
    variant warmed up (the PLOT's pages in the page cache), then rounds interleaved, medians."""
    from hmi.data import load_corpus
    from hmi.plot.build import tokenize_corpus
    from hmi.plot.hot import HotTier, entry_bytes, serving_order
    from hmi.plot.lookup import PlotLookup, PlotVersion

    sample = tokenize_corpus(root.tokenizer, load_corpus("general", 5_000 if quick else 20_000), progress=False)
    order = serving_order(version.store, sample)
    m = version.store.meta
    whole = len(order) * entry_bytes(m.n, m.hidden_size) / 2**20
    variants = {"LMDB alone": PlotLookup([version], policy="backoff")}
    for mb in (16, 64, 256, whole):
        hot = HotTier.from_store(version.store, order, mb)
        name = f"{mb:.0f} MB" + (" (the whole PLOT)" if mb == whole else "")
        variants[name] = PlotLookup([PlotVersion(version.name, version.store, version.encoder, hot=hot)], policy="backoff")
    with torch.no_grad():
        med = round_robin({name: (lambda lk=lk: lk.merged(ids, mask)) for name, lk in variants.items()},
                          max(repeat, 3), warmup=2)
    t_lmdb = med["LMDB alone"]
    rows, result = [], {"hot_mb_per_million_entries": round(entry_bytes(m.n, m.hidden_size) * 1e6 / 2**20, 1),
                        "lmdb_alone_warm_us_per_token": round(t_lmdb / tokens * 1e6, 2)}
    for name, lk in variants.items():
        lk.hits.clear()
        with torch.no_grad():
            lk.merged(ids, mask)
        served = sum(n for level, n in lk.hits.items() if level not in ("hot", "zeros"))
        share = lk.hits["hot"] / max(served, 1)
        t = med[name]
        held = len(lk.chain[0].hot) if lk.chain[0].hot is not None else 0
        rows.append((name, held, f"{share:.1%}", f"{t / tokens * 1e6:.2f}", f"{t_lmdb / t:.2f}", f"{t_full / t:.2f}"))
        if name != "LMDB alone":
            key = "whole" if "whole" in name else name.split()[0] + "mb"
            result.update({f"hot_{key}_us_per_token": round(t / tokens * 1e6, 2), f"hot_{key}_over_lmdb": round(t_lmdb / t, 2),
                           f"hot_{key}_hit_rate": round(share, 4)})
    result["hot_whole_speedup_vs_full_lower"] = round(t_full / med[list(variants)[-1]], 2)
    return rows, result


if __name__ == "__main__":
    main()
