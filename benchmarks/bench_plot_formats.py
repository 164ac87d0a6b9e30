"""PLOT value formats side by side: bytes per entry on disk, lookup speed and what each costs in
accuracy, on the root PLOT of the prepared root (its entries re-encoded into each format) and,
for sizes only, the same keys with hidden 768 (the 12-layer root's width).

Formats: fp16 or int8 rows with a float32 scale each, in one record per entry (a value over ~2 KB
goes to overflow pages: the first format, fp16, at hidden 384) or split into the leaf-sized
records ``hmi.plot.codec.leaf_chunks`` chooses.

Usage: python benchmarks/bench_plot_formats.py [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, prepared_root, real_batch, start, table, timeit  # noqa: E402

FORMATS = [("float16", "one record"), ("float16", "leaf records"), ("int8", "leaf records")]


def entries(store, batch: int):
    """(keys, values) of a PLOT in key order, ``batch`` entries at a time (values float16)."""
    keys = store.keys()
    for s in range(0, len(keys), batch):
        k = keys[s:s + batch]
        vals, found = store.get_many(k)
        assert found.all()
        yield k, vals


def copy_as(source, path: Path, dtype: str, chunks: int, hidden: int | None = None, limit: int | None = None):
    """A PLOT with ``source``'s keys and values in another format (random values of width
    ``hidden`` instead, for sizes only). Returns (store, seconds to write)."""
    from dataclasses import replace

    from hmi.plot.store import PlotStore

    meta = replace(source.meta, dtype=dtype, chunks=chunks, hidden_size=hidden or source.meta.hidden_size)
    store = PlotStore(path, meta=meta, readonly=False)
    rng = np.random.default_rng(0)
    seconds, done = 0.0, 0
    for keys, vals in entries(source, 20000):
        if limit is not None and done >= limit:
            break
        if hidden is not None:
            vals = rng.standard_normal((len(keys), meta.n, hidden)).astype(np.float16)
        t = time.perf_counter()
        store.put_many(keys, vals)
        seconds += time.perf_counter() - t
        done += len(keys)
    return store, seconds


@torch.no_grad()
def pooled_cosine(root, lookup, texts, batch: int = 32) -> float:
    """Mean cosine of the pooled output served through ``lookup`` to the full model's."""
    from hmi.model.hplm import UpperLayers
    from hmi.model.root import full_forward, mean_pool

    upper = UpperLayers(root.bert, root.l_low)
    total = 0.0
    for s in range(0, len(texts), batch):
        enc = root.tokenizer(texts[s:s + batch], truncation=True, max_length=128, padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        served = upper(lookup.merged(ids.numpy(), mask.numpy()), mask)
        full = full_forward(root.bert, ids, mask)[-1]
        total += F.cosine_similarity(mean_pool(served, mask), mean_pool(full, mask), dim=-1).sum().item()
    return total / len(texts)


def main() -> None:
    args = start(__doc__)
    from hmi.data import held_out_texts
    from hmi.plot.codec import leaf_chunks, value_bytes
    from hmi.plot.lookup import PlotLookup, PlotVersion

    repeat = 3 if args.quick else 10
    root, version = prepared_root()
    source = version.store
    ids, mask = real_batch(root.tokenizer)
    tokens = int(mask.sum())
    texts = held_out_texts(64 if args.quick else 256)
    n, H = source.meta.n, source.meta.hidden_size
    tmp = Path(tempfile.mkdtemp())
    rows, result, stores = [], {"root": root.spec.name, "entries": len(source), "formats": {}}, {}
    try:
        for dtype, layout in FORMATS:
            chunks = 1 if layout == "one record" else leaf_chunks(value_bytes(dtype, n, H))
            name = f"{dtype}, {layout}"
            store, seconds = copy_as(source, tmp / f"{dtype}-{chunks}", dtype, chunks)
            stores[name] = store
            size = (store.path / "data.mdb").stat().st_size
            wide_chunks = 1 if layout == "one record" else leaf_chunks(value_bytes(dtype, n, 768))
            wide, _ = copy_as(source, tmp / f"wide-{dtype}-{wide_chunks}", dtype, wide_chunks, hidden=768,
                              limit=40000 if args.quick else 100000)
            wide_size = (wide.path / "data.mdb").stat().st_size / len(wide)
            result["formats"][name] = {
                "dtype": dtype, "chunks": chunks, "value_bytes": store.meta.value_bytes,
                "bytes_per_entry": round(size / len(store), 1),
                "disk_over_value": round(size / len(store) / store.meta.value_bytes, 3),
                "write_s": round(seconds, 1),
                "h768": {"chunks": wide_chunks, "value_bytes": wide.meta.value_bytes,
                         "bytes_per_entry": round(wide_size, 1),
                         "disk_over_value": round(wide_size / wide.meta.value_bytes, 3)},
            }
            wide.close()
        lookups = {name: PlotLookup([PlotVersion("root", s, root.windowed)], policy="backoff") for name, s in stores.items()}
        base_name = next(iter(lookups))
        with torch.no_grad():
            base = lookups[base_name].merged(ids, mask)
            exact = root.windowed(torch.from_numpy(ids), torch.from_numpy(mask))
        times = {name: [] for name in lookups}
        for _ in range(repeat):  # interleaved, so that drifts of a noisy machine hit every format alike
            for name, lk in lookups.items():
                times[name].append(timeit(lambda lk=lk: lk.merged(ids, mask), 1))
        m = torch.from_numpy(mask).bool()
        for name, lk in lookups.items():
            with torch.no_grad():
                got = lk.merged(ids, mask)
            r = result["formats"][name]
            r["lookup_us_per_token"] = round(float(np.median(times[name])) / tokens * 1e6, 2)
            r["max_abs_err_vs_fp16"] = round(float((got - base)[m].abs().max()), 5)
            r["pooled_cosine_served"] = round(pooled_cosine(root, lk, texts), 5)
            r["max_abs_err_vs_computed_windows"] = round(float((got - exact)[m].abs().max()), 5)
            w = r["h768"]
            rows.append((name, r["value_bytes"], r["chunks"], r["bytes_per_entry"], f"{r['disk_over_value']:.2f}",
                         w["value_bytes"], w["chunks"], w["bytes_per_entry"], f"{w['disk_over_value']:.2f}",
                         r["lookup_us_per_token"], r["max_abs_err_vs_fp16"], f"{r['pooled_cosine_served']:.4f}"))
    finally:
        for s in stores.values():
            s.close()
        shutil.rmtree(tmp)
    text = table(rows, ("format", "value B (H=384)", "records", "disk B/entry", "ratio", "value B (H=768)", "records",
                        "disk B/entry", "ratio", "lookup+merge us/token", "max |diff| vs fp16", "pooled cos (served)"))
    text += (f"\n\n{result['entries']} entries of the root PLOT of {root.spec.name} (L_low={root.l_low}), each "
             "re-encoded; H=768: the same keys with random values (sizes only). Lookup + merge: a 32 x 128 batch of "
             f"real text ({tokens} tokens), median of {repeat} interleaved runs. Pooled cosine: {len(texts)} held-out "
             "texts served through each PLOT and the shared upper layers, against the full model.")
    finish("bench_plot_formats", text, result, "python benchmarks/bench_plot_formats.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
