"""Domain branches: entries, bytes and coverage of frequency-pruned PLOTs over alpha, and the
accuracy of an in-domain task on each (license-category on the legal branch).

Usage: python benchmarks/bench_domains.py [--quick]
"""

from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, prepared_root, start, table  # noqa: E402

ALPHAS = (1.0, 0.5, 0.3, 0.0)


def main() -> None:
    args = start(__doc__)
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.train import FinetuneConfig, finetune
    from hmi.data import load_corpus, load_task, task_labels
    from hmi.model.hplm import UpperLayers
    from hmi.plot.build import Selection, build, count_ngrams, plan_keys, tokenize_corpus
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.paths import plot_meta
    from hmi.plot.store import PlotStore
    from hmi.version_tree.fpt import FPTConfig, further_pretrain, mlm_loss_through

    max_lines = 2000 if args.quick else 12000
    steps = 30 if args.quick else 200
    domains = ("legal",) if args.quick else ("legal", "software")
    alphas = (1.0, 0.5, 0.0) if args.quick else ALPHAS
    root, root_version = prepared_root()
    rows, res = [], {}
    tmp = Path(tempfile.mkdtemp())
    try:
        for domain in domains:
            lines = load_corpus(domain, max_lines)
            enc = copy.deepcopy(root.windowed)
            cfg = FPTConfig(steps=steps)
            heads: list = []
            fpt = further_pretrain(root.bert, root.tokenizer, enc, lines, cfg, progress=True, keep_head=heads)
            held = lines[-cfg.eval_lines:]
            upper = UpperLayers(root.bert, root.spec.l_low)
            keys, counts = count_ngrams(tokenize_corpus(root.tokenizer, lines, 128, progress=False))
            entries = {}
            for alpha in alphas:
                plan = plan_keys(keys, counts, Selection("alpha", alpha=alpha), 0, with_backoff=False)
                covered = float(counts[np.isin(keys, plan)].sum() / counts.sum())
                store = PlotStore(tmp / f"{domain}-{alpha}", meta=plot_meta(root), readonly=False)
                build(store, enc, plan, progress=False)
                st = store.stats()
                entries[alpha] = st["entries"]
                chain = ([PlotVersion(f"{domain}@{alpha}", store, enc)] if alpha > 0 else []) + [root_version]
                mlm = round(mlm_loss_through(PlotLookup(chain, policy="backoff"), upper, heads[0], root.tokenizer, held, cfg), 4)
                acc = None
                if domain == "legal":
                    lookup = PlotLookup(chain, policy="backoff")
                    spec = AdapterSpec(labels=tuple(task_labels("license-category")))
                    _, m = finetune(root.bert, root.spec.l_low, lookup, root.tokenizer, spec,
                                    load_task("license-category", "train", 300 if args.quick else 1811),
                                    load_task("license-category", "dev", 226), load_task("license-category", "test", 226),
                                    FinetuneConfig(epochs=3 if args.quick else 5, patience=5), progress=False)
                    acc = round(100 * m["test"]["accuracy"], 2)
                    res[{1.0: "acc_100", 0.5: "acc_50", 0.0: "acc_root"}.get(alpha, f"acc_{int(alpha * 100)}")] = acc
                rows.append((domain, alpha, st["entries"], f"{st['file_bytes'] / 2**20:.1f}", f"{covered:.3f}", mlm,
                             f"{fpt['mlm_loss_before']} -> {fpt['mlm_loss_after']}", acc if acc is not None else "-"))
                res.setdefault("mlm_loss", {})[f"{domain}@{alpha}"] = mlm
                print(rows[-1], flush=True)
                store.close()
            res[f"entries_ratio_50_vs_100_{domain}"] = round(entries[0.5] / max(1, entries[1.0]), 4)
        res["entries_ratio_50_vs_100"] = max(res[f"entries_ratio_50_vs_100_{d}"] for d in domains)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = table(rows, ("domain", "alpha", "branch entries", "MiB", "tri-gram occurrences covered",
                        "held-out MLM loss via PLOT", "MLM loss, computed windows (FPT before -> after)",
                        "license-category test acc. %"))
    text += (f"\n\n{max_lines} corpus lines per domain ({', '.join(domains)}), {steps} further-pretraining steps (batch 16). Accuracy: a "
             "bottleneck adapter trained and tested on the branch's chain (branch -> root -> back-off, the paper's "
             "back-off policy); alpha 0 means the root PLOT alone. The MLM loss via PLOT feeds the branch's chain "
             "(branch -> root -> back-off) to the frozen upper layers and the branch's MLM head, on held-out corpus lines.")
    finish("bench_domains", text, res, "python benchmarks/bench_domains.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
