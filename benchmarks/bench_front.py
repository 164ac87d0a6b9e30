"""The accuracy-throughput front: every way hBERT can serve a root as one point (average test
accuracy on the four tasks against requests / s at 100 tenants through the scheduler), beside
hBERT-adapter (the full root with a per-tenant adapter: the plain alternative) and the frozen root
with a head per tenant.

Throughput is measured here, every configuration side by side in one run: rounds in which the
configurations alternate, each round on requests of its own (batches of 32 texts of the four
tasks' test and dev splits, at most 128 tokens, from 100 tenants drawn uniformly), never a text
twice in the run; the median round is the point.  Configurations of hBERT (the miss policy, what
the PLOT has kept, the hot tier):

- ``backoff``: the paper's, the root PLOT as built (hot tier off, and on: ``backoff+hot``);
- ``learned``: each missed tri-gram estimated by the root PLOT's learned back-off (when trained;
  with the hot tier: ``learned+hot``);
- ``learned+compute``: the same, with the misses whose back-off would reach the uni-gram computed
  (its accuracy: eval_accuracy's ``--schemes hBERT-learned-compute``, "-" where the record lacks it);
- ``compute``: every miss computed, nothing kept;
- ``compute+insert cold``: misses computed and kept (``hmi.plot.kept``), on a copy of the root
  PLOT that has kept nothing yet;
- ``compute+insert tenants``: after the tenants' training texts were kept (their fine-tunes
  keep them);
- ``compute+insert warm``: after also a stream of unlabeled text from the tasks' own domains
  (their prepared corpora, which hold no dev or test text), ``--stream`` lines per domain;
- ``learned, distilled, auto`` (and ``learned+compute``, ``learned+hot``, ``backoff``,
  ``backoff+hot, distilled, auto``): tenants fine-tuned with ``"serving": "auto"``: those of a task whose record chose whole
  (eval_accuracy's served-auto column of that miss policy's students, ``res.tasks.*.serving``; a
  task's tenants in turn as its seeds chose, where they differ) served on the full root with their
  adapter in every layer, the others on the windows as that configuration serves them.
- ``--branches`` adds ``learned, on branches`` and ``learned, distilled, auto, on branches``: the
  same, each tenant served on its task's domain branch (news, reviews, social, literature: made
  by ``hmi domain create``), the chain branch -> root PLOT, their accuracy from the record of
  ``eval_accuracy.py --branches`` (every task on its branch).

Accuracy is not measured here: it is the eval_accuracy record of the same root artifact (the fair
bar: every scheme's learning rate chosen on dev; ``make paper-table`` for mpnet-base 6+6,
``eval_accuracy.py --quick --train 640 --test 1000 --pooling mean --exact --learned --grid`` for
the default root).  A miss policy fixes what a text is answered with: ``compute`` and every
``compute+insert`` state answer every text with its exact windows (the kept ones in the PLOT's
value format, which is how eval_accuracy's exact-windows column reads them too only up to int8
rounding: 0.0002 of pooled cosine, ``docs/results/bench_plot_formats.md``), so they share that column;
how warm the PLOT is changes their speed alone.  Also the hit-rate curve: the share of the test
texts' distinct tri-grams the PLOT holds as the stream goes on.

Usage: python benchmarks/bench_front.py [--quick] [--stream N] [--rounds N] [--accuracy PAGE [--speed-only]] [--branches]
                                        [--root minilm-l6|mpnet-base|PATH] [--l-low N]
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_tenants import FullContextLower, SharedRoot, direct_rps, scheduler_rps  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DOCS,
    adapter_variants,
    cut_texts,
    finish,
    machine,
    page_header,
    plot_page_suffix,
    prepared_root,
    provenance,
    result_name,
    root_flags,
    root_options,
    start,
    table,
)
from benchmarks.eval_accuracy import (  # noqa: E402
    ARTIFACT_FREE,
    HBERT_AUTO,
    HBERT_AUTO_BACKOFF,
    HBERT_AUTO_COMPUTE,
    HBERT_BACKOFF_DISTILLED,
    HBERT_DISTILLED,
    HBERT_DISTILLED_COMPUTE,
    HBERT_EXACT,
    HBERT_LEARNED,
    HBERT_LEARNED_COMPUTE,
    task_chain,
)
from hmi.data import TASK_DOMAIN, is_tagging  # noqa: E402
from hmi.model.aliases import auto_miss_policy  # noqa: E402
from hmi.model.root import ROOT_PACKAGE  # noqa: E402
from hmi.services.server import ServerConfig  # noqa: E402

TENANTS, B, MAX_LEN = 100, 32, 128
# tenants served as `"serving": "auto"` chooses (whole_modes), the others on a miss policy: config -> that policy
AUTO, AUTO_COMPUTE = "learned, distilled, auto", "learned+compute, distilled, auto"
AUTO_BACKOFF, AUTO_HOT = "backoff, distilled, auto", "backoff+hot, distilled, auto"
AUTO_LEARNED_HOT = "learned+hot, distilled, auto"
# ``--branches``: configurations whose tenants are each served on its task's domain branch (the chain branch ->
# root, as `hmi domain create` makes it and a tenant of that domain is served), named with this suffix
BRANCHES = ", on branches"
LEARNED_BRANCHES, AUTO_BRANCHES = "learned" + BRANCHES, AUTO + BRANCHES
AUTO_POLICY = {AUTO: "learned", AUTO_COMPUTE: "learned+compute", AUTO_BACKOFF: "backoff", AUTO_HOT: "backoff+hot",
               AUTO_LEARNED_HOT: "learned+hot", AUTO_BRANCHES: LEARNED_BRANCHES}
TASKS = ["news-topic", "review-sentiment", "tweet-sentiment", "pos-tagging"]
TRAIN_PER_TASK = 640  # the tenants' training texts: eval_accuracy's fair bar trains on 640 per task
# each configuration's column of the eval_accuracy record
COLUMN = {"backoff": "hBERT", "backoff+hot": "hBERT", "learned": HBERT_LEARNED, "learned+hot": HBERT_LEARNED,
          "learned+compute": HBERT_LEARNED_COMPUTE,
          "compute": HBERT_EXACT, "compute+insert cold": HBERT_EXACT, "compute+insert tenants": HBERT_EXACT,
          "compute+insert warm": HBERT_EXACT, "hBERT-adapter": "hBERT-adapter", "shared": "shared",
          "learned, distilled": HBERT_DISTILLED, "learned+compute, distilled": HBERT_DISTILLED_COMPUTE,
          "backoff, distilled": HBERT_BACKOFF_DISTILLED, "backoff+hot, distilled": HBERT_BACKOFF_DISTILLED,
          "learned+hot, distilled": HBERT_DISTILLED,
          AUTO: HBERT_AUTO, AUTO_COMPUTE: HBERT_AUTO_COMPUTE, AUTO_BACKOFF: HBERT_AUTO_BACKOFF,
          AUTO_HOT: HBERT_AUTO_BACKOFF, AUTO_LEARNED_HOT: HBERT_AUTO,
          # the columns of the accuracy record whose PLOT columns were served on the branches (eval_accuracy --branches)
          LEARNED_BRANCHES: HBERT_LEARNED + BRANCHES, "learned, distilled" + BRANCHES: HBERT_DISTILLED + BRANCHES,
          AUTO_BRANCHES: HBERT_AUTO + BRANCHES}
# Configurations served exactly as a measured one, their adapters trained otherwise (the fine-tune's
# distillation): that one's requests/s, their own accuracy.
SERVED_AS = {"learned, distilled": "learned", "learned+compute, distilled": "learned+compute",
             "backoff, distilled": "backoff", "backoff+hot, distilled": "backoff+hot",
             "learned+hot, distilled": "learned+hot", "learned, distilled" + BRANCHES: LEARNED_BRANCHES}
RECORDS = Path(__file__).resolve().parents[1] / "docs" / "results"  # the accuracy records read (DOCS is where this run writes)
NEEDED = ("dedicated", "shared", "hBERT-adapter", "hBERT", HBERT_EXACT)
# Columns that never read the windows (every weight of the root, its head alone, adapters on the full-context
# root; eval_accuracy's ARTIFACT_FREE that the front needs): the same for every split and artifact of one
# root, so a split's own record may take them from another.
SPLIT_FREE = tuple(c for c in ARTIFACT_FREE if c in NEEDED)
WINDOWED = tuple(c for c in NEEDED if c not in SPLIT_FREE)  # a split's own record holds one of them at least
RECIPE = ("root", "l_low", "steps")  # what two calibrations of one recipe share (eval_accuracy record keys)
# The columns that read the windows (every one but the split-free): taken from a page of their own when the
# front's record lacks them (those eval_accuracy measures only on request, and a windowed column that
# another run of the artifact measured); a column no page holds leaves its points without accuracy.
OPTIONAL = tuple(dict.fromkeys(c for c in COLUMN.values() if c not in SPLIT_FREE and not c.endswith(BRANCHES)))


def _records(pages: list[Path]) -> list[tuple[str, dict]]:
    """(page name, JSON record) of each finished eval_accuracy page among ``pages`` with all four tasks."""
    out = []
    for path in pages:
        m = re.search(r"```json\n(.*?)\n```", path.read_text(), re.S)
        rec = json.loads(m.group(1)) if m else {}
        if "unfinished" not in rec and set(TASKS) <= set(rec.get("tasks", {})):
            out.append((path.stem, rec))
    return out


def _comparable(a: dict, b: dict) -> bool:
    """Whether two records' tables were made the same way: one root, a root PLOT of the same text,
    the same training and test examples per task, heads pooled alike, learning rates chosen on dev
    alike."""
    return (a.get("root") == b.get("root") and plot_of(a) == plot_of(b) and a.get("pooling") == b.get("pooling")
            and a.get("lr_grid") == b.get("lr_grid")
            and all((a["tasks"][t]["train"], a["tasks"][t]["test"]) == (b["tasks"][t]["train"], b["tasks"][t]["test"])
                    for t in TASKS))


def plot_of(rec: dict) -> str:
    """The corpus an eval_accuracy record's root PLOT was built from (records before it was
    recorded: ``general``, the corpus ``hmi prepare`` builds from)."""
    return rec.get("plot_corpus", "general")


def same_recipe(rec: dict, served: dict) -> bool:
    """Whether an eval_accuracy record's artifact is another calibration of the served artifact's
    recipe: the same root, split and calibration steps (``served``: those keys of the served one)."""
    return all(rec.get(k) is not None and rec.get(k) == served.get(k) for k in RECIPE)


def speed_only_record(page: str, served: dict, plot_from: str) -> tuple[str, str | None, dict]:
    """``--speed-only``: the accuracy of the named page's own artifact (its columns, and those other
    pages of that artifact hold), which must be a calibration of the served root and split, of any
    length (``served``: the served artifact's RECIPE keys)."""
    path = RECORDS / f"{page}.md"
    rec = dict(_records([path])).get(page) if path.is_file() else None
    if rec is None:
        raise SystemExit(f"--speed-only: no finished eval_accuracy page {page} in docs/results")
    if (rec.get("root"), rec.get("l_low")) != (served["root"], served["l_low"]):
        raise SystemExit(f"--speed-only: {page} is of {rec.get('root')} split at {rec.get('l_low')}, not of the served "
                         f"{served['root']} split at {served['l_low']}")
    return accuracy_record(rec["root_artifact"], page, plot_from=plot_from)


def accuracy_record(artifact: str, page: str | None, split_free_page: str | None = None,
                    served: dict | None = None, plot_from: str = "general") -> tuple[str, str | None, dict]:
    """(page name, the page its split-free columns come from or None, the record) with every column
    the front needs for ``artifact``: the page named, else that artifact's page with the most of
    them (the learned back-off's too); it holds one windowed column at least, and the others come
    from other pages of the artifact where they hold them (``with_optional``). A page named may
    hold another artifact of the served one's recipe (``served``, ``same_recipe``): one calibrated
    on another machine, whose bits this machine's kernels do not repeat; requests/s do not depend
    on the windows' values. When the artifact's pages lack the split-free columns (``SPLIT_FREE``),
    they come from a comparable page of another split or calibration of the same root. Only pages
    of a root PLOT built from ``plot_from`` count."""
    every = [(name, rec) for name, rec in _records(sorted(RECORDS.glob("eval_accuracy*.md")))  # every page read once
             if plot_of(rec) == plot_from]
    found = [(name, rec) for name, rec in every if not rec.get("branches")]  # the root PLOT's columns
    branched = [(name, rec) for name, rec in every if rec.get("branches")]
    complete = [(name, rec) for name, rec in found if any(c in rec["average"] for c in WINDOWED)]
    mine = [(name, rec) for name, rec in complete if page in (None, name)
            and (rec.get("root_artifact") == artifact or (page is not None and served and same_recipe(rec, served)))]
    if not mine:
        kin = [name for name, rec in complete if served and same_recipe(rec, served)]
        raise SystemExit(f"no finished eval_accuracy record of artifact {artifact} with a column of {', '.join(WINDOWED)} "
                         "in docs/: run `python benchmarks/eval_accuracy.py --quick --train 640 --test 1000 --pooling "
                         "mean --exact --learned --grid` (with this root's --root/--l-low) first"
                         + (f", or name a record of another calibration of the same recipe ({', '.join(kin)}) with "
                            "--accuracy" if kin and page is None else ""))
    rank = (lambda r: (all(c in r["average"] for c in NEEDED), all(c in r["average"] for c in WINDOWED),
                       r.get("lr_grid", False), len(r["average"])))
    name, rec = max(mine, key=lambda m: rank(m[1]))
    if all(c in rec["average"] for c in NEEDED):
        return name, None, with_branches(with_seeds(with_optional(rec, found, artifact, served), found, artifact, served),
                                         branched, artifact, served)
    others = [(n, r) for n, r in found if split_free_page in (None, n)
              and all(c in r["average"] for c in SPLIT_FREE) and _comparable(r, rec)]
    if not others:
        raise SystemExit(f"{name} has no {', '.join(SPLIT_FREE)} columns, and no comparable record of {rec.get('root')} "
                         "has them: run eval_accuracy with every scheme on any split of this root first")
    free_name, free = max(others, key=lambda m: (m[1].get("lr_grid", False), len(m[1]["average"])))
    merged = {**rec, "average": {**{c: free["average"][c] for c in SPLIT_FREE}, **rec["average"]},
              "tasks": {t: {**{c: free["tasks"][t][c] for c in SPLIT_FREE}, **rec["tasks"][t]} for t in TASKS}}
    return name, free_name, with_branches(with_seeds(with_optional(merged, found, artifact, served), found, artifact,
                                                     served), branched, artifact, served)


def with_optional(rec: dict, found: list[tuple[str, dict]], artifact: str, served: dict | None) -> dict:
    """``rec`` with each ``OPTIONAL`` column it lacks taken from a comparable page (``_comparable``)
    of the served artifact or of another calibration of its recipe, the page named per column in
    ``column_records``."""
    for col in OPTIONAL:
        if col in rec["average"]:
            continue
        more = [(n, r) for n, r in found if col in r["average"] and _comparable(r, rec)
                and (r.get("root_artifact") == artifact or (served and same_recipe(r, served)))]
        if more:
            rec = with_columns(rec, *max(more, key=lambda m: (m[1].get("root_artifact") == artifact,
                                                               m[1].get("lr_grid", False))), [col])
    return rec


def _branch_cost(branch: dict) -> str:
    """What making a branch took, as its version tree recorded it (empty for a record without it)."""
    secs = branch.get("seconds") or {}
    if "mib" not in branch or None in (secs.get("further_pretraining"), secs.get("plot")):
        return ""
    took = [f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s" for s in (secs["further_pretraining"], secs["plot"])]
    return f" ({branch['mib']:,} MiB; made in {took[0]} of distillation and {took[1]} of PLOT build)"


def with_branches(rec: dict, branched: list[tuple[str, dict]], artifact: str, served: dict | None) -> dict:
    """``rec`` with the windowed columns of a comparable record whose PLOT columns were served on each
    task's domain branch (eval_accuracy ``--branches``) of the served artifact or of another
    calibration of its recipe, each named with ``BRANCHES`` (``column_records`` names the page), the
    record's task -> branch in ``branches``; the record of the most seeds (its columns are their means)."""
    mine = [(n, r) for n, r in branched if _comparable(r, rec)
            and (r.get("root_artifact") == artifact or (served and same_recipe(r, served)))]
    if not mine:
        return rec
    name, r = max(mine, key=lambda m: (m[1].get("root_artifact") == artifact, m[1].get("seeds", 1), len(m[1]["average"])))
    cols = [c for c in r["average"] if c not in ARTIFACT_FREE]
    renamed = {"root_artifact": r.get("root_artifact"),
               "average": {c + BRANCHES: r["average"][c] for c in cols},
               "tasks": {t: {**{c + BRANCHES: r["tasks"][t][c] for c in cols},
                             "serving": {c + BRANCHES: m for c, m in r["tasks"][t].get("serving", {}).items()}}
                         for t in TASKS}}
    out = with_columns(rec, name, renamed, [c + BRANCHES for c in cols])
    seeds = {c + BRANCHES: r["seeds"] for c in cols} if r.get("seeds", 1) > 1 else {}
    return {**out, "branches": r["branches"], "column_seeds": {**rec.get("column_seeds", {}), **seeds}}


def with_columns(rec: dict, name: str, other: dict, cols: list[str]) -> dict:
    """``rec`` with columns ``cols`` (averages and per task) taken from the record ``other`` of
    page ``name``, which ``column_records`` names for each."""
    def serving(t: str) -> dict:  # how a served-auto column served each task comes with it
        taken = {c: m for c, m in other["tasks"][t].get("serving", {}).items() if c in cols}
        return {"serving": {**rec["tasks"][t].get("serving", {}), **taken}} if taken else {}

    return {**rec, "average": {**rec["average"], **{c: other["average"][c] for c in cols}},
            "tasks": {t: {**rec["tasks"][t], **{c: other["tasks"][t][c] for c in cols}, **serving(t)} for t in TASKS},
            "column_records": {**rec.get("column_records", {}), **{c: [name, other.get("root_artifact")] for c in cols}}}


def request_texts(tokenizer, seed: int) -> dict[str, list[str]]:
    """Per task, its test and dev texts cut to ``MAX_LEN`` tokens, shuffled: requests never repeat."""
    from hmi.data import load_task

    rng = np.random.default_rng(seed)
    out = {}
    for task in TASKS:
        rows = load_task(task, "test") + load_task(task, "dev")
        texts = [r["text"] if "text" in r else " ".join(r["tokens"]) for r in rows]
        texts = cut_texts(tokenizer, texts, MAX_LEN)
        out[task] = [texts[i] for i in rng.permutation(len(texts))]
    return out


def make_traces(texts: dict[str, list[str]], n_batches: int, n: int, seed: int) -> list[tuple[list[list[int]], list[str]]]:
    """``n`` traces of ``n_batches`` batches of tenant indices (uniform over ``TENANTS``; tenant
    ``t`` serves task ``t % 4``) with one text per request: each text in one request of one trace."""
    rng = np.random.default_rng(seed)
    used = dict.fromkeys(TASKS, 0)
    out = []
    for _ in range(n):
        tenants = rng.integers(0, TENANTS, size=n_batches * B)
        reqs = []
        for t in tenants:
            task = TASKS[t % len(TASKS)]
            if used[task] >= len(texts[task]):
                raise SystemExit(f"{task}: its {len(texts[task])} test and dev texts do not cover {n} traces of "
                                 f"{n_batches} batches (each text is sent once): use fewer --rounds or --batches")
            reqs.append(texts[task][used[task]])
            used[task] += 1
        out.append(([tenants[i * B:(i + 1) * B].tolist() for i in range(n_batches)], reqs))
    return out


def domain_of(config: str, tenant: int) -> str:
    """The domain a configuration serves tenant number ``tenant`` in (its task's, ``t % 4``, on
    branches; the root's otherwise)."""
    return TASK_DOMAIN[TASKS[tenant % len(TASKS)]] if config.endswith(BRANCHES) else "root"


def whole_modes(acc: dict, column: str) -> dict[str, list[str]]:
    """Per task whose tenants ``"serving": "auto"`` serves on the full root on some seed of the
    accuracy record ``acc`` (the served-auto ``column``'s choice, ``tasks.*.serving``: one mode, or
    one per seed), the mode of each seed: a task's tenants are served as its seeds chose, in turn
    (``served_whole``), so the requests/s are of the mix the column's mean scores."""
    out = {}
    for t in TASKS:
        modes = acc["tasks"][t].get("serving", {}).get(column, "windows")
        modes = [modes] if isinstance(modes, str) else list(modes)
        if "whole" in modes:
            out[t] = modes
    return out


def served_whole(modes: dict[str, list[str]], tenant: int) -> bool:
    """Whether the front's ``tenant`` (its task ``TASKS[tenant % 4]``, the k-th tenant of that task for
    k = tenant // 4) is served whole: as seed ``k % seeds`` of its task chose (``whole_modes``)."""
    chosen = modes.get(TASKS[tenant % len(TASKS)])
    return chosen is not None and chosen[(tenant // len(TASKS)) % len(chosen)] == "whole"


def whole_share(modes: dict[str, list[str]]) -> dict[str, float]:
    """Of each task served whole on some seed, the share of its tenants served whole (``served_whole``)."""
    of_task = {t: [i for i in range(TENANTS) if TASKS[i % len(TASKS)] == t] for t in modes}
    return {t: round(sum(served_whole(modes, i) for i in rows) / len(rows), 4) for t, rows in of_task.items()}


def copy_plot(src, dst: Path):
    """A copy of the open PLOT ``src`` (LMDB's own, compacted), opened writable: what
    compute+insert may keep in."""
    from hmi.plot.store import PlotStore

    dst.mkdir(parents=True)
    src.env.copy(str(dst), compact=True)
    return PlotStore(dst, readonly=False)


def hit_rate(keys: np.ndarray, *stores) -> float:
    """The share of ``keys`` (distinct tri-grams) that one of the PLOTs ``stores`` (one, or a chain's) holds."""
    if not len(keys):
        return 0.0
    held = np.zeros(len(keys), dtype=bool)
    for store in stores:
        held |= store.get_many(keys)[1].astype(bool)
    return float(held.mean())


def asked_of(traces) -> dict[str, list[str]]:
    """Per task, the texts the traces send its tenants (tenant ``t`` serves task ``t % 4``)."""
    out: dict[str, list[str]] = {t: [] for t in TASKS}
    for batches, reqs in traces:
        for tenant, text in zip((t for batch in batches for t in batch), reqs):
            out[TASKS[tenant % len(TASKS)]].append(text)
    return out


def main() -> None:
    def options(ap):
        ap.add_argument("--stream", type=int, default=None,
                        help="unlabeled lines per task domain kept before 'compute+insert warm' (default 4000; 200 "
                             "with --quick)")
        ap.add_argument("--rounds", type=int, default=None, help="rounds of alternating configurations (default 3)")
        ap.add_argument("--batches", type=int, default=None, help="measured batches per configuration and round "
                                                                  "(default 8; 2 with --quick)")
        ap.add_argument("--render", action="store_true",
                        help="write the page again from its record (docs/bench_front*.md): no measuring")
        ap.add_argument("--accuracy", help="the eval_accuracy page (docs/<PAGE>.md) whose record gives the accuracy "
                                           "(default: the finished one of this artifact with the most columns); "
                                           "it may hold another calibration of this artifact's recipe (root, split, "
                                           "steps), made on a machine whose kernels round otherwise")
        ap.add_argument("--speed-only", action="store_true",
                        help="with --accuracy: that record may hold a calibration of this root and split of any "
                             "length; this artifact (a short calibration, say) gives the requests/s alone, which do not "
                             "depend on the windows' values (the same PLOT keys from the same corpus, value sizes, "
                             "layers and learned back-off width)")
        ap.add_argument("--branches", action="store_true",
                        help="also serve each tenant on its task's domain branch (news, reviews, social, literature: "
                             "`hmi domain create DOMAIN --corpus DOMAIN` first): the points '" + LEARNED_BRANCHES
                             + "' and '" + AUTO_BRANCHES + "', whose accuracy is the record of eval_accuracy --branches")
        root_options(ap)

    args = start(__doc__, options)
    if args.render:
        return render(result_name("bench_front", args))
    stream = args.stream if args.stream is not None else (200 if args.quick else 4000)
    rounds = args.rounds or 3
    n_batches = (args.batches or (2 if args.quick else 8)) + 1  # the first batch of each warms the scheduler
    if stream < 0 or rounds < 1 or n_batches < 2:
        raise SystemExit("--stream must be 0 or more, --rounds and --batches at least 1")

    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore
    from hmi.data import load_corpus, load_task
    from hmi.plot import learned
    from hmi.plot.build import plot_corpus
    from hmi.plot.hot import attach_hot_tier
    from hmi.plot.kept import Keeper, keep_texts
    from hmi.plot.keys import encoder_windows, pack, unique_windows
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants, TenantEntry
    from hmi.version_tree.tree import VersionTree

    root, version = prepared_root(root=args.root, l_low=args.l_low)
    # --branches: each task's chain (its domain's branch, then the root PLOT) and the branch; refused here if missing
    tree = VersionTree(root, root_version=version) if args.branches else None
    branch_of = {t: task_chain(tree, version, t, root_flags(args)) for t in TASKS} if tree is not None else {}
    served = {"root": root.spec.name, "l_low": root.spec.l_low,
              "steps": root.meta.get("calibration", {}).get("steps_done")}
    if args.speed_only and not args.accuracy:
        raise SystemExit("--speed-only needs --accuracy: the record of the calibration whose accuracy the points take")
    plot_from = plot_corpus(version.store)
    acc_page, free_page, acc = (speed_only_record(args.accuracy, served, plot_from) if args.speed_only else
                                accuracy_record(root.artifact_id, args.accuracy, served=served, plot_from=plot_from))
    tok, bert, l_low = root.tokenizer, root.bert, root.spec.l_low
    texts = request_texts(tok, seed=0)
    *traces, first = make_traces(texts, n_batches, rounds + 1, seed=1)  # the last: the process's first batches
    tmp = Path(tempfile.mkdtemp(prefix="hmi-bench-front-"))
    lookups: dict = {}
    out: dict = {"root": root.spec.name, "root_source": root.spec.source, "l_low": l_low, "artifact": root.artifact_id,
                 "steps": served["steps"], "plot_corpus": plot_from, "speed_only": args.speed_only,
                 "accuracy_record": acc_page, "accuracy_artifact": acc["root_artifact"],
                 "split_free_record": free_page,
                 "tenants": TENANTS, "rounds": rounds, "measured_batches": n_batches - 1, "stream_lines_per_domain": stream}
    try:
        spec = AdapterSpec.for_task("classification", tuple("abcde"))
        store = AdapterStore(tmp / "adapters", host_cache_mb=1024)
        variants = adapter_variants(bert, l_low, spec, 8, seed=1)
        entries = {f"t{i:05d}": TenantEntry(f"t{i:05d}", spec) for i in range(TENANTS)}
        for i in range(TENANTS):
            store.save(f"t{i:05d}", spec, variants[i % len(variants)])
            store.load(f"t{i:05d}")  # adapters in host memory; each scheduler's device pool starts cold

        def windows_of(lines: list[str]) -> np.ndarray:
            enc = tok(lines, truncation=True, max_length=MAX_LEN, padding=True, return_tensors="np")
            uniq, _ = unique_windows(encoder_windows(enc["input_ids"], enc["attention_mask"]), enc["attention_mask"])
            return pack(uniq)

        # Lookups of every configuration, each over the PLOT state it names.
        test_keys = windows_of([t for _, reqs in traces for t in reqs])  # what the rounds will ask
        lookups.update({"backoff": PlotLookup([version], "backoff"), "compute": PlotLookup([version], "compute")})
        hot_version = PlotVersion("root", version.store, version.encoder)
        t0 = time.perf_counter()
        hot = attach_hot_tier(hot_version, tok, load_corpus("general", 20_000), 512.0)
        out["hot_tier"] = {"entries": len(hot), "mb": round(hot.nbytes / 2**20, 1),
                           "seconds": round(time.perf_counter() - t0, 1)}
        lookups["backoff+hot"] = PlotLookup([hot_version], "backoff")
        learned.place_shipped(version.store, root)  # as `hmi serve` does before it serves
        if learned.load(version.store.path) is not None:
            lookups["learned"] = PlotLookup([version], "learned")
            lookups["learned+hot"] = PlotLookup([hot_version], "learned")
            lookups["learned+compute"] = PlotLookup([version], "learned+compute")
        else:
            out["learned"] = f"not measured: the root PLOT has no learned back-off (`hmi plot learn-backoff{root_flags(args)}`)"
        # each domain's tenants served through its chain, as a tenant of that domain is
        chains = {TASK_DOMAIN[t]: PlotLookup(chain, "learned") for t, (chain, _) in branch_of.items()} if "learned" in lookups else {}
        if chains:
            lookups[LEARNED_BRANCHES] = lookups["learned"]  # never read: every tenant's domain has its chain
            asked, out["branches"] = asked_of(traces), {}
            for t, (chain, branch) in branch_of.items():
                keys = windows_of(asked[t])
                out["branches"][t] = {"domain": branch["name"], "entries": branch["entries"], "plot": branch["plot"],
                                      "mib": branch["mib"], "seconds": branch["seconds"],
                                      # the share of the task's asked distinct tri-grams the root PLOT holds, and its chain
                                      "hit_rate_root": round(hit_rate(keys, version.store), 4),
                                      "hit_rate_chain": round(hit_rate(keys, *(v.store for v in chain)), 4)}
        train = [r["text"] if "text" in r else " ".join(r["tokens"])
                 for task in TASKS for r in load_task(task, "train", TRAIN_PER_TASK)]
        curve, kept_cost = [], {}
        for state in ("cold", "tenants", "warm"):
            plot = copy_plot(version.store, tmp / f"plot-{state}")
            lk = PlotLookup([PlotVersion("root", plot, version.encoder)], "compute+insert", keeper=Keeper())
            if state == "cold":
                curve.append({"stream_lines": 0, "tenant_texts": False, "hit_rate": round(hit_rate(test_keys, plot), 4)})
            if state in ("tenants", "warm"):
                t0, before = time.perf_counter(), len(plot)
                keep_texts(lk, tok, train, MAX_LEN, chunk=256)
                kept_cost = {"texts": len(train), "entries": len(plot) - before,
                             "bytes": (len(plot) - before) * plot.meta.value_bytes,
                             "seconds": round(time.perf_counter() - t0, 1)}
                if state == "tenants":
                    curve.append({"stream_lines": 0, "tenant_texts": True, "hit_rate": round(hit_rate(test_keys, plot), 4)})
            if state == "warm":
                lines = {task: load_corpus(TASK_DOMAIN[task], stream) for task in TASKS}
                step = max(1, stream // 4)
                for s in range(0, stream, step):
                    keep_texts(lk, tok, [ln for task in TASKS for ln in lines[task][s:s + step]], MAX_LEN, chunk=256)
                    curve.append({"stream_lines": min(stream, s + step), "tenant_texts": True,
                                  "hit_rate": round(hit_rate(test_keys, plot), 4)})
                    print(f"stream: {curve[-1]['stream_lines']} of {stream} lines per domain kept, hit rate "
                          f"{curve[-1]['hit_rate']}", flush=True)
            lookups[f"compute+insert {state}"] = lk
            print(f"compute+insert {state}: {len(plot)} entries, {plot.kept_count()} kept", flush=True)
        out["hit_rate_curve"] = curve
        out["tenant_windows_cost"] = kept_cost

        whole = replace(spec, whole=True)
        whole_variants = adapter_variants(bert, l_low, whole, 8, seed=1)
        served_auto: dict = {}  # config -> (its tenants' entries, their store)
        for config, policy in AUTO_POLICY.items():
            if policy not in lookups or COLUMN[config] not in acc["average"]:
                continue
            modes = whole_modes(acc, COLUMN[config])
            out.setdefault("whole_share", {})[config] = whole_share(modes)
            auto_store = AdapterStore(tmp / f"adapters-{policy}-auto", host_cache_mb=1024)
            auto_entries = {}
            for i in range(TENANTS):
                name, is_whole = f"t{i:05d}", served_whole(modes, i)
                auto_entries[name] = TenantEntry(name, whole if is_whole else spec, domain_of(config, i))
                auto_store.save(name, auto_entries[name].spec, (whole_variants if is_whole else variants)[i % 8])
                auto_store.load(name)
            served_auto[config] = (auto_entries, auto_store)
            lookups[config] = lookups[policy]
        full_lower = FullContextLower(bert, l_low)
        shared = SharedRoot(bert, TENANTS)
        on_branches = {n: replace(e, domain=domain_of(LEARNED_BRANCHES, i)) for i, (n, e) in enumerate(entries.items())}

        def rps(config: str, trace) -> float:
            batches, reqs = trace
            if config == "shared":
                return direct_rps(shared, tok, reqs, batches, 1)
            lower = full_lower if config == "hBERT-adapter" else lookups[config]
            branched = config.endswith(BRANCHES)
            ents, adapters = served_auto.get(config, (on_branches if branched else entries, store))
            s = Scheduler(bert, l_low, tok, adapters, FixedTenants(ents), FixedTenants(ents, lower, chains if branched else {}),
                          SchedulerConfig(max_batch=B, pool_slots=64, pipeline_retrieval=config != "hBERT-adapter"))
            try:
                return scheduler_rps(s, reqs, batches, 1)
            finally:
                s.shutdown()

        configs = list(lookups) + ["hBERT-adapter", "shared"]
        # the process's first batches pay one-off costs (kernels, allocator, first PLOT pages)
        for config in ("backoff", "hBERT-adapter", *([LEARNED_BRANCHES] if chains else [])):  # the branches' first pages
            rps(config, first)
        measured: dict = {c: [] for c in configs}
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for config in order:
                measured[config].append(round(rps(config, traces[r]), 2))
            print(f"round {r + 1}: " + ", ".join(f"{c} {measured[c][-1]}" for c in configs), flush=True)
    finally:
        for lk in lookups.values():
            if lk.keeper is not None:
                lk.keeper.close()
        shutil.rmtree(tmp, ignore_errors=True)

    out.update({"configs": configs, "measured": measured, "root_name": root.spec.name,
                "split": [l_low, bert.config.num_hidden_layers - l_low], "measured_at": provenance()})
    out["default_config"] = served_by_default(out)
    command = ("python benchmarks/bench_front.py" + (" --quick" if args.quick else "")
               + (f" --stream {args.stream}" if args.stream is not None else "")
               + (f" --rounds {args.rounds}" if args.rounds else "") + (f" --batches {args.batches}" if args.batches else "")
               + (f" --accuracy {args.accuracy}" if args.accuracy else "")
               + (" --speed-only" if args.speed_only else "") + (" --branches" if args.branches else "") + root_flags(args))
    try:
        # the page names the commit and date the record took when the measurement ended, before any output was written
        page = result_name("bench_front", args) + plot_page_suffix(plot_from)
        report(out, acc, page, command, (machine(), out["measured_at"]))
    except Exception:
        print(json.dumps(out), flush=True)  # the measurement outlives a failure to write its page
        raise


def with_seeds(rec: dict, found: list[tuple[str, dict]], artifact: str, served: dict | None) -> dict:
    """``rec`` with every column that a finished, comparable record of several seeds holds replaced by
    its mean over those seeds (seed 0 of such a record is the one-seed table's run, so the mean is the
    better estimate of the same column), per task too; the page in ``column_records``, the number of
    seeds in ``column_seeds``, each seed's average over the tasks in ``per_seed``.  The record of
    the most seeds wins."""
    many = [(n, r) for n, r in found if r.get("seeds", 1) > 1 and _comparable(r, rec)
            and (r.get("root_artifact") == artifact or (served and same_recipe(r, served)))]
    if not many:
        return rec
    n, r = max(many, key=lambda m: (m[1]["seeds"], len(m[1]["average"])))
    cols = list(r["average"])
    return {**with_columns(rec, n, r, cols), "column_seeds": dict.fromkeys(cols, r["seeds"]),
            "per_seed": {c: r["average_per_seed"][c] for c in cols}}


def shares_of(out: dict, config: str) -> dict[str, float]:
    """The share of each task's tenants the run served whole in ``config`` (a record from before
    ``whole_share`` served every tenant of the tasks it names whole)."""
    if "whole_share" in out:
        return out["whole_share"][config]
    return {t: 1.0 for t in out["whole_tasks"][config]}


def whole_text(shares: dict[str, float]) -> str:
    """``whole_share``'s tasks in words: 'the tenants of A, 50% of the tenants of B'."""
    parts = [f"the tenants of {t}" if share == 1 else f"{share:.0%} of the tenants of {t}" for t, share in shares.items()]
    return ", ".join(parts) or "the tenants of no task"


def report(out: dict, acc: dict, name: str, command: str, header: tuple[str, str] | None = None) -> None:
    """The page and record of a run: its measured requests/s (``out["measured"]``) against the
    accuracy record ``acc``, and the keys derived from both (``header``: the machine and date of
    the run, kept by a page written again)."""
    configs = out["configs"] + [c for c, like in SERVED_AS.items() if like in out["configs"] and COLUMN[c] in acc["average"]]
    for c in (c for c in AUTO_POLICY if c in configs):  # its requests/s hold only for the tenants it served whole
        chosen, was = whole_share(whole_modes(acc, COLUMN[c])), shares_of(out, c)
        if chosen != was:
            raise SystemExit(f"'{c}' was measured with {whole_text(was)} served whole, but the accuracy record now "
                             f"chooses {whole_text(chosen)}: measure the front again (a --render cannot)")
    measured = {**out["measured"], **{c: out["measured"][SERVED_AS[c]] for c in configs if c in SERVED_AS}}
    adapter_rps = statistics.median(measured["hBERT-adapter"])
    avg, tasks = acc["average"], acc["tasks"]
    points = []
    for config in configs:
        col = COLUMN[config]
        point = {"config": config, "rps": round(statistics.median(measured[config]), 2), "rounds": measured[config],
                 "accuracy": avg.get(col), "accuracy_column": col,
                 "per_task": {t: tasks[t].get(col) for t in TASKS}}
        point["over_adapter"] = round(point["rps"] / adapter_rps, 3)
        # each round against hBERT-adapter's of the same round: what drifts between rounds cancels
        point["over_adapter_paired"] = round(statistics.median(
            [a / b for a, b in zip(measured[config], measured["hBERT-adapter"])]), 3)
        points.append(point)
    out["points"] = points
    out["over_adapter"] = {p["config"]: p["over_adapter"] for p in points}  # by name, for claims
    out["column_records"] = acc.get("column_records", {})
    fair = avg["dedicated"]
    fast = [p for p in points if p["config"] not in ("hBERT-adapter", "shared") and p["accuracy"] is not None
            and p["over_adapter"] >= 1.5]
    best = max(fast, key=lambda p: p["accuracy"], default=None)
    out["fair_bar"] = fair
    out["best_at_1_5x"] = best["config"] if best else None
    out["gap_to_adapter_at_1_5x"] = round(avg["hBERT-adapter"] - best["accuracy"], 2) if best else None
    per_seed = acc.get("per_seed", {})
    out["column_seeds"] = acc.get("column_seeds", {})
    served = out["default_config"]
    if ServerConfig.distil:  # hmi serve's fine-tunes distil by default: what it serves is the distilled point
        served = next((c for c, like in SERVED_AS.items() if like == served and c in configs), served)
        auto = next((a for a, policy in AUTO_POLICY.items() if policy == SERVED_AS.get(served)), None)
        if ServerConfig.serving == "auto" and auto in configs:
            served = auto  # and serve whole where the teacher leads on dev
    out["default_served"] = served
    default = next(p for p in points if p["config"] == served)
    out.update(standing(default, acc, "default_served", ""))
    # the same fine-tunes served with each tenant on its task's domain branch, where the run measured them
    # and a record gives their accuracy
    branched = next((p for p in points if p["config"] == served + BRANCHES and p["accuracy"] is not None), None)
    for key in [k for k in out if k.startswith(("default_on_branches", "below_shared_on_branches", "below_shared_by_branches"))]:
        out.pop(key)  # a page written again from a record whose branch columns are gone
    if branched:
        out.update({"default_on_branches": branched["config"], **standing(branched, acc, "default_on_branches", "_branches")})
    # the same gaps seed by seed, where one record of several seeds holds both columns
    for key, point, bar in (("gap_to_adapter_at_1_5x", best, "hBERT-adapter"),
                            ("default_served_gap_vs_full_ft", default, "dedicated"),
                            ("default_served_gap_vs_adapter", default, "hBERT-adapter")):
        col = point["accuracy_column"] if point else None
        if col in per_seed and bar in per_seed and acc["column_records"][col] == acc["column_records"][bar]:
            out[f"{key}_per_seed"] = [round(a - b, 2) for a, b in zip(per_seed[bar], per_seed[col])]
        else:
            out.pop(f"{key}_per_seed", None)
    curve, kept_cost = out["hit_rate_curve"], out["tenant_windows_cost"]
    out["warm_hit_rate"] = curve[-1]["hit_rate"]

    rows = [(p["config"], f"{p['rps']:.1f}", f"{p['over_adapter']:.2f}", f"{p['over_adapter_paired']:.2f}",
             f"{p['accuracy']:.2f}" if p["accuracy"] else "-",
             f"{p['accuracy'] - fair:+.2f}" if p["accuracy"] else "-",
             *(f"{p['per_task'][t]:.1f}" if p["per_task"][t] is not None else "-" for t in TASKS)) for p in points]
    low, up = out["split"]
    text = (f"Root: {out['root_name']}, split {low}+{up} (artifact {out['artifact']}); {TENANTS} tenants drawn "
            f"uniformly, batches of {B} texts of at most {MAX_LEN} tokens.\n\n"
            + table(rows, ("configuration", "requests/s", "over hBERT-adapter", "round by round", "avg accuracy",
                           "vs fair bar", *TASKS)) + "\n\n")
    text += (f"Requests / s: the median of {out['rounds']} rounds of {out['measured_batches']} measured batches each "
             "(after one), the configurations alternating, every round on texts of its own (test and dev texts of the "
             "four tasks, none twice); over hBERT-adapter: the ratio of the medians; round by round: the median of "
             f"the ratios to hBERT-adapter's requests/s in the same round. Accuracy: test accuracy in % from the record of "
             f"`docs/results/{out['accuracy_record']}.md`"
             + (f" (artifact {out['accuracy_artifact']}, {acc.get('steps')} calibration steps; the requests/s were "
                f"measured on {out['artifact']}, a calibration of the same root and split of {out['steps']} steps made "
                "for them alone: requests/s do not depend on the windows' values, only on the PLOT's keys (the same "
                "corpus), the values' sizes, the layers and the learned back-off's width)"
                if out.get("speed_only") and out.get("accuracy_artifact", out["artifact"]) != out["artifact"] else
                f" (artifact {out['accuracy_artifact']}: the same recipe, {out['steps']} steps, calibrated on another "
                f"machine, whose kernels round otherwise; this machine's calibration gave {out['artifact']}, whose "
                "windows cost the same to serve: the same PLOT keys, value sizes and layers)"
                if out.get("accuracy_artifact", out["artifact"]) != out["artifact"] else "")
             + (f" (dedicated, shared and hBERT-adapter, which never read the windows, from "
                f"`docs/results/{out['split_free_record']}.md`, another split or calibration of this root)" if out.get("split_free_record")
                else "")
             + "".join(f" (column '{c}' from `docs/results/{n}.md`, artifact {a}"
                       + (f", the mean over {acc['column_seeds'][c]} seeds" if c in acc.get("column_seeds", {}) else "")
                       + ")" for c, (n, a) in acc.get("column_records", {}).items())
             + f" (the fair bar, dedicated: {fair}); every compute and compute+insert state answers a text with its exact "
             "windows (column 'hBERT, exact windows'), however warm the PLOT is."
             + "".join(f" {c}: served as {like} is, the adapters trained otherwise, so its requests/s are {like}'s."
                       for c, like in SERVED_AS.items() if c in configs)
             + "".join(f" {c}: {whole_text(shares_of(out, c))} served on the full root "
                       "with their adapter in every layer (as `\"serving\": \"auto\"` chose for those tasks), the "
                       f"others as '{AUTO_POLICY[c]}, distilled'; its accuracy is column '{COLUMN[c]}'."
                       for c in AUTO_POLICY if c in configs) + "\n\n")
    text += (f"Best configuration at >= 1.5x hBERT-adapter's requests/s: {out['best_at_1_5x']}, "
             f"gap to hBERT-adapter {out['gap_to_adapter_at_1_5x']} points. Served by default ({served}"
             + (": the miss policy and distilled fine-tunes" if served in SERVED_AS else "") + "): "
             + standing_text(out, tasks, "default_served", "")
             + "".join(f" {what} seed by seed: {', '.join(str(g) for g in out[key + '_per_seed'])}."
                       for key, what in _per_seed_gaps(out)) + "\n\n")
    if "branches" in out:
        text += (f"Configurations '...{BRANCHES}': each task's tenants served on its domain's branch ("
                 + "; ".join(f"{t}: {b['domain']}, {b['entries']:,} entries" + _branch_cost(b)
                             + (f", holding with the root PLOT {b['hit_rate_chain']:.1%} of the distinct tri-grams its "
                                f"tenants were asked, against the root PLOT's {b['hit_rate_root']:.1%}"
                                if "hit_rate_chain" in b else "") for t, b in out["branches"].items())
                 + "), the chain branch -> root PLOT with the root's learned back-off for what neither holds, as "
                 "`hmi domain create` makes a branch and a tenant of its domain is served; the accuracy of those points "
                 "is the record of eval_accuracy `--branches` named above (the same fine-tunes, their windows on the "
                 "branches)."
                 + (f" Served by default on the branches ({out['default_on_branches']}): "
                    + standing_text(out, tasks, "default_on_branches", "_branches")
                    if "default_on_branches" in out else f" The default's fine-tunes on the branches ('{served + BRANCHES}') "
                    "are no point of this run: it needs a finished record of eval_accuracy --branches with all four "
                    "tasks, which it did not have.") + "\n\n")
    text += ("### Hit rate of the test texts' distinct tri-grams in the PLOT\n\n"
             + table([(c["stream_lines"], "yes" if c["tenant_texts"] else "no", f"{c['hit_rate']:.3f}") for c in curve],
                     ("unlabeled lines per domain kept", "tenants' training texts kept", "hit rate")) + "\n\n")
    text += (f"The tenants' training texts ({kept_cost.get('texts')} of the four tasks, {TRAIN_PER_TASK} each) added "
             f"{kept_cost.get('entries')} windows ({(kept_cost.get('bytes') or 0) / 2**20:.1f} MiB) in "
             f"{kept_cost.get('seconds')} s; tenants of one domain share its PLOT, so what one tenant's texts keep "
             "serves the others' requests too.")
    if "learned" in out:
        text += f"\n\nlearned: {out['learned']}."
    plot_front(points, DOCS / f"{name}.png", out["root_name"], fair)
    finish(name, text, out, command, header)


def _per_seed_gaps(out: dict) -> list[tuple[str, str]]:
    """The per-seed gaps the page states (key, what it is): the best point's and the default's to
    hBERT-adapter said once where they are the same figures (the best at 1.5x serves the default's
    fine-tunes)."""
    same = out.get("gap_to_adapter_at_1_5x_per_seed") == out.get("default_served_gap_vs_adapter_per_seed")
    gaps = [("gap_to_adapter_at_1_5x", "Gap to hBERT-adapter of the best at 1.5x and of the default (the same "
             "fine-tunes)" if same else "Gap to hBERT-adapter"),
            ("default_served_gap_vs_full_ft", "Gap of the default to the fair bar")]
    if not same:
        gaps.append(("default_served_gap_vs_adapter", "Gap of the default to hBERT-adapter"))
    return [(key, what) for key, what in gaps if key + "_per_seed" in out]


def standing(point: dict, acc: dict, name: str, suffix: str) -> dict:
    """The keys of where a served point stands (``name``: what it is, ``suffix``: that of its
    below-shared keys): its requests/s over hBERT-adapter's, its gaps to the fair bar and to
    hBERT-adapter, and the tasks it serves under the frozen root with a head, by how much."""
    avg, tasks, col = acc["average"], acc["tasks"], point["accuracy_column"]
    below = [t for t in TASKS if tasks[t][col] < tasks[t]["shared"]]
    return {f"{name}_gap_vs_full_ft": round(avg["dedicated"] - point["accuracy"], 2),
            f"{name}_gap_vs_adapter": round(avg["hBERT-adapter"] - point["accuracy"], 2),
            f"{name}_over_adapter": point["over_adapter"],
            f"below_shared_on{suffix}": below,
            f"below_shared_by{suffix}": {t: round(tasks[t]["shared"] - tasks[t][col], 2) for t in below}}


def standing_text(out: dict, tasks: dict, name: str, suffix: str) -> str:
    """The page's sentence of ``standing``'s keys in ``out``."""
    below = out[f"below_shared_by{suffix}"]
    return (f"{out[name + '_over_adapter']:.2f}x hBERT-adapter's requests/s, {out[name + '_gap_vs_adapter']} points "
            f"under hBERT-adapter and {out[name + '_gap_vs_full_ft']} under the fair bar; below the frozen root with a "
            f"head on {', '.join(_below(t, below[t], tasks[t]) for t in below) or 'no task'}.")


def _below(task: str, points: float, acc: dict) -> str:
    """How far the default serves a task under the frozen root with a head, in points and, for a
    classification task, in test texts (what one split of that size can tell apart)."""
    n = acc.get("test")
    if is_tagging(task) or not n:
        return f"{task} (by {points} points)"
    return f"{task} (by {points} points: about {round(points * n / 100)} of its {n} test texts)"


def render(name: str) -> None:
    """``--render``: the page written again from its record (the measured requests/s kept, the
    accuracy record read again, the derived keys and text as this code makes them)."""
    page = (DOCS / f"{name}.md").read_text()
    out = json.loads(re.search(r"```json\n(.*?)\n```", page, re.S).group(1))
    command = re.search(r"Command: `(.*?)`", page).group(1)
    if out.get("speed_only"):
        _, _, acc = speed_only_record(out["accuracy_record"], out, out.get("plot_corpus", "general"))
    else:
        _, _, acc = accuracy_record(out["artifact"], out["accuracy_record"], out.get("split_free_record"),
                                    served={k: out.get(k) for k in RECIPE}, plot_from=out.get("plot_corpus", "general"))
    where, when = page_header(page)  # the page keeps the machine and date it was measured on
    out["default_config"] = served_by_default(out)
    report(out, acc, name, command, (where, out.get("measured_at", when)))


def served_by_default(out: dict) -> str:
    """What ``hmi serve`` serves without flags today on the root and split of the record ``out``:
    the root's choice (``auto_miss_policy``) where the record's root PLOT had a learned back-off (it
    measured ``learned``), else ``backoff``."""
    if "learned" not in out["configs"]:
        return "backoff"
    # records before ``root_source``: the default root is named by its package, any other by its source
    source = out.get("root_source", None if out["root"].startswith(ROOT_PACKAGE + "==") else out["root"])
    return auto_miss_policy(source, out["l_low"])


def plot_front(points: list[dict], png: Path, root: str, fair: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in points:
        if p["accuracy"] is None:
            continue
        ours = p["config"] not in ("hBERT-adapter", "shared")
        ax.scatter(p["rps"], p["accuracy"], marker="o" if ours else "s", color="C0" if ours else "C3")
        ax.annotate(p["config"], (p["rps"], p["accuracy"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(fair, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("requests / s at 100 tenants")
    ax.set_ylabel("average test accuracy, % (four tasks)")
    ax.set_title(f"{root}: accuracy against throughput (dotted: full fine-tuning)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
