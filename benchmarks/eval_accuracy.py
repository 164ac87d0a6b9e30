"""Test accuracy of every multi-tenant scheme on real tasks (one of them a tagging task), the
paper's Table 3 analog: dedicated (full fine-tuning of the root), shared (frozen root, a trained
head), compress (the root's first 2 layers, fully fine-tuned), hBERT-adapter (adapters on the
full-context root) and hBERT (PLOT + adapters, as served; also with exact windows, i.e. every
PLOT miss computed, which separates the cost of windowing from the cost of PLOT back-off).

Protocol: every scheme sees the same training examples for the same number of epochs (the best
epoch on dev is kept). Its learning rate is chosen per task on dev from a small grid (``GRIDS``,
the paper's protocol; ``--grid``, the default of the full run): full fine-tuning 1e-4, 5e-5 and
2e-5, adapters (on the full-context root and on the PLOT alike) 3e-3 and 1e-3, heads 3e-3, 1e-2
and 1e-3, the 2-layer student 5e-4 and 1e-4; the choice is in the JSON (``tasks.*.lr``).  Without
the grid (the default of ``--quick``) each scheme trains at the first rate of its grid
(``--dedicated-lr 1e-4,2e-5`` sets full fine-tuning's own, ``--shared-lr`` the head's).  ``--quick`` trains on 224 examples per task
(``--train N`` sets another count) for 4 epochs with texts cut to 64 tokens; the full run on up to
4,000 for 5 epochs at 128 tokens and adds hBERT with exact windows.

A classification head reads the [CLS] vector or the mean of the text's tokens (the pooling the root
was trained with); by default every scheme trains both on every classification task and keeps the
one with the better dev accuracy (``--pooling cls``, the default with ``--quick``, or ``mean`` trains
one).  A tagging head reads every token.

One seed moves a task's accuracy by a point or more; ``--seeds N`` trains every cell with N seeds
(seed 0's cells are the one-seed table's, read back) and reports each figure as the mean over
seeds with its standard deviation, on a page of its own (``_seeds-N``).

``--schemes`` and ``--tasks`` run a subset (e.g. how the gap moves with ``--train``); such a run writes
docs/results/eval_accuracy_partial.md (``--tasks``: docs/eval_accuracy_partial_<tasks>[_train-N].md) and leaves the full
table alone.

Usage: python benchmarks/eval_accuracy.py [--quick] [--train N] [--test N] [--exact] [--pooling dev|mean|cls]
                                          [--schemes hBERT,dedicated,...] [--tasks news-topic,...]
                                          [--root minilm-l6|mpnet-base|PATH] [--l-low N]
                                          [--grid|--no-grid] [--seeds N] [--transfer N] [--distil-weight W]
                                          [--distil-epochs E] [--distil-start new|teacher] [--probe-first E]
                                          [--head-lr LR]
                                          [--branches] [--max-minutes M] [--report-only] [--fresh]

``--branches`` serves each task's PLOT columns on its domain's branch (news, reviews, social,
literature; ``hmi domain create DOMAIN --corpus DOMAIN`` first), as the server serves a tenant of that
domain: the branch's PLOT, then the root's, then back-off, and the branch's lower layers for what is
computed.  The columns that read no PLOT (the full-context ones) are the root's and read back as such.

Long runs: every training run (one per task, scheme, pooling and learning rate) is kept under
``$HMI_HOME/runs/eval_accuracy/`` when it ends, and the same command run again reads the finished
ones back, so a stopped table continues where it stopped; ``--max-minutes M`` ends one invocation
after M minutes (exit code 75, the finished tasks on the page), ``--report-only`` trains nothing
and writes the page of what is finished, ``--fresh`` starts over.  The columns that read neither the
windows nor the split (``ARTIFACT_FREE``: full fine-tuning, the frozen root with a head, the 2-layer
student, hBERT-adapter) are read back from the recorded cells of any table of the same root and
settings, whatever its artifact (not with ``--fresh``).

On another root than the default the results page is docs/eval_accuracy_<root>.md (and
docs/eval_accuracy_partial_<root>.md); its JSON names the root.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cells import Cells, digest  # noqa: E402
from benchmarks.common import (  # noqa: E402
    DOCS,
    adapter_options,
    describe_adapter,
    finish,
    plot_page_suffix,
    prepared_root,
    result_name,
    root_flags,
    root_options,
    start,
    table,
)
from hmi.timelimit import EXIT_UNFINISHED, OutOfTime  # noqa: E402
from hmi.training.distil import Distillation  # noqa: E402
from hmi.training.finetune import GRID_LRS  # noqa: E402
from hmi.training.full_context import COMPRESS_LAYERS, PROBE_LR, train_full_context  # noqa: E402
from hmi.training.serving import WHOLE_MARGIN  # noqa: E402

if TYPE_CHECKING:
    from hmi.adapters.spec import AdapterSpec

# The upper layers' adapters on the full-context root, trained as hBERT-adapter is (the adapters
# library's model): what the lower layers' adapters are worth there (on request: --schemes
# hBERT-adapter-upper; HBERT_FULL is the same with hBERT's own trainer).
ADAPTER_UPPER = "hBERT-adapter, upper layers"
SCHEMES = [("dedicated", "full", 1e-4), ("shared", "head", 3e-3), ("compress", "compress", 5e-4),
           ("hBERT-adapter", "adapter", 3e-3), (ADAPTER_UPPER, "upper", 3e-3)]
HBERT_LR = GRID_LRS[0]
# ``--grid``: each scheme's learning rates, the one with the best dev accuracy kept per task (the
# paper's protocol); the first is the scheme's single rate without it. The adapters' grid is the
# same on the full-context root and on the PLOT (hBERT-adapter, hBERT), and the one a tenant's fine-tune and
# its teacher choose from on dev (GRID_LRS), so that the product serves what these columns report.
GRIDS = {"dedicated": (1e-4, 5e-5, 2e-5), "shared": (3e-3, 1e-2, 1e-3), "compress": (5e-4, 1e-4),
         "hBERT-adapter": GRID_LRS, ADAPTER_UPPER: GRID_LRS, "hBERT": GRID_LRS}
# schemes whose learning rates a flag sets (--dedicated-lr, --shared-lr): scheme -> argparse attribute
LR_FLAGS = {"dedicated": "dedicated_lr", "shared": "shared_lr"}
# schemes --head-lr leaves alone: every weight at one rate, or the head alone
HEAD_LR_FREE = ("dedicated", "shared", "compress")
# Bumped when a cell's training changes, so that cells of earlier code are not read back.
CELL_FORMAT = 1
# Columns that read neither the windows nor the split (every weight of the root, its head alone, the first
# two layers, adapters in every layer): one cell serves every calibrated artifact and split of a root, so a
# table of a new artifact reads them from the records of the root's others (``artifact_free``).
ARTIFACT_FREE = ("dedicated", "shared", "compress", "hBERT-adapter")
# what a table's configuration names that such a column does not depend on
WINDOWS_CONFIG = ("root_artifact", "l_low", "plot")
TASKS = ["news-topic", "review-sentiment", "tweet-sentiment", "pos-tagging"]  # the four every table averages
# tasks outside the four, on request (--tasks): how a default chosen on the four does elsewhere
OTHER_TASKS = ["license-category"]
HBERT_EXACT = "hBERT, exact windows"
HBERT_LEARNED = "hBERT, learned back-off"
# the learned back-off with the misses that would fall to the uni-gram computed (on request:
# --schemes hBERT-learned-compute; `--miss-policy learned+compute`)
HBERT_LEARNED_COMPUTE = "hBERT, learned back-off, uni-gram misses computed"
# hBERT's adapters and trainer on the full-context lower layers' output: perfect windows, the
# ceiling of every PLOT scheme at the split (on request: --schemes hBERT-full).
HBERT_FULL = "hBERT, full-context lower layers"
# the learned back-off's adapters distilled from hBERT-adapter's (the teacher: its pooling and learning
# rate chosen on dev) on the training texts and --transfer unlabeled lines of the task's domain corpus
# (on request: --schemes hBERT-distilled; `distil` on a fine-tune job)
HBERT_DISTILLED = "hBERT, learned back-off, distilled"
# the same distillation with the uni-gram misses computed (on request: --schemes hBERT-distilled-compute;
# `--miss-policy learned+compute` with `distil`)
HBERT_DISTILLED_COMPUTE = "hBERT, learned back-off, uni-gram misses computed, distilled"
# the same distillation with every miss backed off as the paper does (on request: --schemes
# hBERT-backoff-distilled; `--miss-policy backoff` with `distil`)
HBERT_BACKOFF_DISTILLED = "hBERT, back-off, distilled"
# the same distillation on the full-context lower layers' output: perfect windows, the ceiling of every
# distilled PLOT scheme at the split (on request: --schemes hBERT-full-distilled)
HBERT_FULL_DISTILLED = "hBERT, full-context lower layers, distilled"
# each tenant served as `"serving": "auto"` serves it (``hmi.training.serving.choose_serving``): the teacher
# (hBERT-adapter) where it leads a distilled student on dev by more than WHOLE_MARGIN, else that student;
# per seed, from the two columns' cells (a table with both has it; AUTO_OF: the student -> the column)
HBERT_AUTO = "hBERT, distilled, served auto"
HBERT_AUTO_COMPUTE = "hBERT, uni-gram misses computed, distilled, served auto"
HBERT_AUTO_BACKOFF = "hBERT, back-off, distilled, served auto"
AUTO_OF = {HBERT_DISTILLED: HBERT_AUTO, HBERT_DISTILLED_COMPUTE: HBERT_AUTO_COMPUTE,
           HBERT_BACKOFF_DISTILLED: HBERT_AUTO_BACKOFF}
# scheme -> miss policy served ("full": the full-context lower layers, no PLOT)
DISTILLED = {HBERT_DISTILLED: "learned", HBERT_DISTILLED_COMPUTE: "learned+compute", HBERT_BACKOFF_DISTILLED: "backoff",
             HBERT_FULL_DISTILLED: "full"}
DISTIL_WEIGHT = Distillation.weight  # the teacher's weight in a distilled fine-tune's loss (--distil-weight)
# (column, the record's key of its average gap to dedicated, how the page's sentence of gaps names it)
GAP_KEYS = [("hBERT", "avg_gap_vs_full_ft", "hBERT"),
            (HBERT_EXACT, "avg_gap_exact_windows_vs_full_ft", "with exact windows"),
            (HBERT_LEARNED, "avg_gap_learned_backoff_vs_full_ft", "with the learned back-off"),
            (HBERT_LEARNED_COMPUTE, "avg_gap_learned_compute_vs_full_ft",
             "with the learned back-off and every uni-gram miss computed"),
            (HBERT_DISTILLED, "avg_gap_distilled_vs_full_ft", "with the learned back-off, distilled"),
            (HBERT_DISTILLED_COMPUTE, "avg_gap_distilled_compute_vs_full_ft",
             "with the learned back-off and every uni-gram miss computed, distilled"),
            (HBERT_BACKOFF_DISTILLED, "avg_gap_backoff_distilled_vs_full_ft", "with the back-off, distilled"),
            (HBERT_AUTO, "avg_gap_served_auto_vs_full_ft", "distilled, served auto"),
            (HBERT_AUTO_COMPUTE, "avg_gap_served_auto_compute_vs_full_ft",
             "with the uni-gram misses computed, distilled, served auto"),
            (HBERT_AUTO_BACKOFF, "avg_gap_served_auto_backoff_vs_full_ft", "with the back-off, distilled, served auto")]
ALL_SCHEMES = [name for name, _, _ in SCHEMES] + ["hBERT", HBERT_EXACT, HBERT_LEARNED, HBERT_LEARNED_COMPUTE, HBERT_FULL,
                                                  HBERT_DISTILLED, HBERT_DISTILLED_COMPUTE, HBERT_BACKOFF_DISTILLED,
                                                  HBERT_FULL_DISTILLED]
# what a column beyond the full table adds to its page's name, in the name's order
PAGE_SUFFIXES = [(ADAPTER_UPPER, "_upper"), (HBERT_FULL, "_full"), (HBERT_BACKOFF_DISTILLED, "_backoff-distilled"),
                 (HBERT_FULL_DISTILLED, "_full-distilled"), (HBERT_LEARNED, "_learned"),
                 (HBERT_LEARNED_COMPUTE, "_learned-compute"), (HBERT_DISTILLED, "_distilled"),
                 (HBERT_DISTILLED_COMPUTE, "_distilled-compute")]
# --schemes names without a comma
SCHEME_FLAGS = {"hBERT-exact": HBERT_EXACT, "hBERT-learned": HBERT_LEARNED, "hBERT-learned-compute": HBERT_LEARNED_COMPUTE,
                "hBERT-adapter-upper": ADAPTER_UPPER,
                "hBERT-full": HBERT_FULL, "hBERT-distilled": HBERT_DISTILLED,
                "hBERT-distilled-compute": HBERT_DISTILLED_COMPUTE, "hBERT-full-distilled": HBERT_FULL_DISTILLED,
                "hBERT-backoff-distilled": HBERT_BACKOFF_DISTILLED}


def page_suffix(columns: list[str]) -> str:
    """What the columns beyond the full table add to a page's name, in ``PAGE_SUFFIXES``' order
    whatever the order of ``columns``."""
    return "".join(suffix for scheme, suffix in PAGE_SUFFIXES if scheme in columns)


def chosen_tasks(arg: str | None) -> list[str]:
    """The tasks of ``--tasks``: the four every table averages when absent; a task outside them
    (``OTHER_TASKS``) only when named."""
    return list(TASKS) if arg is None else subset(arg, TASKS + OTHER_TASKS, "--tasks")


def default_schemes(quick: bool, exact: bool, learned: bool) -> list[str]:
    """The columns of a run without --schemes, the full table: every scheme of ``SCHEMES`` but the
    upper-layers adapter, and hBERT; the exact windows unless --quick (then with --exact), the
    learned back-off with --learned; the other hBERT schemes only when named."""
    return [s for s in ALL_SCHEMES if (s != HBERT_EXACT or exact or not quick) and (s != HBERT_LEARNED or learned)
            and s not in (ADAPTER_UPPER, HBERT_FULL, HBERT_LEARNED_COMPUTE, *DISTILLED)]


def partial_table(schemes: list[str], tasks: list[str], full_table: list[str]) -> bool:
    """Whether a run of ``schemes`` on ``tasks`` makes a partial page: it lacks a column of the full
    table (``full_table``: schemes named beyond it do not make up for one missing) or runs other
    tasks than the four."""
    return not set(full_table) <= set(schemes) or set(tasks) != set(TASKS)


def subset(arg: str, known: list[str], flag: str) -> list[str]:
    """The comma-separated names of ``arg``, in ``known``'s order."""
    names = [SCHEME_FLAGS.get(a.strip(), a.strip()) for a in arg.split(",") if a.strip()]
    unknown = [a for a in names if a not in known]
    if unknown or not names:
        flags = {v: k for k, v in SCHEME_FLAGS.items()}
        raise SystemExit(f"{flag}: unknown {unknown or 'empty list'}; use names from: "
                         + ", ".join(flags.get(k, k) for k in known))
    return [k for k in known if k in names]


