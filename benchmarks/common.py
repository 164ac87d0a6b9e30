"""Shared helpers of the benchmark scripts: machine description, timing, tables, real batches."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# A share of the machine's CPU time taken beside a benchmark above which its timings are flagged.
NOT_ALONE = 0.05
# Where results go: the repository's docs/results/, or HMI_BENCH_DOCS (a trial run that must not replace them).
DOCS = Path(os.environ.get("HMI_BENCH_DOCS") or Path(__file__).resolve().parents[1] / "docs" / "results")


def cpu_ticks() -> tuple[int, int, int] | None:
    """(all, busy, stolen) clock ticks of the machine's CPUs since boot (``/proc/stat``): busy is
    user, nice, system, irq and softirq time; stolen, what the hypervisor gave to other machines."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return sum(v), user + nice + system + irq + softirq, steal


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


_AT_START: tuple | None = None  # (cpu_ticks(), own_cpu_seconds()) when the benchmark started


def beside_the_run() -> dict | None:
    """What ran beside this benchmark since ``start``, as shares of the machine's CPU time: other
    processes (``others``: busy time not this process's nor its children's) and other virtual
    machines (``stolen``). A timing is trustworthy when both are small; None where unknown."""
    now = cpu_ticks()
    if _AT_START is None or _AT_START[0] is None or now is None:
        return None
    (all0, busy0, steal0), own0 = _AT_START
    total = now[0] - all0
    if total <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    own = (own_cpu_seconds() - own0) * hz
    others = max(0.0, (now[1] - busy0 - own) / total)
    return {"others": round(others, 3), "stolen": round((now[2] - steal0) / total, 3)}


def start(doc: str, extra=None):
    """Command line of a benchmark (``--quick`` and any ``extra(parser)`` options), offline
    transformers, prepared data. Returns the parsed arguments."""
    import argparse

    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--quick", action="store_true", help="smaller workloads, for a fast check")
    ap.add_argument("--tiny", action="store_true",
                    help="the smallest workloads that still go through every step (implies --quick): a rehearsal "
                         "(benchmarks/gpu_suite.py --dry-run), not a measurement")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    args.quick = args.quick or args.tiny
    global _AT_START
    _AT_START = (cpu_ticks(), own_cpu_seconds())
    from hmi.allocator import tune_allocator
    from hmi.bootstrap import ensure_data, quiet_transformers

    quiet_transformers()
    tune_allocator()  # as the server runs
    ensure_data()
    return args


def cores_apart(clients: int) -> tuple[set[int], set[int]]:
    """Keeps the last ``clients`` cores for load generators (as if the clients ran on other
    machines) and moves every thread of this process, the server's, to the others; returns
    (client cores, server cores)."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= clients < len(cpus):
        raise SystemExit(f"--apart {clients}: this machine lets this process use {len(cpus)} cores; the load "
                         "generators need at least 1 and the server at least 1")
    client, server = set(cpus[-clients:]), set(cpus[:-clients])
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), server)
    torch.set_num_threads(len(server))
    return client, server


def cpu_kind() -> str:
    """``avx512`` on a CPU with AVX-512F, else ``avx2``: the machine's kind, whatever kernels torch is told to use."""
    from hmi.model.kernels import cpu_flags

    return "avx512" if "avx512f" in cpu_flags() else "avx2"


