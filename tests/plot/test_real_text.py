"""PLOT lookup against the windowed computation on real text with the real packaged root."""

import numpy as np
import torch

from hmi.plot.build import Selection, build, count_ngrams, plan_keys
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore


def test_lookup_merge_equals_windowed_computation_on_real_text(real_root, tmp_path):
    from hmi.bootstrap import ensure_data
    from hmi.data import load_task

    ensure_data()
    texts = [r["text"] for r in load_task("news-topic", "test", 4)] + [r["text"] for r in load_task("review-sentiment", "test", 4)]
    enc = real_root.tokenizer(texts, truncation=True, max_length=64, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    keys, counts = count_ngrams([list(r[m.astype(bool)]) for r, m in zip(ids, mask)])
    store = PlotStore(tmp_path / "p", meta=PlotMeta("uncalibrated", 3, 384), readonly=False)
    build(store, real_root.windowed, plan_keys(keys, counts, Selection("all"), 0, with_backoff=False), progress=False)
    lookup = PlotLookup([PlotVersion("root", store, real_root.windowed)], policy="backoff")
    got = lookup.merged(ids, mask)
    with torch.no_grad():
        want = real_root.windowed(torch.from_numpy(ids), torch.from_numpy(mask))
    m = torch.from_numpy(mask).bool()
    scale = float(want[m].abs().max())
    err = float((got[m] - want[m]).abs().max())
    assert err <= scale * 2 ** -9, (err, scale)  # fp16 keeps 11 significant bits; the merge adds three rows
    assert lookup.hits["trigram:root"] == len(np.unique(keys)) and lookup.hits["zeros"] == 0