def learning_rates(arg: str) -> tuple[float, ...]:
    """``--dedicated-lr``: one learning rate or several, comma-separated, each in (0, 1); checked
    while the arguments are parsed, before the root is loaded."""
    import argparse

    try:
        out = tuple(float(x) for x in arg.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected learning rates like 1e-4 or 1e-4,2e-5, got {arg!r}") from None
    bad = [x for x in out if not 0 < x < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"a learning rate must be in (0, 1), got {bad[0]:g}")
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"learning rates must be distinct, got {arg!r}")
    return out


def scheme_descriptions(columns: list[str], lrs: dict, n_layers: int, l_low: int, transfer: int,
                        bf16: bool, weight: float = DISTIL_WEIGHT) -> list[tuple[str, str]]:
    """What each of the page's columns trains, in the columns' order (a scheme the run left out is not described)."""
    upper = n_layers - l_low
    lr = {label: f" (lr {lr_text(lrs[label])})" if label in lrs else "" for label in columns}
    what = {
        "dedicated": f"every weight of the root{lr.get('dedicated', '')}",
        "shared": f"the head alone on the frozen root{lr.get('shared', '')}",
        "compress": f"the root's first {COMPRESS_LAYERS} layers, every weight{lr.get('compress', '')}",
        "hBERT-adapter": f"the adapters in all {n_layers} layers of the full-context root{lr.get('hBERT-adapter', '')}",
        "hBERT": f"the adapters in the upper {upper} layers on the merged PLOT representations, reading the root PLOT "
                 f"with back-off as served{lr.get('hBERT', '')}",
        ADAPTER_UPPER: f"the adapters in the upper {upper} layers of the full-context root, trained as hBERT-adapter "
                       f"is{lr.get(ADAPTER_UPPER, '')}",
        HBERT_EXACT: "hBERT with every PLOT miss computed by the windowed lower layers (`--miss-policy compute`)",
        HBERT_LEARNED: "hBERT with each missed tri-gram served the root PLOT's learned back-off (`hmi plot "
                       "learn-backoff`, `--miss-policy learned`; its products in "
                       + ("bf16, as served on a CPU that multiplies bf16 natively)" if bf16 else "fp32)"),
        HBERT_LEARNED_COMPUTE: "the learned back-off, with each missed tri-gram whose bi-gram the PLOT does not hold "
                               "either computed by the windowed lower layers (`--miss-policy learned+compute`)",
        HBERT_FULL: f"the adapters in the upper {upper} layers on the full-context lower layers' output (perfect "
                    "windows: the ceiling of every PLOT scheme at this split)",
        HBERT_DISTILLED: f"the learned back-off's adapters trained on the training texts and {transfer} unlabeled "
                         "lines of the task's domain corpus against the answers of hBERT-adapter (the adapters in all "
                         f"{n_layers} layers of the full-context root, its pooling and learning rate chosen on dev, "
                         "the model of that cell, or one trained alike where the cell was read back) as well as the "
                         "labels, at the teacher's pooling (as a tenant's distilled fine-tune trains)"
                         + (f" (the teacher's answers weighted {weight:g}, the labels {1 - weight:g})"
                            if weight != DISTIL_WEIGHT else "") + " (`hmi.training.distil`)",
        HBERT_DISTILLED_COMPUTE: "the same distillation (the same teacher) with the uni-gram misses computed "
                                 "(`--miss-policy learned+compute`)",
        HBERT_BACKOFF_DISTILLED: "the same distillation (the same teacher) with every miss backed off as the paper "
                                 "does (`--miss-policy backoff`)",
        HBERT_FULL_DISTILLED: "the same distillation (the same teacher) on the full-context lower layers' output "
                              "(perfect windows: the ceiling of every distilled PLOT scheme at this split)",
        **{auto: "each seed's tenant as `\"serving\": \"auto\"` serves it: hBERT-adapter (its teacher, served on "
                 f"the full root) where its dev accuracy leads {student}'s by more than {WHOLE_MARGIN:g}, else that "
                 "distilled adapter (res.tasks.*.serving)" for student, auto in AUTO_OF.items()},
    }
    return [(label, what[label]) for label in columns if label in what]


