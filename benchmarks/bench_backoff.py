"""The learned back-off's training recipes side by side, on the windows serving actually misses.

For the tasks' test texts (``held_out_texts``: never in a corpus), every tri-gram of real tokens the
root PLOT does not hold is served by the paper's back-off and by learned back-offs trained with each
recipe (steps, MLP width) on a copy of the PLOT; each is compared, window row by window row, with
the window's exact states from the windowed lower layers (what ``--miss-policy compute`` serves).
The PLOT's own model (``hmi plot learn-backoff``), where it has one, is a row too. Also per recipe:
the training time, the cosine on the PLOT's held-out tri-grams (the training's own report) and the
estimate's cost per missed window (the MLP and the neighbours' states, batches of 4,096; every cost
timed in the same rounds, the median of 15), in the precision serving uses (bf16 products where the
CPU multiplies bf16 natively; the PLOT's own model is also measured in fp32 there, and with its
neighbours' states read from LMDB instead of the centre table).  The PLOT's own model is timed as
serving runs it (``learned.ProjectedBackoff``: the neighbours' first-layer terms kept per token, the
served rows that are zero skipped) and through its one first-layer product (``forward``, the
reference), side by side.

Usage: python benchmarks/bench_backoff.py [--quick] [--root mpnet-base --l-low 6] [--recipes 1600:1024,4800:1024]
(``--quick``: one 400-step recipe on 200 texts.)
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    finish,
    prepared_root,
    result_name,
    root_flags,
    root_options,
    round_robin,
    start,
    table,
)

RECIPES = "1600:1024,4800:1024,4800:384"


def options(ap) -> None:
    root_options(ap)
    ap.add_argument("--recipes", default=RECIPES,
                    help=f"steps:width of each model to train (default {RECIPES}; '' for none: the PLOT's own model alone)")
    ap.add_argument("--texts", type=int, default=1000, help="test texts whose missed windows are compared")


def missed_windows(root, store, texts: list[str]):
    """Distinct tri-grams of real tokens in ``texts`` (cut to 64 tokens, as the accuracy table
    serves them) that ``store`` does not hold, and their exact states.
    Shapes: -> keys (M,) uint64, exact (M, 3, H) float32."""
    import numpy as np
    import torch

    from hmi.plot.build import tokenize_corpus
    from hmi.plot.keys import encoder_windows, pack, unpack

    windows = []
    for ids in tokenize_corpus(root.tokenizer, texts, 64, progress=False):
        ids = np.array([ids])
        windows.append(encoder_windows(ids, np.ones_like(ids)).reshape(-1, 3))
    uniq = np.unique(np.concatenate(windows), axis=0)
    uniq = uniq[(uniq[:, 0] > 0) & (uniq[:, 2] > 0)]
    keys = pack(uniq)
    _, found = store.get_many(keys)
    keys = keys[~found]
    with torch.no_grad():
        exact = torch.cat([root.plot_lower.lower(torch.from_numpy(unpack(keys[i:i + 4096]))).float()
                           for i in range(0, len(keys), 4096)])
    return keys, exact


def fidelity(est, exact) -> list[float]:
    """Mean cosine per window row (left, centre, right) of ``est`` to ``exact``. Shapes: (M, 3, H)."""
    import torch.nn.functional as F

    return [round(float(v), 4) for v in F.cosine_similarity(est.float(), exact, dim=-1).mean(0)]


def main() -> None:
    args = start(__doc__, options)
    import numpy as np
    import torch

    from hmi.data import held_out_texts
    from hmi.plot import learned
    from hmi.plot.keys import unpack
    from hmi.plot.store import PlotStore
    from hmi.training.backoff import TrainConfig, train

    quick = args.quick and args.recipes == RECIPES  # the command line stays as given
    n_texts = 200 if quick else args.texts
    recipes = [tuple(int(x) for x in r.split(":")) for r in ("400:1024" if quick else args.recipes).split(",") if r]
    root, version = prepared_root(root=args.root, l_low=args.l_low)
    store = version.store
    keys, exact = missed_windows(root, store, held_out_texts(n_texts))
    served, from_bigram = learned.served_backoff(store, keys)
    rows, result = [], {"root_artifact": root.artifact_id, "l_low": root.l_low, "missed_windows": int(len(keys)),
                        "bigram_served_share": round(float(from_bigram.mean()), 3), "models": {}}

    vocab = root.bert.config.vocab_size
    batch = 4096
    timers: dict[str, object] = {}  # row name -> what one timed call runs, on ``batch`` missed windows

    def measure(name: str, model, store_of_model, record: dict | None, bf16: bool | None = None,
                projected: bool = False) -> None:
        centres = learned.CentreTable(store_of_model, vocab) if model else None
        proj = learned.ProjectedBackoff(model, centres, learned.SERVE_BF16 if bf16 is None else bf16) \
            if projected else None
        est = torch.from_numpy(learned.estimate(model, store_of_model, keys, served, from_bigram, bf16, centres, proj)) \
            if model else torch.from_numpy(served)
        cos = fidelity(est, exact)
        held = record["held_out_cosine_learned"] if record else None
        rows.append([name, f"{record['seconds']:,.0f}" if record and "seconds" in record else "-",
                     held if held else "-", cos, f"{np.mean(cos):.4f}", "-"])
        # by where the back-off came from: what `learned+compute` estimates (bi-gram) and computes (uni-gram)
        by_level = {level: round(float(np.mean(fidelity(est[m], exact[m]))), 4) if m.any() else None
                    for level, m in (("bigram", from_bigram), ("unigram", ~from_bigram))}
        result["models"][name] = {"cosine_rows": cos, "cosine_mean": round(float(np.mean(cos)), 4),
                                  "cosine_mean_by_level": by_level,
                                  "train_seconds": record.get("seconds") if record else None,
                                  "held_out_cosine_plot": held}
        if model is not None:
            timers[name] = lambda: learned.estimate(model, store_of_model, keys[:batch], served[:batch],
                                                    from_bigram[:batch], bf16, centres, proj)

    measure("back-off (no model)", None, store, None)

    def compute() -> None:
        with torch.no_grad():
            root.plot_lower.lower(torch.from_numpy(unpack(keys[:batch])))
    exact_row = "exact (the windowed lower layers, `compute`)"
    rows.append([exact_row, "-", "-", "[1, 1, 1]", "1", "-"])
    timers[exact_row] = compute
    result["serve_bf16"] = learned.SERVE_BF16
    own = learned.load(store.path)
    if own is not None:
        record_own = json.loads((Path(store.path) / learned.CONFIG).read_text())
        name = f"the PLOT's model ({record_own['steps']} steps, width {record_own['width']})"
        precision = ", bf16 products" if learned.SERVE_BF16 else ""
        served_row = name + precision + ", as served (first layer split by input)"
        forward_row = name + precision + ", one first-layer product (the reference)"
        measure(served_row, own, store, record_own, projected=True)
        measure(forward_row, own, store, record_own)
        # side by side: the neighbours' states read from LMDB per window instead of the centre table
        lmdb_row = name + ", neighbours read from LMDB"
        rows.append([lmdb_row, "-", "-", "same", "same", "-"])
        timers[lmdb_row] = lambda: learned.estimate(own, store, keys[:batch], served[:batch], from_bigram[:batch])
        if learned.SERVE_BF16:
            measure(name + ", fp32 products", own, store, record_own, bf16=False)
    with tempfile.TemporaryDirectory(prefix="hmi-backoff-") as tmp:
        copy = Path(tmp) / "plot"
        copy.mkdir()
        shutil.copy(Path(store.path) / "data.mdb", copy / "data.mdb")
        store_copy = PlotStore(copy, readonly=True)
        try:
            for steps, width in recipes:
                if own is not None and record_own["train_config"] == asdict(TrainConfig(steps=steps, width=width)):
                    continue  # the PLOT's own model is this recipe: its row above
                t = time.time()
                record = train(store_copy, TrainConfig(steps=steps, width=width))
                print(f"trained {steps} steps, width {width}: {time.time() - t:.0f} s", flush=True)
                measure(f"{steps} steps, width {width}", learned.load(copy), store_copy, record)
            # every cost in one round-robin, so that a drift of the machine hits them alike
            seconds = round_robin(timers, rounds=3 if quick else 15)
        finally:
            store_copy.close()
    n = min(len(keys), batch)
    for row in rows:
        if row[0] in seconds:
            us = seconds[row[0]] / n * 1e6
            row[5] = f"{us:.1f}"
            if row[0] in result["models"]:
                result["models"][row[0]]["estimate_us_per_window"] = round(us, 2)
    result["compute_us_per_window"] = round(seconds[exact_row] / n * 1e6, 2)
    if own is not None:
        result["estimate_us_per_window_lmdb_neighbours"] = round(seconds[lmdb_row] / n * 1e6, 2)
        result["served_over_reference_speed"] = round(seconds[forward_row] / seconds[served_row], 2)

    split = f"{root.l_low}+{root.bert.config.num_hidden_layers - root.l_low}"
    text = (f"Root {root.artifact_id} (split {split}), its root PLOT; {len(keys):,} distinct tri-grams of real "
            f"tokens in {n_texts} test texts of the tasks miss it (a bi-gram serves {result['bigram_served_share']:.0%} "
            "of them). Cosine of each window row (left, centre, right) to the exact states the windowed lower layers "
            "compute for the window; a model trained per recipe on a copy of the PLOT (batches of 512 of its "
            "tri-grams, each served as if missing).\n\n"
            + table(rows, ("model", "training s", "held-out cosine (PLOT tri-grams)", "cosine on missed test windows",
                           "mean", "estimate us / window"))
            + "\n\nMean cosine by where the back-off came from (the misses `--miss-policy learned+compute` "
            "estimates, served from a bi-gram, and computes, served from uni-grams alone):\n\n"
            + table([(n, *(f"{m['cosine_mean_by_level'][lv]:.4f}" if m["cosine_mean_by_level"][lv] is not None else "-"
                           for lv in ("bigram", "unigram"))) for n, m in result["models"].items()],
                    ("model", "bi-gram served", "uni-grams only")))
    finish(result_name("bench_backoff", args), text, result,
           "python benchmarks/bench_backoff.py" + (" --quick" if args.quick else "") + root_flags(args)
           + (f" --recipes {args.recipes or chr(39) * 2}" if args.recipes != RECIPES else "")
           + (f" --texts {args.texts}" if args.texts != 1000 else ""))


if __name__ == "__main__":
    main()
