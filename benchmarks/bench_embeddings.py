"""Sentence embeddings as ``POST /v1/embeddings`` serves them against the root run in full (what
sentence-transformers computes: the full model, mean over the real tokens, normalized), on
held-out text (test texts of the four text tasks, never used for calibration).

Usage: python benchmarks/bench_embeddings.py [--quick] [--root minilm-l6|mpnet-base|PATH] [--l-low N]

- **Quality**: the cosine of each served embedding to the full model's (mean, 5th percentile,
  minimum), with the PLOT as served (the server's back-off for n-grams it lacks) and with every
  window computed exactly (what calibration alone leaves); whether each text's nearest
  neighbour among the others is the same under both, and the rank correlation of all pairwise
  similarities (what a retrieval or clustering user sees).
- **Speed**: texts per second of the serving path (``hmi.scheduler.pipeline.Scheduler``, embedding
  requests in batches of 32: tokenize, PLOT lookup, upper layers, pooling) against the full root
  in batches of 32 (tokenize, all layers, pooling) with the same linear kernels, rounds
  interleaved, medians.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, prepared_root, result_name, root_flags, root_options, round_robin, start, table  # noqa: E402

B, MAX_LEN = 32, 128
NOTE = ("Served embeddings approximate the root's own: their similarities rank pairs of texts much as the full "
        "model's do, but a text's nearest neighbour often changes. Index and query through the same path (both "
        "served, or both with the full model); do not mix vectors of the two in one index.")


def served(scheduler, texts: list[str]) -> np.ndarray:
    """Embeddings of ``texts`` through the serving path, submitted in batches of B (the root's model)."""
    from hmi.scheduler.types import InferRequest

    reqs = [InferRequest(None, t, truncate=True, embed=True) for t in texts]
    for i in range(0, len(reqs), B):
        scheduler.submit(reqs[i:i + B])
    return np.stack([r.future.result(600)["embedding"] for r in reqs])


def full(root, pooling, texts: list[str]) -> np.ndarray:
    """Embeddings of ``texts`` by the root run in full, B at a time (sentence-transformers' computation)."""
    from hmi.model.root import full_forward

    out = []
    for i in range(0, len(texts), B):
        enc = root.tokenizer(texts[i:i + B], truncation=True, max_length=MAX_LEN, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = full_forward(root.bert, enc["input_ids"], enc["attention_mask"])[-1]
            out.append(pooling(h, enc["attention_mask"]).numpy())
    return np.concatenate(out)


def quality(got: np.ndarray, ref: np.ndarray) -> dict:
    """Cosines of matching rows (both sets are normalized) and nearest-neighbour agreement."""
    cos = (got * ref).sum(1)

    def nearest(x):
        sim = x @ x.T
        np.fill_diagonal(sim, -np.inf)
        return sim.argmax(1)

    def ranks(x):
        return np.argsort(np.argsort(x)).astype(np.float64)

    upper = np.triu_indices(len(got), 1)
    spearman = np.corrcoef(ranks((got @ got.T)[upper]), ranks((ref @ ref.T)[upper]))[0, 1]
    return {"cos_mean": round(float(cos.mean()), 4), "cos_p5": round(float(np.percentile(cos, 5)), 4),
            "cos_min": round(float(cos.min()), 4), "same_nearest": round(float((nearest(got) == nearest(ref)).mean()), 4),
            "pairwise_spearman": round(float(spearman), 4)}


def main() -> None:
    args = start(__doc__, root_options)
    from hmi.adapters.store import AdapterStore
    from hmi.data import held_out_texts
    from hmi.model.root import sentence_pooling
    from hmi.plot.lookup import PlotLookup
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants

    root, version = prepared_root(root=args.root, l_low=args.l_low)
    pooling = sentence_pooling(root.spec.model_dir)
    texts = held_out_texts(128 if args.quick else 512)
    ref = full(root, pooling, texts)
    res, rows = {"texts": len(texts), "pooling": f"{pooling.mode}, normalized={pooling.normalize}"}, []
    with tempfile.TemporaryDirectory() as tmp:
        store = AdapterStore(Path(tmp) / "tenants")
        for policy, name in (("backoff", "served (PLOT as served)"), ("compute", "exact windows (no back-off)")):
            lookup = PlotLookup([version], policy=policy)
            s = Scheduler(root.bert, root.spec.l_low, root.tokenizer, store, FixedTenants({}), FixedTenants({}, lookup),
                          SchedulerConfig(max_len=MAX_LEN), pooling)
            q = quality(served(s, texts), ref)
            if policy == "backoff":
                speed = round_robin({"served": lambda: served(s, texts), "full": lambda: full(root, pooling, texts)},
                                    rounds=2 if args.quick else 3)
                hits = dict(lookup.hits)
            s.shutdown()
            res[policy] = q
            rows.append((name, q["cos_mean"], q["cos_p5"], q["cos_min"], q["same_nearest"], q["pairwise_spearman"]))
    res["served_texts_per_s"] = round(len(texts) / speed["served"], 1)
    res["full_texts_per_s"] = round(len(texts) / speed["full"], 1)
    res["served_over_full"] = round(speed["full"] / speed["served"], 2)
    res["plot_hits"] = hits
    text = (f"Root {root.spec.name} split {root.spec.l_low}+{root.bert.config.num_hidden_layers - root.spec.l_low} "
            f"(artifact {root.artifact_id}); {len(texts)} held-out texts (test texts of four tasks), cut to {MAX_LEN} "
            f"tokens; the root's pooling: {res['pooling']}.\n\n"
            + table(rows, ("embeddings", "cosine to full, mean", "5th percentile", "min", "same nearest neighbour",
                            "Spearman of pairwise similarities"))
            + "\n\n" + table([("served (POST /v1/embeddings' path)", res["served_texts_per_s"]),
                              ("the root in full", res["full_texts_per_s"])], ("texts per second", "batches of 32"))
            + f"\n\nServed over full: **{res['served_over_full']}x** the texts per second. PLOT hits while served "
              f"(distinct windows per level): {hits}.\n\n" + NOTE)
    finish(result_name("bench_embeddings", args), text, res, "python benchmarks/bench_embeddings.py" + root_flags(args))


if __name__ == "__main__":
    main()