def cell_key(task: str, train: int, label: str, learned_id: str | None, bf16: bool, transfer: int,
             distil_weight: float, distil_epochs: int | None, branch: list | None = None,
             distil_start: str = "new", probe_first: int = 0, head_lr: float | None = None) -> dict:
    """The key of a scheme's cells on a task (its pooling, learning rate and seed are added per cell):
    whatever else makes two runs of the scheme differ, so that a run reads back only its own cells.
    ``learned_id`` names the learned back-off a scheme reads (None: it reads none); ``distil_epochs`` the
    distilled students' epochs where they differ from the table's (None: the table's, as every
    earlier run's key has it); ``branch`` the domain branch whose chain a scheme reads (its name and
    PLOT fingerprint; None: the root PLOT alone, as every earlier run's key has it); ``distil_start``
    where a distilled student starts ("teacher": its teacher's upper layers; "new", as every earlier
    run's key has it); ``probe_first`` the epochs hBERT-adapter (and so every teacher) trains its head
    alone first (0: none, as every earlier run's key has it); ``head_lr`` the head's own rate in the
    adapter schemes (None: their learning rate, as every earlier run's key has it)."""
    key = {"task": task, "train": train, "scheme": label}
    if head_lr is not None and label not in HEAD_LR_FREE:
        key["head_lr"] = head_lr
    if branch is not None:
        key["branch"] = branch
    if probe_first and label == "hBERT-adapter":
        key["probe_first"] = probe_first
    if learned_id is not None:
        key["learned_backoff"] = learned_id
        if bf16:  # its products in bf16, as served on this CPU: another run than fp32's
            key["learned_bf16"] = True
    if label in DISTILLED:
        key["transfer"] = transfer
        key["distil"] = [Distillation.temperature, distil_weight]
        if distil_epochs:
            key["distil_epochs"] = distil_epochs
        if distil_start != "new":
            key["distil_start"] = distil_start
        if probe_first:
            key["teacher_probe_first"] = probe_first
        if head_lr is not None:
            key["teacher_head_lr"] = head_lr
    return key


def artifact_free(config: dict):
    """``Cells``' ``adopt`` for the table of ``config``: a cell of another table of the same root and
    settings whose column reads neither the windows nor the split (``ARTIFACT_FREE``)."""
    mine = {k: v for k, v in config.items() if k not in WINDOWS_CONFIG}

    def adopt(other: dict, key: dict) -> bool:
        return key.get("scheme") in ARTIFACT_FREE and {k: v for k, v in other.items() if k not in WINDOWS_CONFIG} == mine
    return adopt