def machine() -> str:
    import torch

    from hmi.model.kernels import BF16_UNIT

    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name") or platform.processor() or platform.machine()
    # A virtual machine may name every generation alike ("AMD EPYC"): the family and model tell them apart.
    if "cpu family" in info:
        cpu += f", family {info['cpu family']} model {info.get('model', '?')}"
    isa = torch.backends.cpu.get_cpu_capability()  # the vector instructions torch's kernels use (AVX2, AVX512, ...)
    isa += f" with native bf16 ({BF16_UNIT})" if BF16_UNIT else ""
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} CPU cores ({cpu}, {isa}){gpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def timeit(fn, repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def round_robin(fns: dict, rounds: int, warmup: int = 1, before_round=None, stat=statistics.median) -> dict:
    """``stat`` (the median unless told) of each of ``fns``' seconds (name -> callable) over
    ``rounds`` rounds that run them one after the other, so drifts of a shared machine hit them
    alike; each runs ``warmup`` times first.  ``before_round(r)``, when given, runs before round
    ``r`` (``-1``: before the warm-up), say to give every function of a round the same input."""
    if before_round is not None:
        before_round(-1)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: stat(v) for k, v in times.items()}


def table(rows: list[tuple], headers: tuple) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def real_batch(tokenizer, batch: int = 32, length: int = 128) -> tuple:
    """``batch`` real texts of at least ``length`` tokens (BBC test articles), cut to ``length``."""
    import numpy as np

    from hmi.data import load_task

    texts = [r["text"] for r in load_task("news-topic", "test")]
    enc = tokenizer(texts, truncation=True, max_length=length)
    rows = [ids for ids in enc["input_ids"] if len(ids) == length][:batch]
    if len(rows) < batch:
        raise SystemExit("not enough long test texts")
    ids = np.array(rows, dtype=np.int64)
    return ids, np.ones_like(ids)


def cut_texts(tokenizer, texts: list[str], length: int, exact: bool = False) -> list[str]:
    """``texts`` as a client that cuts them at ``length`` tokens sends them (the cut ids decoded),
    keeping those that tokenize again within ``length`` tokens (exactly ``length`` with ``exact``)."""
    cut = [tokenizer.decode(ids[1:-1]) for ids in tokenizer(list(texts), truncation=True, max_length=length)["input_ids"]]
    sizes = [len(ids) for ids in tokenizer(cut)["input_ids"]]
    return [t for t, n in zip(cut, sizes) if (n == length if exact else n <= length)]


def provenance() -> str:
    """When and from which commit a result was measured, as a page says it."""
    date, commit = measured_at()
    return f"Date: {date}; commit {commit}"


OUTPUTS = "docs/results"  # what benchmarks write: their pages, plots and cells, not the code they measure


def describe(repo: Path) -> str:
    """``git describe --always`` of ``repo``, with ``-dirty`` when a tracked file outside ``OUTPUTS``
    differs from the commit (a run that writes its plot, or its cells, before its page is still
    the commit's); "" where there is no git history."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)

    try:
        commit = git("describe", "--always").stdout.strip()
        if commit and git("diff", "--quiet", "HEAD", "--", ".", f":(exclude){OUTPUTS}").returncode == 1:
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return commit


def measured_at() -> tuple[str, str]:
    """(the UTC date, the commit the code was at: ``describe``; ``HMI_COMMIT`` where there is no git
    history)."""
    import datetime

    # a copy of the tree without its git history (a machine the checkout was carried to) names it
    commit = describe(Path(__file__).resolve().parents[1]) or os.environ.get("HMI_COMMIT") or "unknown"
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", commit


def finish(name: str, text: str, result: dict, command: str, measured: tuple[str, str] | None = None) -> None:
    """Prints the table and writes docs/results/<name>.md (its command, machine, date and commit); the last
    printed line is the JSON result.  ``measured``: the machine and the date-and-commit line of the
    run a page written again from its record came from (``page_header``), kept instead of this
    process's."""
    DOCS.mkdir(exist_ok=True)
    beside = result.get("beside_the_run") or beside_the_run()  # a page written again keeps its run's
    alone = ""
    if beside is not None:
        result = {**result, "beside_the_run": beside}
        alone = (f"Beside the run: other processes {beside['others']:.0%} of the CPU time, other virtual machines "
                 f"(stolen) {beside['stolen']:.0%}.")
        if max(beside.values()) > NOT_ALONE:
            print(f"warning: this run did not have the machine to itself ({alone}): its timings are not "
                  "comparable with a run that had", file=sys.stderr)
    where, when = measured or (machine(), provenance())
    doc = (f"# {name}\n\nCommand: `{command}`\n\nMachine: {where}\n\n{when}\n\n"
           + (f"{alone}\n\n" if alone else "") + f"{text}\n\n"
           f"```json\n{json.dumps(result, indent=1)}\n```\n")
    (DOCS / f"{name}.md").write_text(doc)
    print(text)
    print(json.dumps(result))
    sys.stdout.flush()


def page_header(page: str) -> tuple[str, str]:
    """(machine, date-and-commit line) of a results page ``finish`` wrote: what a page written again
    from its record keeps (``finish(..., measured=)``)."""
    import re

    return (re.search(r"^Machine: (.*)$", page, re.M).group(1), re.search(r"^(Date: .*)$", page, re.M).group(1))


def root_options(ap) -> None:
    """``--root`` and ``--l-low``, as ``hmi serve`` takes them, for benchmarks that run on any root."""
    ap.add_argument("--root", help="an alias (minilm-l6, the default; mpnet-base) or a BERT/RoBERTa/MPNet checkpoint folder")
    ap.add_argument("--l-low", type=int, help="lower layers (default: half the root's)")


def root_flags(args) -> str:
    """The ``--root``/``--l-low`` part of a benchmark's command line ("" on the default root)."""
    return (f" --root {args.root}" if args.root else "") + (f" --l-low {args.l_low}" if args.l_low else "")


def result_name(name: str, args) -> str:
    """The results page of a benchmark run on the root ``args`` name: ``name`` on the default root
    and split, ``name_<alias>`` (e.g. ``eval_accuracy_mpnet-base``) on another root, with
    ``-l<L_low>`` where the split is given (``eval_accuracy_minilm-l6-l2``)."""
    from hmi.model.root import DEFAULT_L_LOW

    root = args.root or "minilm-l6"
    if root == "minilm-l6" and args.l_low in (None, DEFAULT_L_LOW):
        return name
    slug = root if "/" not in root else Path(root).name
    return f"{name}_{slug}" + (f"-l{args.l_low}" if args.l_low else "")


def plot_page_suffix(corpus: str) -> str:
    """What a results page's name adds for a root PLOT built from ``corpus`` (``hmi plot build
    --corpus``): nothing for ``general``, else ``_plot-`` and ``all``, prepared corpora's names
    joined by ``-``, or a file's stem."""
    return "" if corpus == "general" else "_plot-" + "-".join(Path(c.strip()).stem for c in corpus.split(","))


def prepared_root(home: Path | None = None, root: str | None = None, l_low: int | None = None):
    """The current calibrated artifact of root ``root`` (an alias or a folder; the default root
    when None) split at ``l_low``, with its root PLOT built (``make bench`` prepares both for the
    default root): ``(root, root PLOT version)``.  A complete root PLOT is taken as a server takes
    it, whatever corpus it was built from (the test suite's soak builds its from a slice)."""
    from hmi.bootstrap import root_plot_state
    from hmi.home import hmi_home
    from hmi.model.artifact import load_root
    from hmi.model.catalog import root_spec
    from hmi.plot.paths import ensure_root_plot, open_root_version

    spec = root_spec(root or "minilm-l6", l_low, home) if root or l_low else None
    root = load_root(home=home, spec=spec)
    if not root_plot_state(home or hmi_home(), root.artifact_id).get("complete"):
        ensure_root_plot(root, home=home)  # a progress bar when it has to be built
    return root, open_root_version(root, home)


def adapter_variants(bert, l_low: int, spec, n: int, seed: int = 0, trainer_seed: int = 0) -> list[dict]:
    """``n`` tenants' canonical weights: a freshly initialized adapter and head of ``spec`` plus
    independent Gaussian noise (std 0.02) each, seeded."""
    import torch

    from hmi.training.finetune import initial_weights

    base = initial_weights(bert.config, l_low, spec, trainer_seed)
    g = torch.Generator().manual_seed(seed)
    return [{k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(n)]


def adapter_options(arg: str | None, flag: str = "--adapter") -> dict:
    """``--adapter KIND[:SIZE]`` as AdapterSpec fields: ``bottleneck[:REDUCTION]`` (default 16),
    ``lora[:RANK[:TARGETS]]`` (default 8, alpha = rank; TARGETS ``all`` or sites joined by ``+``,
    default q+v) or ``ia3``; None is each task's default adapter (``AdapterSpec.for_task``: the
    bottleneck 16 for classification, LoRA 16 on every linear layer for tagging), ``{}``."""
    import dataclasses

    from hmi.adapters.spec import KINDS, AdapterSpec, SpecError, lora_sites

    if arg is None:
        return {}
    usage = f"{flag}: expected bottleneck[:REDUCTION], lora[:RANK[:all|SITE+SITE...]] or ia3, got {arg!r}"
    defaults = {f.name: f.default for f in dataclasses.fields(AdapterSpec)}
    kind, _, rest = arg.partition(":")
    size, _, targets = rest.partition(":")
    if kind not in KINDS or (size and (kind == "ia3" or not size.isdigit() or int(size) < 1)) \
            or (targets and kind != "lora"):
        raise SystemExit(usage)
    if kind == "bottleneck":
        return {"kind": kind, "reduction_factor": int(size or defaults["reduction_factor"])}
    if kind == "lora":
        rank = int(size or defaults["rank"])
        try:
            sites = lora_sites(targets.replace("+", ",")) if targets else defaults["targets"]
        except SpecError as exc:
            raise SystemExit(f"{usage} ({exc})") from None
        return {"kind": kind, "rank": rank, "alpha": float(rank), "targets": sites}
    return {"kind": kind}


def describe_adapter(opts: dict) -> str:
    """How a results page names the adapters ``adapter_options`` gave."""
    if not opts:
        return ("each task's default adapters (bottleneck, reduction 16, for classification; LoRA of rank 16 on every "
                "linear layer for tagging)")
    if opts["kind"] == "bottleneck":
        return f"bottleneck adapters (reduction {opts['reduction_factor']})"
    if opts["kind"] == "lora":
        sites = {"q": "query", "k": "key", "v": "value", "ffn_in": "FFN in", "ffn_out": "FFN out"}
        return f"LoRA adapters (rank {opts['rank']}, {', '.join(sites[t] for t in opts['targets'])})"
    return "IA3 adapters"


