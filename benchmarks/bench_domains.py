"""Domain branches: does a branch help its domain's task?  The paper's Table 5 analog, side by side
in one run: a tenant of the domain's task served on the root PLOT alone, on a branch further
pretrained with the paper's MLM, and on a branch distilled from the full root on the domain's text
(the default objective), at the default alpha 0.5 and at alpha 1.0; with each branch's entries,
bytes, tri-gram coverage and the measure its further pretraining reports.

Each tenant: the task's default adapter (the bottleneck for classification, LoRA for part-of-speech
tagging, the task of the literature domain and of ``brown``, the tagging tenant's own sentences)
trained and tested on the chain it is served with (branch -> root -> back-off), one run per seed;
``gain`` is the mean of the per-seed differences to the root PLOT, with their standard deviation,
beside the test set's own noise (the binomial standard error of one accuracy on that many test
texts). Tenants train at lr 3e-3; with ``--grid`` every tenant run (chain and seed) chooses its
learning rate on dev from the hBERT grid of ``eval_accuracy.py`` (the paper's protocol, the one the
grid table applies to the frozen root with a head), and the page names the rates chosen.

A run is resumable: its branches (distillation checkpointed every 25 steps) and every finished
tenant run are kept under ``$HMI_HOME/runs/bench_domains/<config hash>/``, so the same command run
again continues where it stopped; ``--max-minutes M`` ends one invocation after M minutes (exit
code 75 while runs are left), ``--fresh`` starts over.

Usage: python benchmarks/bench_domains.py [--quick] [--domains reviews,legal] [--seeds N]
                                          [--variants mlm,distill,distill-1.0] [--steps N]
                                          [--root minilm-l6|mpnet-base|PATH] [--l-low N]
                                          [--grid] [--max-minutes M] [--fresh]
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cells import Cells  # noqa: E402
from benchmarks.common import DOCS, describe_adapter, finish, prepared_root, result_name, root_flags, root_options, start, table  # noqa: E402
from benchmarks.eval_accuracy import GRIDS, HBERT_LR, lr_text  # noqa: E402
from hmi.timelimit import EXIT_UNFINISHED, OutOfTime  # noqa: E402

VARIANTS = ("mlm", "distill", "distill-1.0")  # distill-1.0: the distilled branch's lower side, every tri-gram
TASK_OF = {"reviews": "review-sentiment", "legal": "license-category", "news": "news-topic", "social": "tweet-sentiment",
           "literature": "pos-tagging", "brown": "pos-tagging"}


def domain_lines(domain: str, max_lines: int) -> list[str]:
    """A domain's corpus lines: the prepared domain corpus, or for ``brown`` the tagging tenant's own
    text, the training sentences of every Brown genre (the literature corpus holds its fiction genres
    only, about a third of the test sentences)."""
    from hmi.data import load_corpus, load_task
    from hmi.data.parsers import brown_detokenize

    if domain == "brown":
        return [brown_detokenize(r["tokens"]) for r in load_task("pos-tagging", "train", max_lines)]
    return load_corpus(domain, max_lines)


def measure(args, root, root_version, cells: Cells, domains: list[str], chosen: list[str], seeds: list[int],
            sizes: tuple[int, int, int], lrs: tuple[float, ...]) -> tuple[list[tuple], dict]:
    """Every domain's variants, each tenant run a cell of ``cells`` and the branches kept in its
    folder (a stopped run continues; raises ``OutOfTime`` when ``--max-minutes`` is spent):
    (table rows, results).  With several ``lrs`` each chain and seed keeps the rate with the best
    dev accuracy."""
    from hmi.adapters.spec import AdapterSpec
    from hmi.data import is_tagging, load_task, task_labels
    from hmi.model.root import weights_fingerprint
    from hmi.plot.build import Selection, build, count_ngrams, plan_keys, tokenize_corpus
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.paths import plot_meta
    from hmi.plot.store import PlotStore
    from hmi.training.finetune import FinetuneConfig, finetune
    from hmi.training.further_pretrain import FPTConfig
    from hmi.training.further_pretrain import summary as fpt_summary
    from hmi.version_tree.tree import VersionTree

    max_lines, n_train, n_test = sizes
    tok = root.tokenizer
    rows, res = [], {"root": root.spec.name, "l_low": root.spec.l_low, "seeds": len(seeds), "domains": {}}
    tree, stores = VersionTree(root, cells.folder / "home", root_version=root_version), []
    try:
        for domain in domains:
            task = TASK_OF[domain]
            lines = domain_lines(domain, max_lines)
            train, dev, test = load_task(task, "train", n_train), load_task(task, "dev", n_test // 2), load_task(task, "test", n_test)
            tagging = is_tagging(task)  # a tagging tenant gets the task's default adapter (LoRA), words' first tokens
            spec = (AdapterSpec.for_task("tagging", task_labels(task)) if tagging
                    else AdapterSpec.for_task("classification", task_labels(task), pooling="mean"))
            units = sum(len(r["tags"]) for r in test) if tagging else len(test)  # accuracy over words for tagging

            def accuracy(name: str, chain) -> tuple[list[float], list[float]]:
                """Per seed: the test accuracy at the rate dev chose, and that rate."""
                def run(s: int, lr: float) -> dict:
                    m = finetune(root.bert, root.spec.l_low, PlotLookup(chain), tok, spec, train, dev, test,
                                 FinetuneConfig(epochs=4, lr=lr, max_len=64, patience=4, seed=s), progress=False)
                    return {"accuracy": round(100 * m[1]["test"]["accuracy"], 2),
                            "dev": round(100 * m[1]["dev"]["accuracy"], 2)}

                def key(s: int, lr: float) -> dict:  # a single rate keeps the keys of runs before --grid
                    return {"domain": domain, "served on": name, "seed": s, **({"lr": lr} if len(lrs) > 1 else {})}
                best = []
                for s in seeds:
                    tried = {lr: cells.run(key(s, lr), lambda s=s, lr=lr: run(s, lr)) for lr in lrs}
                    lr = lrs[0] if len(lrs) == 1 else max(lrs, key=lambda lr: tried[lr]["dev"])
                    best.append((tried[lr]["accuracy"], lr))
                return [a for a, _ in best], [lr for _, lr in best]

            variants = {"root PLOT": ([root_version], None, None)}
            for objective in (o for o in ("mlm", "distill") if o in chosen):
                name = f"{domain}-{objective}"
                t0 = time.time()
                if name not in tree.nodes():  # a finished branch of an earlier run is kept; a stopped one resumes
                    cells.work(lambda name=name, objective=objective: tree.create(
                        name, "root", lines, 0.5, FPTConfig(objective=objective, steps=args.steps), progress=True,
                        checkpoint=cells.folder / f"{name}.ckpt"))
                node = tree.nodes()[name]
                variants[f"branch, {objective}, alpha 0.5"] = ([tree.version(name), root_version], node,
                                                               round(time.time() - t0))
            if "distill-1.0" in chosen:  # the distilled branch's lower side, every tri-gram (a resumable build)
                node = tree.nodes()[f"{domain}-distill"]
                enc = tree.encoder(node.name)
                keys, counts = count_ngrams(tokenize_corpus(tok, lines, 128, progress=False))
                stores.append(PlotStore(cells.folder / f"{domain}-distill-1.0", meta=plot_meta(root), readonly=False))
                build(stores[-1], enc, plan_keys(keys, counts, Selection("alpha", alpha=1.0), len(tok)), progress=True,
                      weights=weights_fingerprint(enc))  # a branch distilled again is built again
                variants["branch, distill, alpha 1.0"] = ([PlotVersion("distill@1.0", stores[-1], enc), root_version],
                                                          node, None)

            base = None
            out = res["domains"].setdefault(domain, {"task": task, "test": len(test), "variants": {},
                                                     **({"test_words": units} if tagging else {})})
            for name, (chain, node, secs) in variants.items():
                accs, chosen_lrs = accuracy(name, chain)
                base = accs if base is None else base
                gains = np.array(accs) - np.array(base)
                st = chain[0].store.stats() if node is not None else {}
                mean = float(np.mean(accs))
                noise = 100 * math.sqrt(mean / 100 * (1 - mean / 100) / units)
                out["variants"][name] = {"accuracy": accs, "mean": round(mean, 2), "gain": round(float(gains.mean()), 2),
                                         "gain_sd": round(float(gains.std(ddof=1)) if len(seeds) > 1 else 0.0, 2),
                                         "test_se": round(noise, 2), "entries": st.get("entries", 0),
                                         "fpt": node.fpt if node is not None else None, "seconds": secs,
                                         "lr_per_seed": chosen_lrs}
                rows.append((domain, task, name, st.get("entries", "-"),
                             f"{st['file_bytes'] / 2**20:.0f}" if st else "-",
                             f"{node.corpus['covered_occurrences']:.2f}" if node is not None and "1.0" not in name else
                             ("1.00" if node is not None else "-"),
                             fpt_summary(node.fpt) if node is not None else "-",
                             f"{mean:.2f}", "" if node is None else f"{gains.mean():+.2f}"
                             + (f" (sd {gains.std(ddof=1):.2f})" if len(seeds) > 1 else ""),
                             f"{noise:.2f}") + ((", ".join(f"{lr:g}" for lr in chosen_lrs),) if len(lrs) > 1 else ()))
                print(rows[-1], flush=True)
    finally:
        for store in stores:
            store.close()
        tree.close()
    return rows, res


def main() -> None:
    def options(ap):
        ap.add_argument("--domains", help="comma-separated domains among " + ", ".join(TASK_OF)
                                          + " (default: reviews; without --quick reviews,legal)")
        ap.add_argument("--seeds", type=int, help="fine-tune seeds per tenant (default 3 with --quick, else 5)")
        ap.add_argument("--variants", default=",".join(VARIANTS),
                        help="branches beside the root PLOT, among " + ", ".join(VARIANTS) + " (default: all)")
        ap.add_argument("--steps", type=int, help="further-pretraining steps of every branch (default: the product's)")
        ap.add_argument("--max-minutes", type=float, metavar="M",
                        help="stop this invocation once M minutes are spent (after the step in progress); the same "
                             "command run again continues; exit code 75 while runs are left")
        ap.add_argument("--grid", action="store_true",
                        help="each tenant run's learning rate chosen on dev from " + lr_text(GRIDS["hBERT"])
                             + " (default: " + f"{HBERT_LR:g} for every run)")
        ap.add_argument("--fresh", action="store_true", help="forget the branches and runs of this configuration")
        root_options(ap)

    args = start(__doc__, options)
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise SystemExit(f"--max-minutes must be positive, got {args.max_minutes:g}")
    from hmi.training.further_pretrain import FPTConfig

    domains = (args.domains or ("reviews" if args.quick else "reviews,legal")).split(",")
    unknown = [d for d in domains if d not in TASK_OF]
    if unknown:
        raise SystemExit(f"unknown domain(s) {', '.join(unknown)}; use some of {', '.join(TASK_OF)}")
    chosen = args.variants.split(",")
    if not set(chosen) <= set(VARIANTS) or ("distill-1.0" in chosen and "distill" not in chosen):
        raise SystemExit(f"--variants: some of {', '.join(VARIANTS)} (distill-1.0 needs distill)")
    seeds = list(range(args.seeds or (3 if args.quick else 5)))
    max_lines, n_train, n_test = 12000, 640, 1000
    root, root_version = prepared_root(root=args.root, l_low=args.l_low)
    config = {"format": 1, "root": root.spec.name, "root_artifact": root.artifact_id, "l_low": root.spec.l_low,
              "plot": (root_version.store.get_record("build") or {}).get("fingerprint"), "steps": args.steps,
              "lines": max_lines, "train": n_train, "test": n_test}
    lrs = GRIDS["hBERT"] if args.grid else (HBERT_LR,)
    if args.grid:  # its cells hold dev accuracy too (a single rate's configuration, and so its cells, unchanged)
        config["lr_grid"] = list(lrs)
    cells = Cells("bench_domains", config, max_minutes=args.max_minutes, fresh=args.fresh, record_dir=DOCS / "cells")
    if args.fresh:
        shutil.rmtree(cells.folder / "home", ignore_errors=True)
    try:
        rows, res = measure(args, root, root_version, cells, domains, chosen, seeds, (max_lines, n_train, n_test), lrs)
    except OutOfTime as exc:
        print(f"stopped: {exc} ({cells.summary()}); run the same command again to continue", flush=True)
        sys.exit(EXIT_UNFINISHED)
    res["lr_chosen_on_dev"] = len(lrs) > 1
    for d, r in res["domains"].items():
        for objective in ("distill", "mlm"):
            if f"branch, {objective}, alpha 0.5" in r["variants"]:
                res[f"{objective}_gain_{d}"] = r["variants"][f"branch, {objective}, alpha 0.5"]["gain"]
    text = table(rows, ("domain", "task", "served on", "branch entries", "MiB", "tri-gram occurrences covered",
                        "further pretraining (held-out domain lines)", f"test accuracy %, mean of {len(seeds)} seeds",
                        "gain over root PLOT (per-seed sd)", "test-set SE")
                 + (("learning rate per seed, chosen on dev",) if len(lrs) > 1 else ()))
    text += (f"\n\nRoot {root.spec.name}, split {root.spec.l_low}+{root.bert.config.num_hidden_layers - root.spec.l_low}. "
             f"Up to {max_lines} corpus lines per domain; "
             + (f"branches further pretrained {args.steps} steps (--steps; the product's defaults: " if args.steps else
                "branches with the product's defaults (`hmi domain create`: ")
             + f"mlm {FPTConfig(objective='mlm').steps} steps, distill {FPTConfig().steps} steps). Each tenant: {n_train} "
             f"training examples, {describe_adapter({})} with a head on the token mean for classification and on each "
             f"word's first token for tagging, 4 epochs, best dev epoch, learning "
             f"rate {lr_text(lrs)}, trained "
             f"and tested on the chain it is served with (branch -> root -> back-off); one run per seed, the same seeds "
             f"on every chain. test-set SE: the binomial standard error of one accuracy on {n_test} test texts or fewer "
             f"(for tagging, on the test sentences' words, as if each word were independent: a lower bound).")
    finish(result_name("bench_domains", args) + ("_grid" if args.grid else ""), text, res,
           "python benchmarks/bench_domains.py" + (" --quick" if args.quick else "")
           + (f" --domains {args.domains}" if args.domains else "") + (f" --seeds {args.seeds}" if args.seeds else "")
           + (f" --variants {args.variants}" if args.variants != ",".join(VARIANTS) else "")
           + (f" --steps {args.steps}" if args.steps else "") + (" --grid" if args.grid else "")
           + root_flags(args))


if __name__ == "__main__":
    main()