def task_chain(tree, version, task: str, flags: str) -> tuple[list, dict | None]:
    """The PLOT chain ``task``'s PLOT columns are served on: the root PLOT ``version`` alone, or with
    ``--branches`` (``tree``, the root's ``VersionTree``) the chain of the task's domain (its branch,
    the branch's ancestors, the root), as a tenant of that domain is served; with the branch for the
    cells' keys and the page (None without one)."""
    from hmi.data import TASK_DOMAIN
    from hmi.training.further_pretrain import summary

    if tree is None:
        return [version], None
    domain = TASK_DOMAIN[task]
    node = tree.nodes().get(domain)
    if node is None:
        raise SystemExit(f"--branches serves {task} on the domain branch {domain!r}, which this root has not: "
                         f"create it with `hmi domain create {domain} --corpus {domain}{flags}`")
    chain = [tree.version(name) for name in tree.chain(domain)]
    built = chain[0].store.get_record("build") or {}
    return chain, {"name": domain, "plot": built.get("fingerprint"), "entries": node.plot.get("entries"),
                   "mib": round(node.plot.get("file_bytes", 0) / 2**20), "further_pretraining": summary(node.fpt),
                   # what making the branch took (`hmi domain create`, as recorded in the version tree)
                   "seconds": {"further_pretraining": node.fpt.get("seconds"), "plot": node.plot.get("build_seconds")}}


def seeded_cells(cells: Cells, key: dict, seeds, options, train) -> list[tuple[tuple, dict]]:
    """Per seed, the option (pooling, learning rate) whose cell has the best dev accuracy, with that
    cell's result: every option of ``options`` (a list, or the seed -> its list) is trained with
    ``train(option, seed)`` (or read back from ``cells``).  Seed 0's cells carry no seed in their
    key: they are the one-seed table's."""
    picks = []
    for seed in seeds:
        seeded = {**key, "seed": seed} if seed else key
        tried = {o: cells.run({**seeded, "pooling": o[0], "lr": o[1]}, lambda o=o, seed=seed: train(o, seed))
                 for o in (options(seed) if callable(options) else options)}
        best = max(tried, key=lambda o: tried[o]["dev"])
        picks.append((best, tried[best], sum(r["seconds"] for r in tried.values())))
    return picks


def kept_teacher(cells: Cells, key: dict, train: Callable[[], dict]) -> tuple[Callable, Callable[[], dict]]:
    """A distilled column's teacher (hBERT-adapter at its setting, ``key``), trained by ``train()``
    (``train_full_context``'s dict) where first needed, and its answers kept in the run's folder
    (``Cells.tensors``): every student of the task, and a run continued after a stop, reads them
    back instead of training the teacher again.  Returns the answers (a ``Teacher``) and the trained
    teacher's dict (trained on call)."""
    trained: dict = {}

    def model() -> dict:
        if not trained:
            with torch.enable_grad():  # first needed where a student asks for answers, without grad
                trained.update(train())
        return trained

    def answers(examples) -> list[torch.Tensor]:
        return cells.tensors({**key, "answers_to": digest([e.ids for e in examples])},
                             lambda: [t.float() for t in model()["teacher"](examples)])

    return answers, model


class TrainedAdapters:
    """hBERT-adapter's models (``train_full_context``'s dicts) as this invocation trained them for the
    cells a distilled column's teacher is chosen among, kept until the teacher is chosen: the chosen
    one is the teacher, not trained again (the training is seeded, so training it again gives the
    same model; a run continued after a stop, whose cells are read back, does train it again).
    ``train(spec, lr, seed)`` trains one."""

    def __init__(self, train: Callable[[AdapterSpec, float, int], dict]):
        self.train, self.kept = train, {}

    def trained_for_cell(self, spec: AdapterSpec, lr: float, seed: int) -> dict:
        """Trains the model of a cell and keeps it for ``teacher``."""
        self.kept[(spec, lr, seed)] = out = self.train(spec, lr, seed)
        return out

    def teacher(self, spec: AdapterSpec, lr: float, seed: int) -> Callable[[], dict]:
        """``kept_teacher``'s ``train`` for the teacher at (``spec``, ``lr``) of ``seed``: the kept model
        where its cell ran in this invocation, else one trained on call. The seed's other kept models
        are let go."""
        chosen = self.kept.pop((spec, lr, seed), None)
        for k in [k for k in self.kept if k[2] == seed]:
            del self.kept[k]
        return lambda: chosen if chosen is not None else self.train(spec, lr, seed)


def served_auto(teacher: list[dict], student: list[dict]) -> list[tuple[str, float]]:
    """Per seed, how ``"serving": "auto"`` serves the tenant (``choose_serving`` on the two cells'
    dev accuracy) and the test accuracy it then gets: ``teacher`` (hBERT-adapter) and ``student``
    (the distilled adapter) are the seeds' chosen cells, ``{"dev", "test"}`` each."""
    from hmi.training.serving import choose_serving

    out = []
    for t, s in zip(teacher, student):
        mode = choose_serving("auto", True, t["dev"], s["dev"])["mode"]
        out.append((mode, t["test"] if mode == "whole" else s["test"]))
    return out


def lr_text(lrs: tuple[float, ...]) -> str:
    """A scheme's learning rate for the page: one value, or several that dev chooses between."""
    return ("one of " + ", ".join(f"{x:g}" for x in lrs) + " chosen on dev") if len(lrs) > 1 else f"{lrs[0]:g}"


def main() -> None:
    import argparse

    def options(ap):
        ap.add_argument("--exact", action="store_true", help="also hBERT with every PLOT miss computed (the full run always does)")
        ap.add_argument("--learned", action="store_true",
                        help="also hBERT with each missed tri-gram served by the root PLOT's learned back-off "
                             "(`--miss-policy learned`; train it first with `hmi plot learn-backoff`)")
        ap.add_argument("--train", type=int, help="training examples per task (default 224 with --quick, up to 4,000 without)")
        ap.add_argument("--test", type=int, help="test examples per task, dev half as many (default 240 with --quick, "
                                                 "1,000 without)")
        ap.add_argument("--pooling", choices=("dev", "mean", "cls"),
                        help="what classification heads read: the [CLS] vector (default with --quick), the mean of the "
                             "tokens (the root's own pooling), or per scheme and task the one with the better dev "
                             "accuracy (default)")
        ap.add_argument("--schemes", help="comma-separated subset of: dedicated, shared, compress, hBERT-adapter, hBERT, "
                                          "hBERT-exact, hBERT-learned, and on request hBERT-learned-compute (the learned back-off with the "
                                          "misses that would fall to the uni-gram computed), hBERT-full (hBERT on the "
                                          "full-context lower layers: perfect windows) and hBERT-adapter-upper "
                                          "(hBERT-adapter's adapters in the upper layers only) and hBERT-distilled (the "
                                          "learned back-off's adapters distilled from hBERT-adapter: --transfer) and "
                                          "hBERT-distilled-compute (the same with --miss-policy learned+compute) and "
                                          "hBERT-backoff-distilled (the same with --miss-policy backoff) and "
                                          "hBERT-full-distilled (the same on perfect windows)")
        ap.add_argument("--tasks", help="comma-separated subset of: " + ", ".join(TASKS + OTHER_TASKS)
                        + f" (default the first {len(TASKS)})")
        ap.add_argument("--adapter", help="the adapters of hBERT and hBERT-adapter: bottleneck[:REDUCTION] (default "
                                          "bottleneck:16), "
                                          "lora[:RANK[:all|SITE+SITE]] (LoRA on q+v by default; all: every linear layer) or "
                                          "ia3; another than the default writes its "
                                          "own page (eval_accuracy_partial_..._adapter-KIND-SIZE)")
        ap.add_argument("--classification-adapter", metavar="KIND[:SIZE]",
                        help="the adapters of hBERT and hBERT-adapter on the classification tasks only (as --adapter); "
                             "tagging keeps its own; writes its own page (..._cls-adapter-KIND-SIZE)")
        ap.add_argument("--dedicated-lr", type=learning_rates, metavar="LR[,LR...]",
                        help="the learning rate of full fine-tuning (default 1e-4, chosen for the six-layer root; 2e-5 "
                             "is the usual one for a base-size root), or several: per task the one with the better "
                             "dev accuracy (e.g. 1e-4,2e-5); another than the default writes its own page")
        ap.add_argument("--shared-lr", type=learning_rates, metavar="LR[,LR...]",
                        help="the learning rates of the head on the frozen root (shared), as --dedicated-lr (its grid: "
                             + ",".join(f"{x:g}" for x in GRIDS["shared"]) + "); another than the default writes its "
                             "own page")
        ap.add_argument("--grid", action=argparse.BooleanOptionalAction, default=None,
                        help="every scheme's learning rate chosen per task on dev from a small grid (the paper's "
                             "protocol; the default without --quick): " + "; ".join(
                                 f"{k} {', '.join(f'{x:g}' for x in v)}" for k, v in GRIDS.items()))
        ap.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="train every cell with N seeds (initialization, batch order, dropout; seed 0 is the "
                             "one-seed table's run, read back): each task's figure is the mean over seeds of the test "
                             "accuracy of the pooling and learning rate dev chooses for that seed, its spread in "
                             "tasks.*.sd (default 1)")
        ap.add_argument("--max-minutes", type=float, metavar="M",
                        help="stop this invocation once M minutes are spent (after the training run in progress); "
                             "the same command run again continues where it stopped, reading back every finished "
                             "run (one per task, scheme, pooling and learning rate, kept under "
                             "$HMI_HOME/runs/eval_accuracy/); exit code 75 while runs are left")
        ap.add_argument("--report-only", action="store_true",
                        help="train nothing: write the page of the tasks whose runs are all finished (a partial page, "
                             "exit code 75, while runs are left)")
        ap.add_argument("--transfer", type=int, default=2000, metavar="N",
                        help="hBERT-distilled: unlabeled lines of each task's domain corpus the teacher answers "
                             "beside the training texts (default 2000)")
        ap.add_argument("--distil-weight", type=float, default=DISTIL_WEIGHT, metavar="W",
                        help="hBERT-distilled: the weight of the teacher's answers in the loss, 1 - W the labels' "
                             f"(default {DISTIL_WEIGHT:g}; hmi.training.distil)")
        ap.add_argument("--distil-epochs", type=int, metavar="E",
                        help="hBERT-distilled: the student's epochs, the best on dev kept (default: the table's, "
                             "4 with --quick; the teacher keeps the table's)")
        ap.add_argument("--distil-start", choices=("new", "teacher"), default="new",
                        help="hBERT-distilled: where the student starts, a new adapter and head (default) or the "
                             "teacher's adapter of the served layers and its head (`Distillation.start`); teacher "
                             "writes its own page (...-start-teacher)")
        ap.add_argument("--probe-first", type=int, default=0, metavar="E",
                        help="hBERT-adapter, and so every distilled student's teacher: train the head alone for E "
                             "epochs first, then everything from there (LP-FT), dev choosing among all the epochs; "
                             "writes its own page (..._probe-first-E)")
        ap.add_argument("--head-lr", type=float, metavar="LR",
                        help="the adapter schemes (hBERT-adapter, and so every teacher, and every hBERT column): "
                             "the head trains at LR while the adapters train at the grid's rate (default: the "
                             "grid's rate for both); writes its own page (..._head-lr-LR)")
        ap.add_argument("--branches", action="store_true",
                        help="serve each task's PLOT columns on its domain's branch, as a tenant of that domain is "
                             "(the chain branch -> root; create it first with `hmi domain create DOMAIN --corpus "
                             "DOMAIN`: news, reviews, social, literature); writes its own page (..._branches)")
        ap.add_argument("--fresh", action="store_true", help="forget the finished runs of this configuration")
        root_options(ap)

    args = start(__doc__, options)
    full_table = default_schemes(args.quick, args.exact, args.learned)
    schemes = full_table if args.schemes is None else subset(args.schemes, ALL_SCHEMES, "--schemes")
    tasks = chosen_tasks(args.tasks)
    adapter = adapter_options(args.adapter)
    cls_adapter = adapter_options(args.classification_adapter, "--classification-adapter")
    grid = not args.quick if args.grid is None else args.grid
    partial = (partial_table(schemes, tasks, full_table) or args.adapter is not None
               or args.classification_adapter is not None
               or any(getattr(args, flag) is not None for flag in LR_FLAGS.values()))
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    seeds = range(args.seeds)
    if args.transfer < 0:
        raise SystemExit(f"--transfer must be 0 or more lines, got {args.transfer}")
    if not 0 <= args.distil_weight <= 1:
        raise SystemExit(f"--distil-weight must be between 0 and 1, got {args.distil_weight:g}")
    if args.distil_epochs is not None and args.distil_epochs < 1:
        raise SystemExit(f"--distil-epochs must be at least 1, got {args.distil_epochs}")
    if args.probe_first < 0:
        raise SystemExit(f"--probe-first must be 0 or more epochs, got {args.probe_first}")
    if args.head_lr is not None and args.head_lr <= 0:
        raise SystemExit(f"--head-lr must be positive, got {args.head_lr:g}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise SystemExit(f"--max-minutes must be positive, got {args.max_minutes:g}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from benchmarks.bench_tenants import FullContextLower
    from hmi.adapters.spec import AdapterSpec
    from hmi.data import TASK_DOMAIN, is_tagging, load_corpus, load_task, task_labels
    from hmi.plot.build import plot_corpus
    from hmi.plot.learned import SERVE_BF16
    from hmi.plot.learned import fingerprint as learned_fingerprint
    from hmi.plot.lookup import LEARNED_POLICIES, PlotLookup
    from hmi.training.examples import encode
    from hmi.training.finetune import FinetuneConfig, finetune, fit, tenant_model
    from hmi.version_tree.tree import VersionTree

    caps = dict.fromkeys(tasks, 224) if args.quick else \
        {"news-topic": 1700, "review-sentiment": 4000, "tweet-sentiment": 4000, "pos-tagging": 2000,
         "license-category": 2000}
    if args.train is not None:
        if args.train < 1:
            raise SystemExit(f"--train must be a positive number of examples, got {args.train}")
        caps = dict.fromkeys(tasks, args.train)
    n_eval = 240 if args.quick else 1000
    default_pooling = "cls" if args.quick else "dev"
    args.pooling = args.pooling or default_pooling
    if args.test is not None:
        if args.test < 2:
            raise SystemExit(f"--test must be at least 2 examples, got {args.test}")
        n_eval = args.test
    epochs = 4 if args.quick else 5
    # the student's epochs in a distilled fine-tune; None: the table's
    distil_epochs = args.distil_epochs if args.distil_epochs not in (None, epochs) else None
    max_len = 64 if args.quick else 128
    root, version = prepared_root(root=args.root, l_low=args.l_low)
    n_layers, l_low = root.bert.config.num_hidden_layers, root.spec.l_low
    tree = VersionTree(root, root_version=version) if args.branches else None
    plot_from = plot_corpus(version.store)
    rows, results = [], {"tasks": {}}
    hbert_runs = [(label, policy) for label, policy in (("hBERT", "backoff"), (HBERT_EXACT, "compute"),
                                                        (HBERT_LEARNED, "learned"), (HBERT_LEARNED_COMPUTE, "learned+compute"),
                                                        (HBERT_FULL, "full"), *DISTILLED.items())
                  if label in schemes]
    lrs = dict(GRIDS) if grid else {**{label: (lr,) for label, _, lr in SCHEMES}, "hBERT": (HBERT_LR,)}
    lrs.update({scheme: getattr(args, flag) for scheme, flag in LR_FLAGS.items() if getattr(args, flag) is not None})
    lrs[HBERT_EXACT] = lrs[HBERT_LEARNED] = lrs[HBERT_LEARNED_COMPUTE] = lrs[HBERT_FULL] = lrs["hBERT"]
    lrs.update(dict.fromkeys(DISTILLED, lrs["hBERT"]))
    distils = any(label in DISTILLED for label in schemes)  # a teacher per task and seed, and --transfer lines
    # the root PLOT's learned back-off serves a column
    reads_learned = any(policy in LEARNED_POLICIES for _, policy in hbert_runs)
    # a learned back-off's cells are its model's: one trained again is another run
    learned_id = learned_fingerprint(version.store.path) if reads_learned else None
    if reads_learned and learned_id is None:
        raise SystemExit(f"the root PLOT ({version.store.path}) has no learned back-off yet: train it with "
                         f"`hmi plot learn-backoff{root_flags(args)}`")
    config = {"format": CELL_FORMAT, "root": root.spec.name, "root_artifact": root.artifact_id, "l_low": l_low,
              "plot": (version.store.get_record("build") or {}).get("fingerprint"), "n_eval": n_eval,
              "epochs": epochs, "max_len": max_len, "adapter": adapter,
              **({"classification_adapter": cls_adapter} if cls_adapter else {})}
    cells = Cells("eval_accuracy", config, max_minutes=args.max_minutes, fresh=args.fresh, train=not args.report_only,
                  record_dir=DOCS / "cells", adopt=None if args.fresh else artifact_free(config))
    full_context = [(label, mode) for label, mode, _ in SCHEMES if label in schemes]
    columns = [name for name, _ in full_context] + [label for label, _ in reversed(hbert_runs)]
    columns += [auto for student, auto in AUTO_OF.items()  # derived from the two columns' cells
                if {"hBERT-adapter", student} <= set(columns)]
    partial_pages: set[str] = set()  # written by this run while tasks remained

    def report(done: list[str]) -> None:
        """Writes the results page of the tasks ``done`` (a partial page until every task is done)."""
        res = {**results, "tasks": {t: results["tasks"][t] for t in done}}
        avg = {c: float(np.mean([res["tasks"][t][c] for t in done])) for c in columns}
        # with several seeds: each seed's average over the tasks, and their spread (what a gap between columns
        # is read against)
        by_seed = ({c: [float(np.mean([res["tasks"][t]["per_seed"][c][i] for t in done])) for i in seeds] for c in columns}
                   if len(seeds) > 1 else {})
        sd = {c: float(np.std(vs, ddof=1)) for c, vs in by_seed.items()}
        table_rows = rows + [("average", "", *(f"{avg[c]:.1f}" + (f" ± {sd[c]:.1f}" if sd else "") for c in columns))]
        # Keys of the tenant-adapter issue (full fine-tuning = dedicated), kept stable for comparisons.
        for t in done:
            r = res["tasks"][t]
            r.update({key: r[c] for key, c in (("hbert", "hBERT"), ("full_ft", "dedicated"),
                                                ("adapters_full_context", "hBERT-adapter")) if c in r})
        res["average"] = {c: round(v, 2) for c, v in avg.items()}
        if by_seed:
            res["average_per_seed"] = {c: [round(v, 2) for v in vs] for c, vs in by_seed.items()}
            res["average_sd"] = {c: round(v, 2) for c, v in sd.items()}
            res["seeds"] = len(seeds)
        res.update({key: round(avg["dedicated"] - avg[col], 2) for col, key, _ in GAP_KEYS
                    if "dedicated" in avg and col in avg})
        for other in ("shared", "compress"):
            if other in avg and "hBERT" in avg:
                res[f"hbert_above_{other}"] = avg["hBERT"] > avg[other]  # on average
                res[f"hbert_below_{other}_on"] = [t for t in done if res["tasks"][t]["hBERT"] < res["tasks"][t][other]]
        res["root"] = root.spec.name
        res["l_low"] = l_low
        res["root_artifact"] = root.artifact_id
        res["pooling"] = args.pooling
        text = table(table_rows, ("task", "train examples", *columns))
        gaps = [f"{what} {res[key]}" for _, key, what in GAP_KEYS if key in res]
        gap = " Average gap to dedicated (full fine-tuning), points: " + "; ".join(gaps) if gaps else ""
        seeds_text = (f" Each figure is the mean over {len(seeds)} seeds (initialization, batch order, dropout) of the "
                      "test accuracy of the pooling and learning rate dev chooses for that seed, ± the standard deviation "
                      "over seeds (for the average: of each seed's average over the tasks; res.average_per_seed)."
                      if by_seed else "")
        text += (f"\n\nTest accuracy in % (up to {n_eval} test examples per task; for pos-tagging, accuracy over words, which is "
                 f"micro-F1 for single-label tagging).{gap + '.' if gap else ''}{seeds_text} Every scheme: the same training "
                 f"examples (texts cut to {max_len} tokens), {epochs} epochs of batches of 32, the best epoch on dev, AdamW; "
                 "classification heads read "
                 + {"dev": "the [CLS] vector or the mean of the tokens, whichever gives the scheme the better dev accuracy on "
                           "the task (res.tasks.*.pooling)", "mean": "the mean of the tokens",
                    "cls": "the [CLS] vector"}[args.pooling]
                 + f"; the adapters are {describe_adapter(adapter)}"
                 + (f" (on the classification tasks {describe_adapter(cls_adapter)})" if cls_adapter else "")
                 + ". " + "; ".join(f"{label}: {what}" for label, what in scheme_descriptions(
                     columns, lrs, n_layers, l_low, args.transfer, SERVE_BF16, args.distil_weight)) + "."
                 + (f" The distilled students train {distil_epochs} epochs (the teacher {epochs}), the best on dev "
                    "kept." if distils and distil_epochs else "")
                 + (f" hBERT-adapter (and so every teacher) trains its head alone for {args.probe_first} epochs at "
                    f"lr {PROBE_LR:g} first, then everything from there (LP-FT), dev choosing among all "
                    f"{epochs + args.probe_first} epochs." if args.probe_first else "")
                 + (f" The adapter schemes' heads train at lr {args.head_lr:g} (their adapters at the rate "
                    "given)." if args.head_lr is not None else "")
                 + (" Each distilled student starts from its teacher: the teacher's adapter of the upper "
                    f"{n_layers - l_low} layers and its head (`Distillation.start`), not a new one."
                    if distils and args.distil_start == "teacher" else ""))
        res["plot_corpus"] = plot_from
        plot_stats = version.store.get_record("stats") or {}  # written when its build finished
        if plot_stats:
            res["plot_entries"], res["plot_mib"] = plot_stats["entries"], round(plot_stats["file_bytes"] / 2**20, 1)
        text = (f"Root: {root.spec.name}, split {l_low}+{n_layers - l_low} (artifact {root.artifact_id}); root PLOT "
                f"built from the corpus {plot_from!r}"
                + (f" ({plot_stats['entries']:,} n-grams, {plot_stats['file_bytes'] / 2**30:.1f} GiB)" if plot_stats else "")
                + ".\n\n" + text)
        res["adapter"] = adapter
        if cls_adapter:
            res["classification_adapter"] = cls_adapter
        res["lr"] = {label: list(lrs[label]) if len(lrs[label]) > 1 else lrs[label][0] for label in columns
                     if label in lrs}  # a derived column (served auto) trains nothing
        res["lr_grid"] = grid
        if "dedicated" in columns:
            res["dedicated_lr_chosen_on_dev"] = len(lrs["dedicated"]) > 1
        cal = root.meta.get("calibration", {})
        if cal.get("steps_done"):
            res["steps"] = cal["steps_done"]
        if cal.get("steps_done") and cal.get("train_seconds"):
            res["calibration_seconds_per_step"] = round(cal["train_seconds"] / cal["steps_done"], 2)
            res["calibration_cpu"] = cal.get("cpu_capability")
        if len(done) < len(tasks):
            res["unfinished"] = f"{len(done)} of {len(tasks)} tasks; {cells.summary()}"
        page = result_name("eval_accuracy_partial" if partial or len(done) < len(tasks) else "eval_accuracy", args)
        if cal.get("corpus", "general") != "general":  # another recipe's windows: their own page
            page += f"_corpus-{cal['corpus']}"
        page += plot_page_suffix(plot_from)  # a root PLOT of other text: its own page
        if args.adapter is not None:
            page += "_adapter-" + args.adapter.replace(":", "-")
        if cls_adapter:
            page += "_cls-adapter-" + args.classification_adapter.replace(":", "-")
        page += page_suffix(columns)
        if tree is not None:
            page += "_branches"
            res["branches"] = {t: res["tasks"][t]["branch"]["name"] for t in done}
            text += ("\n\nThe PLOT columns are served on each task's domain branch (the chain branch -> root, as a "
                     "tenant of that domain is served; `hmi domain create`): " + "; ".join(
                         f"{t}: {b['name']} ({b['entries']:,} entries, {b['mib']} MiB; {b['further_pretraining']})"
                         for t in done for b in [res["tasks"][t]["branch"]]) + ".")
        if distils:
            page += f"-transfer-{args.transfer}" if args.transfer != 2000 else ""
            page += f"-weight-{args.distil_weight:g}" if args.distil_weight != DISTIL_WEIGHT else ""
            page += f"-epochs-{distil_epochs}" if distil_epochs else ""
            page += f"-start-{args.distil_start}" if args.distil_start != "new" else ""
            res["transfer_lines"] = args.transfer
            res["distil_weight"] = args.distil_weight
            res["distil_epochs"] = distil_epochs or epochs
            res["distil_start"] = args.distil_start
        if args.probe_first:
            page += f"_probe-first-{args.probe_first}"
            res["probe_first_epochs"] = args.probe_first
        if args.head_lr is not None:
            page += f"_head-lr-{args.head_lr:g}"
            res["head_lr"] = args.head_lr
        if reads_learned:
            res["learned_backoff"] = learned_id
            res["learned_backoff_bf16"] = SERVE_BF16
        if args.tasks is not None:  # a run on some tasks keeps other runs' pages
            page += "_" + "-".join(tasks) + (f"_train-{args.train}" if args.train else "")
        for scheme, flag in LR_FLAGS.items():
            if getattr(args, flag) is not None:
                page += f"_{scheme}-lr-" + "-".join(f"{x:g}" for x in getattr(args, flag))
        if len(seeds) > 1:
            page += f"_seeds-{len(seeds)}"
        if grid == args.quick:  # not the default of this kind of run
            page += "_grid" if grid else "_no-grid"
        finish(page, text, res,
               "python benchmarks/eval_accuracy.py" + (" --quick" if args.quick else "")
               + (f" --train {args.train}" if args.train else "") + (f" --test {args.test}" if args.test else "")
               + (" --exact" if args.exact else "") + (" --learned" if args.learned else "")
               + (f" --pooling {args.pooling}" if args.pooling != default_pooling else "")
               + (f" --schemes {args.schemes}" if args.schemes else "") + (f" --tasks {args.tasks}" if args.tasks else "")
               + (f" --adapter {args.adapter}" if args.adapter else "")
               + (f" --classification-adapter {args.classification_adapter}" if cls_adapter else "")
               + "".join(f" --{scheme}-lr " + ",".join(f"{x:g}" for x in getattr(args, flag))
                         for scheme, flag in LR_FLAGS.items() if getattr(args, flag) is not None)
               + ((" --grid" if grid else " --no-grid") if grid == args.quick else "")
               + (f" --seeds {len(seeds)}" if len(seeds) > 1 else "")
               + (f" --transfer {args.transfer}" if distils and args.transfer != 2000 else "")
               + (f" --distil-weight {args.distil_weight:g}" if distils and args.distil_weight != DISTIL_WEIGHT else "")
               + (f" --distil-epochs {distil_epochs}" if distils and distil_epochs else "")
               + (f" --distil-start {args.distil_start}" if distils and args.distil_start != "new" else "")
               + (f" --probe-first {args.probe_first}" if args.probe_first else "")
               + (f" --head-lr {args.head_lr:g}" if args.head_lr is not None else "")
               + (" --branches" if tree is not None else "")
               + root_flags(args))
        if len(done) < len(tasks):
            partial_pages.add(page)
        for stale in partial_pages - {page}:  # every task done: the page of fewer tasks goes
            (DOCS / f"{stale}.md").unlink(missing_ok=True)


    for task in tasks:
        labels = tuple(task_labels(task))
        tagging = is_tagging(task)
        poolings = ["cls"] if tagging else (["cls", "mean"] if args.pooling == "dev" else [args.pooling])
        specs = {p: AdapterSpec.for_task("tagging" if tagging else "classification", labels, pooling=p,
                                         **(cls_adapter if cls_adapter and not tagging else adapter))
                 for p in poolings}
        train = load_task(task, "train", caps[task])
        dev = load_task(task, "dev", n_eval // 2)
        test = load_task(task, "test", n_eval)
        ex = {k: encode(root.tokenizer, v, specs[poolings[0]], max_len)
              for k, v in (("train", train), ("dev", dev), ("test", test))}
        chain, branch = task_chain(tree, version, task, root_flags(args))
        vals, secs, chosen, chosen_lr, per_seed, picked = {}, {}, {}, {}, {}, {}

        def hbert(spec, lr, seed, policy, distil=None):
            e = distil_epochs if distil is not None and distil_epochs else epochs
            cfg = FinetuneConfig(epochs=e, lr=lr, head_lr=args.head_lr, max_len=max_len, patience=e, seed=seed)
            if policy == "full":  # the same trainer on the full-context lower layers' output
                model = tenant_model(root.bert, root.spec.l_low, spec, distil.start if distil else None, cfg.seed)
                return fit(model, FullContextLower(root.bert, root.spec.l_low, "cpu", grouped=False), root.tokenizer,
                           train, dev, test, cfg, progress=False, distil=distil)[1]
            lookup = PlotLookup(chain, policy=policy)
            if policy in LEARNED_POLICIES and learned_fingerprint(version.store.path) != learned_id:
                # the cells are keyed by the model the table started with; this run would train on another
                raise SystemExit("the root PLOT's learned back-off was trained again while the table ran; "
                                 "run the same command again to continue with the new model's cells")
            return finetune(root.bert, root.spec.l_low, lookup, root.tokenizer, spec, train, dev, test, cfg,
                            progress=False, distil=distil)[1]

        def full(spec, lr, seed, mode):
            return train_full_context(root.bert, spec, ex["train"], ex["dev"], ex["test"], mode, epochs, lr, seed=seed,
                                      l_low=l_low, probe_epochs=args.probe_first if mode == "adapter" else 0,
                                      head_lr=args.head_lr if mode in ("adapter", "upper") else None)

        def cell(run, spec, lr, seed) -> dict:
            t0 = time.time()
            out = run(spec, lr, seed)
            return {"dev": out["dev"]["accuracy"], "test": out["test"]["accuracy"], "seconds": round(time.time() - t0, 1)}

        teachers: dict[int, Distillation] = {}  # seed -> hBERT-distilled's teacher and texts, trained on first use
        adapters = TrainedAdapters(lambda spec, lr, seed: full(spec, lr, seed, "adapter"))

        teacher_key = cell_key(task, len(train), "hBERT-adapter", None, SERVE_BF16, args.transfer, args.distil_weight,
                               None, probe_first=args.probe_first, head_lr=args.head_lr)

        def teacher_setting(seed) -> tuple[str, float]:
            """hBERT-adapter's (pooling, learning rate) chosen on dev: the teacher's (its pooling its students')."""
            options = [(p, lr) for p in poolings for lr in lrs["hBERT-adapter"]]
            return seeded_cells(cells, teacher_key, [seed], options,
                                lambda o, sd: cell(adapters.trained_for_cell, specs[o[0]], o[1], sd))[0][0]

        def distillation(seed) -> Distillation:
            if seed not in teachers:
                pool, lr = teacher_setting(seed)
                answers, model = kept_teacher(cells, {**teacher_key, "seed": seed, "pooling": pool, "lr": lr},
                                              adapters.teacher(specs[pool], lr, seed))
                teachers[seed] = Distillation(answers,
                                              load_corpus(TASK_DOMAIN[task], args.transfer) if args.transfer else [],
                                              weight=args.distil_weight,
                                              start=model()["upper"](l_low) if args.distil_start == "teacher" else None)
            return teachers[seed]

        runs = [(label, lambda spec, lr, seed, policy=policy, label=label: hbert(
                     spec, lr, seed, policy, distillation(seed) if label in DISTILLED else None))
                for label, policy in hbert_runs]
        runs += [(label, lambda spec, lr, seed, mode=mode: full(spec, lr, seed, mode)) for label, mode in full_context]

        try:
            for label, run in runs:
                # every pooling and learning rate is trained (or read back from an earlier run of the same
                # command); the one with the best dev accuracy is kept
                reads = dict(hbert_runs).get(label) in LEARNED_POLICIES
                on_plot = dict(hbert_runs).get(label, "full") != "full"  # the column reads the PLOT chain
                key = cell_key(task, len(train), label, learned_id if reads else None, SERVE_BF16, args.transfer,
                               args.distil_weight, distil_epochs,
                               [branch["name"], branch["plot"]] if branch and on_plot else None, args.distil_start,
                               args.probe_first, args.head_lr)
                # a distilled student at its teacher's pooling, as a tenant's fine-tune trains it
                options = (lambda seed, label=label: [(teacher_setting(seed)[0], lr) for lr in lrs[label]]
                           ) if label in DISTILLED else [(p, lr) for p in poolings for lr in lrs[label]]
                picks = seeded_cells(cells, key, seeds, options,
                                     lambda o, seed, run=run: cell(run, specs[o[0]], o[1], seed))
                picked[label] = [r for _, r, _ in picks]
                vals[label] = float(np.mean([r["test"] for _, r, _ in picks]))
                secs[label] = sum(s for _, _, s in picks)
                if len(seeds) > 1:
                    per_seed[label] = [round(100 * r["test"], 2) for _, r, _ in picks]
                chosen[label] = picks[0][0][0] if len(seeds) == 1 else [o[0] for o, _, _ in picks]
                if len(lrs[label]) > 1:
                    chosen_lr[label] = picks[0][0][1] if len(seeds) == 1 else [o[1] for o, _, _ in picks]
        except OutOfTime as exc:
            if rows:
                report(tasks[:len(rows)])
            print(f"stopped: {exc} ({len(rows)} of {len(tasks)} tasks done; {cells.summary()}); run the same command "
                  "again to continue", flush=True)
            sys.exit(EXIT_UNFINISHED)
        serving = {}
        for student, column in AUTO_OF.items():
            if column not in columns:
                continue
            auto = served_auto(picked["hBERT-adapter"], picked[student])
            modes = [mode for mode, _ in auto]
            serving[column] = modes[0] if len(seeds) == 1 else modes
            vals[column], secs[column] = float(np.mean([r for _, r in auto])), 0.0
            if len(seeds) > 1:
                per_seed[column] = [round(100 * r, 2) for _, r in auto]
        results["tasks"][task] = {**{k: round(100 * v, 2) for k, v in vals.items()}, "train": len(train), "test": len(test),
                              "seconds": {k: round(v, 1) for k, v in secs.items()}}
        if serving:
            results["tasks"][task]["serving"] = serving  # served-auto column -> whole or windows (per seed)
        if not tagging:
            results["tasks"][task]["pooling"] = chosen
        if branch:
            results["tasks"][task]["branch"] = branch
        if chosen_lr:
            results["tasks"][task]["lr"] = chosen_lr
        if per_seed:
            results["tasks"][task]["per_seed"] = per_seed
            results["tasks"][task]["sd"] = {c: round(float(np.std(v, ddof=1)), 2) for c, v in per_seed.items()}
        rows.append((task + (" (token acc.)" if tagging else ""), len(train),
                     *(f"{100 * vals[c]:.1f}" + (f" ± {results['tasks'][task]['sd'][c]:.1f}" if per_seed else "")
                       for c in columns)))
        print(rows[-1], flush=True)
        report(tasks[:len(rows)])  # every finished task is on the page at once
    print(cells.summary(), flush=True)

if __name__ == "__main__":
    main()
