"""Throughput and memory of five multi-tenant schemes from 1 to 10,000 tenants (the paper's
Table 2 and Fig. 11), every scheme with the same 2 GiB budget for model weights in memory.

Schemes: dedicated (a fully fine-tuned root per tenant, an LRU of the models that fit, the rest
loaded from disk), shared (frozen root, a head per tenant), compress (a 2-layer student per
tenant, swapped like dedicated), hBERT-adapter (full-context lower layers, batched per-tenant
adapters in the upper layers) and hBERT (PLOT + adapters + the pipelined scheduler).

Usage: python benchmarks/bench_tenants.py [--quick] [--model-files N] [--root minilm-l6|mpnet-base|PATH] [--l-low N]
                                         [--adapter bottleneck[:R]|lora[:RANK[:TARGETS]]|ia3]

On another root than the default the results page is docs/bench_tenants_<root>.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict, defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    DOCS,
    adapter_options,
    adapter_variants,
    describe_adapter,
    finish,
    prepared_root,
    result_name,
    root_flags,
    root_options,
    start,
    table,
)
from hmi.model.kernels import use_onednn_linear  # noqa: E402
from hmi.model.root import full_forward  # noqa: E402

BUDGET = 2 * 2**30  # bytes of model weights every scheme may hold in memory
COUNTS = (1, 10, 100, 1000, 10000)
ROUNDS = 5  # alternating rounds behind every uniform hBERT / hBERT-adapter cell (the headline ratios)
MODEL_FILES = 100  # real per-tenant model files for the swapping schemes (disk budget below)
B, MAX_LEN, LABELS = 32, 128, 5


# -- request traces --------------------------------------------------------------------------------
def trace(n_tenants: int, dist: str, batches: int, seed: int) -> list[list[int]]:
    """Batches of tenant indices: uniform, or Zipf-skewed (p(rank k) ~ 1/k)."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        draws = rng.integers(0, n_tenants, size=batches * B)
    else:
        p = 1.0 / np.arange(1, n_tenants + 1)
        draws = rng.choice(n_tenants, size=batches * B, p=p / p.sum())
    return [draws[i * B:(i + 1) * B].tolist() for i in range(batches)]


def lru_misses(batches: list[list[int]], capacity: int, warm: int) -> tuple[int, int]:
    """Misses and requests of an LRU of ``capacity`` models replaying the trace (after ``warm`` batches),
    serving each batch tenant by tenant in order of first appearance, as the swapping schemes do."""
    lru: OrderedDict[int, None] = OrderedDict()
    misses = requests = 0
    for bi, batch in enumerate(batches):
        for t in dict.fromkeys(batch):
            hit = t in lru
            if hit:
                lru.move_to_end(t)
            else:
                lru[t] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)
            if bi >= warm:
                misses += 0 if hit else 1
        if bi >= warm:
            requests += len(batch)
    return misses, requests


# -- the swapping schemes (dedicated, compress) ------------------------------------------------------
def drop_page_cache(path: Path) -> None:
    """Asks the kernel to forget the file's cached pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_model_files(bert, n_layers: int, n: int, out: Path, seed: int) -> list[Path]:
    """``n`` per-tenant models (the root's first ``n_layers`` layers, perturbed as if fine-tuned, plus a
    head) as fp16 safetensors, fsynced so their pages can be dropped."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in bert.state_dict().items()
            if not k.startswith("encoder.layer.") or int(k.split(".")[2]) < n_layers}
    g = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(n):
        sd = {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).half().contiguous()
              if v.is_floating_point() else v.contiguous() for k, v in base.items()}
        sd["head.w"] = (0.02 * torch.randn(LABELS, bert.config.hidden_size, generator=g)).half()
        sd["head.b"] = torch.zeros(LABELS).half()
        p = out / f"m{i:04d}.safetensors"
        save_file(sd, str(p))
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
        paths.append(p)
    return paths


def warm_page_cache(folder: Path) -> int:
    """Reads every file of ``folder`` once; returns the bytes read."""
    n = 0
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    n += len(chunk)
    return n


class ModelSwapper:
    """One model per tenant: an LRU of the fp32 models that fit the budget; a miss reads the tenant's
    file from disk (page cache dropped first) into the evicted model object."""

    def __init__(self, config, files: list[Path], budget: int, relative_bias=None):
        self.config, self.files, self.relative_bias = config, files, relative_bias
        probe = self._new_model()
        self.model_bytes = sum(p.numel() * 4 for p in probe.parameters()) + LABELS * (config.hidden_size + 1) * 4
        self.capacity = max(1, budget // self.model_bytes)
        self.lru: OrderedDict[int, tuple] = OrderedDict()
        self._spare = [probe]
        self.load_s: list[float] = []
        self.compute_s: list[tuple[int, float]] = []  # (requests in the group, seconds)

    def _new_model(self):
        import copy

        from transformers import BertModel

        model = BertModel(self.config, add_pooling_layer=False)
        model.relative_bias = copy.deepcopy(self.relative_bias)  # an MPNet root's (in the files' weights too)
        return use_onednn_linear(model.eval())

    def get(self, tenant: int):
        from safetensors.torch import load_file

        if tenant in self.lru:
            self.lru.move_to_end(tenant)
            return self.lru[tenant]
        t = time.perf_counter()
        if len(self.lru) >= self.capacity:
            _, (model, _, _) = self.lru.popitem(last=False)
        else:
            model = self._spare.pop() if self._spare else self._new_model()
        path = self.files[tenant % len(self.files)]
        drop_page_cache(path)
        sd = load_file(str(path))
        head_w, head_b = sd.pop("head.w").float(), sd.pop("head.b").float()
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        self.load_s.append(time.perf_counter() - t)
        self.lru[tenant] = (model, head_w, head_b)
        return self.lru[tenant]

    @torch.no_grad()
    def run(self, tokenizer, texts: list[str], tenants: list[int]) -> torch.Tensor:
        """One batch, tenant by tenant (requests of one tenant run together)."""
        logits = torch.empty(len(texts), LABELS)
        groups = defaultdict(list)
        for i, t in enumerate(tenants):
            groups[t].append(i)
        for t, rows in groups.items():
            model, hw, hb = self.get(t)
            c = time.perf_counter()
            enc = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
            cls = full_forward(model, enc["input_ids"], enc["attention_mask"])[-1][:, 0]
            logits[rows] = cls @ hw.t() + hb
            self.compute_s.append((len(rows), time.perf_counter() - c))
        return logits


# -- the shared-weight schemes -------------------------------------------------------------------------
class SharedRoot:
    """Frozen root as a feature extractor for the whole batch; per-tenant heads gathered and applied
    in one ``baddbmm``. Shapes: heads (N, H, L); per batch cls (B, H) -> logits (B, L)."""

    def __init__(self, bert, n_tenants: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        H = bert.config.hidden_size
        self.bert = bert
        self.heads_w = 0.02 * torch.randn(n_tenants, H, LABELS, generator=g)
        self.heads_b = torch.zeros(n_tenants, 1, LABELS)

    @torch.no_grad()
    def run(self, tokenizer, texts: list[str], tenants: list[int]) -> torch.Tensor:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        cls = torch.empty(len(texts), 1, self.bert.config.hidden_size)
        for rows, T in length_groups(mask):  # as the served upper layers run a batch (split_by_length)
            cls[rows] = full_forward(self.bert, ids[rows, :T], mask[rows, :T])[-1][:, :1]
        idx = torch.tensor(tenants)
        return torch.baddbmm(self.heads_b[idx], cls, self.heads_w[idx])[:, 0]


def length_groups(mask: torch.Tensor, grouped: bool = True) -> list[tuple[torch.Tensor, int]]:
    """The rows of a right-padded batch (mask (B, T)) in the groups of similar length that the
    scheduler's upper layers run them in (``split_by_length``), each with its longest length T_g:
    a baseline that pads a batch of tweets beside reviews to the longest would spend time no
    served path spends. ``grouped=False``: every row in one group, as wide as the batch."""
    from hmi.scheduler.compute import PASS_OVERHEAD_TOKENS, split_by_length

    if not grouped:
        return [(torch.arange(mask.shape[0]), mask.shape[1])]
    lengths = mask.sum(1).tolist()
    groups = split_by_length(list(range(len(lengths))), lengths, PASS_OVERHEAD_TOKENS)
    return [(torch.tensor(g), max(lengths[r] for r in g)) for g in groups]


class FullContextLower:
    """The lower layers computed with full context (hBERT-adapter): stands where the PLOT lookup
    stands in hBERT, on the device the scheduler serves from (``SchedulerConfig.device``: a GPU
    where there is one), handing the states back in host memory as a lookup does. A batch runs in
    the groups of similar length the upper layers run it in (``length_groups``; a padding position
    past its group's width holds zeros, masked as every padding position is), or, with
    ``grouped=False``, as wide as the batch (the accuracy tables' cells were computed so; the two
    differ by rounding only). Shapes: ids, mask (B, T) -> (B, T, H)."""

    def __init__(self, bert, l_low: int, device: str = "auto", grouped: bool = True):
        import copy

        from hmi.scheduler.pipeline import pick_device

        self.device = pick_device(device)
        self.l_low = l_low
        self.grouped = grouped
        self.bert = bert if self.device.type == "cpu" else copy.deepcopy(bert).to(self.device)

    @torch.no_grad()
    def merged(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        from hmi.model.root import attention_mask

        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        out = torch.zeros(*ids.shape, self.bert.config.hidden_size)
        for rows, T in length_groups(mask_t, self.grouped):
            m = mask_t[rows, :T].to(self.device)
            h = self.bert.embeddings(input_ids=ids_t[rows, :T].to(self.device))
            ext = attention_mask(m, h.dtype, getattr(self.bert, "relative_bias", None))
            for layer in self.bert.encoder.layer[:self.l_low]:
                h = layer(h, ext)[0]
            out[rows, :T] = h.cpu()
        return out


def scheduler_rps(scheduler, texts, batches, warm: int) -> float:
    from hmi.scheduler.types import InferRequest

    def submit(bs):
        reqs = [InferRequest(f"t{t:05d}", texts[(bi * B + j) % len(texts)]) for bi, b in bs for j, t in enumerate(b)]
        for i in range(0, len(reqs), B):
            scheduler.submit(reqs[i:i + B])
        for r in reqs:
            r.future.result(600)
        return len(reqs)

    submit(list(enumerate(batches[:warm])))
    t = time.perf_counter()
    n = submit(list(enumerate(batches[warm:], start=warm)))
    return n / (time.perf_counter() - t)


def direct_rps(scheme, tokenizer, texts, batches, warm: int) -> float:
    n, t = 0, 0.0
    for bi, b in enumerate(batches):
        bt = [texts[(bi * B + j) % len(texts)] for j in range(len(b))]
        s = time.perf_counter()
        scheme.run(tokenizer, bt, b)
        if bi >= warm:
            t += time.perf_counter() - s
            n += len(b)
    return n / t


def headline(u: dict) -> dict:
    """The headline figures of the uniform cells ``u`` (scheme -> tenants -> cell): those whose
    tenant counts were run."""
    def rps(scheme: str, n: int):
        return u[scheme].get(str(n), {}).get("rps")

    out = {key: rps(scheme, n) for key, scheme, n in (
        ("rps_hbert_1", "hBERT", 1), ("rps_hbert_10k", "hBERT", 10000), ("rps_dedicated_1", "dedicated", 1),
        ("rps_dedicated_100", "dedicated", 100), ("rps_dedicated_1k", "dedicated", 1000),
        ("rps_hbert_adapter_1k", "hBERT-adapter", 1000))}
    for key, (a, na), (b, nb), digits in (("hbert_10k_over_1", ("hBERT", 10000), ("hBERT", 1), 3),
                                          ("hbert_over_dedicated_100", ("hBERT", 100), ("dedicated", 100), 2),
                                          ("hbert_over_dedicated_1k", ("hBERT", 1000), ("dedicated", 1000), 2),
                                          ("hbert_over_adapter_1k", ("hBERT", 1000), ("hBERT-adapter", 1000), 2)):
        if rps(a, na) and rps(b, nb):
            out[key] = round(rps(a, na) / rps(b, nb), digits)
    return {k: v for k, v in out.items() if v is not None}


# -- plots ----------------------------------------------------------------------------------------------
def plot_throughput(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, dist in zip(axes, ("uniform", "zipf")):
        for scheme, series in res[dist].items():
            xs = sorted(int(k) for k in series)
            ys = [series[str(x)]["rps"] for x in xs]
            derived = [series[str(x)].get("derived", False) for x in xs]
            line, = ax.plot(xs, ys, marker="o", label=scheme)
            dx = [x for x, d in zip(xs, derived) if d]
            if dx:
                ax.plot(dx, [y for y, d in zip(ys, derived) if d], "x", color=line.get_color(), markersize=10)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tenants")
        ax.set_title(f"tenants drawn {dist} (x: derived from measured load/compute times)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("requests / s (32 x 128 tokens)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# -- main -----------------------------------------------------------------------------------------------
def main() -> None:
    def options(ap):
        ap.add_argument("--model-files", type=int, default=MODEL_FILES, help="real model files per swapping scheme (disk budget)")
        ap.add_argument("--counts", default=",".join(map(str, COUNTS)),
                        help="tenant counts, comma-separated (default %(default)s; 1 and 1000 carry the headline ratios)")
        ap.add_argument("--adapter", help="the tenants' adapters of hBERT and hBERT-adapter: bottleneck[:REDUCTION] "
                                          "(default bottleneck:16), "
                                          "lora[:RANK[:all|SITE+SITE]] (LoRA on q+v by default; all: every linear layer) or "
                                          "ia3; another than the default "
                                          "writes its own page (bench_tenants_..._adapter-KIND-SIZE)")
        root_options(ap)

    args = start(__doc__, options)
    try:
        counts = tuple(sorted({int(c) for c in args.counts.split(",") if c.strip()}))
    except ValueError:
        raise SystemExit(f"--counts: comma-separated tenant counts, got {args.counts!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--counts: positive tenant counts, got {args.counts!r}")
    adapter = adapter_options(args.adapter)  # checked before the root is loaded
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore, weights_bytes
    from hmi.data import load_task
    from hmi.plot.lookup import PlotLookup
    from hmi.plot.paths import root_plot_path
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants, TenantEntry

    root, version = prepared_root(root=args.root, l_low=args.l_low)
    lookup = PlotLookup([version], policy="backoff")
    tok, bert, l_low, H = root.tokenizer, root.bert, root.spec.l_low, root.hidden_size
    texts = [r["text"] for r in load_task("news-topic", "test")]
    texts = [tok.decode(tok(t, truncation=True, max_length=MAX_LEN)["input_ids"][1:-1]) for t in texts]
    texts = [t for t in texts if len(tok(t)["input_ids"]) <= MAX_LEN]
    measured_batches = 1 if args.tiny else 3 if args.quick else 10
    uniform_rounds = 1 if args.tiny else ROUNDS  # behind each uniform hBERT / hBERT-adapter cell
    warm = 1
    spec = AdapterSpec.for_task("classification", tuple("abcde"), **adapter)
    tmp = Path(tempfile.mkdtemp(prefix="hmi-bench-tenants-"))
    res: dict = {"uniform": defaultdict(dict), "zipf": defaultdict(dict)}
    out: dict = {}
    try:
        # Tenant state: 10,000 adapters (fp16 files) and 100 model files per swapping scheme.
        t0 = time.perf_counter()
        variants = adapter_variants(bert, l_low, spec, 32, seed=1)
        adapter_bytes = weights_bytes({k: v.half() for k, v in variants[0].items()})
        upper_bytes = sum(p.numel() * 4 for p in bert.encoder.layer[l_low:].parameters())
        root_bytes = sum(p.numel() * 4 for p in bert.parameters())
        store = AdapterStore(tmp / "adapters", host_cache_mb=(BUDGET - root_bytes) / 2**20)
        for i in range(max(counts)):
            store.save(f"t{i:05d}", spec, variants[i % 32])
        dedicated_files = write_model_files(bert, bert.config.num_hidden_layers, args.model_files, tmp / "dedicated", 2)
        compress_files = write_model_files(bert, 2, args.model_files, tmp / "compress", 3)
        disk = {name: sum(p.stat().st_size for p in (tmp / name).rglob("*") if p.is_file())
                for name in ("adapters", "dedicated", "compress")}
        print(f"tenant files written in {time.perf_counter() - t0:.0f} s: "
              + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in disk.items()), flush=True)
        # The PLOT is read through the page cache (it is not model weights): read it once so that
        # the first tenant counts do not pay for a cold cache that the later ones do not.
        plot_bytes = warm_page_cache(root_plot_path(root))
        entries = {f"t{i:05d}": TenantEntry(f"t{i:05d}", spec) for i in range(max(counts))}
        full_lower = FullContextLower(bert, l_low)
        shared = SharedRoot(bert, max(counts))
        swap_cfg = {"dedicated": bert.config, "compress": type(bert.config).from_dict({**bert.config.to_dict(), "num_hidden_layers": 2})}
        swap_files = {"dedicated": dedicated_files, "compress": compress_files}
        swap_stats: dict = {}

        def served_rps(scheme: str, batches) -> float:
            """Requests / s of a fresh scheduler (cold device pool) serving the trace: hBERT reads the PLOT,
            hBERT-adapter computes the lower layers with full context."""
            cfg = SchedulerConfig(max_batch=B, pool_slots=64, pipeline_retrieval=scheme == "hBERT")
            s = Scheduler(bert, l_low, tok, store, FixedTenants(entries),
                          FixedTenants(entries, lookup if scheme == "hBERT" else full_lower), cfg)
            try:
                return scheduler_rps(s, texts, batches, warm)
            finally:
                s.shutdown()

        def swapped(scheme: str, batches) -> dict:
            """The cell of a swapping scheme serving the trace from its real model files; adds the
            measured load and compute times to ``swap_stats`` (from which larger counts are derived)."""
            sw = ModelSwapper(swap_cfg[scheme], swap_files[scheme], BUDGET, getattr(bert, "relative_bias", None))
            rps = direct_rps(sw, tok, texts, batches, warm)
            misses, reqs = lru_misses(batches, sw.capacity, warm)
            st = swap_stats.setdefault(scheme, {"load_s": [], "single_s": [], "per_request_s": [], "capacity": sw.capacity,
                                                "model_bytes": sw.model_bytes})
            st["load_s"] += sw.load_s
            st["single_s"] += [s for k, s in sw.compute_s if k == 1]
            st["per_request_s"] += [s / k for k, s in sw.compute_s]
            return {"rps": round(rps, 2), "miss_rate": round(misses / reqs, 3)}

        # The process's first batches pay one-off costs (kernel selection, allocator growth, first
        # PLOT pages): run a few through each scheduler kind before any point is measured.
        for fast in (True, False):
            s = Scheduler(bert, l_low, tok, store, FixedTenants(entries),
                          FixedTenants(entries, lookup if fast else full_lower),
                          SchedulerConfig(max_batch=B, pool_slots=64, pipeline_retrieval=fast))
            scheduler_rps(s, texts, trace(min(32, max(counts)), "uniform", 4, seed=0), 1)
            s.shutdown()
        for dist in ("uniform", "zipf"):
            for n in counts:
                batches = trace(n, dist, warm + measured_batches, seed=n)
                # The headline ratios read the uniform cells of hBERT and hBERT-adapter: there the two
                # schemes alternate for several rounds, each on a fresh trace, and the cell is the median.
                n_rounds = uniform_rounds if dist == "uniform" else 1
                rounds = {"hBERT": [], "hBERT-adapter": []}
                for r in range(n_rounds):
                    bs = batches if r == 0 else trace(n, dist, warm + measured_batches, seed=n + 7919 * r)
                    for t in {f"t{t:05d}" for b in bs for t in b}:
                        store.load(t)  # adapters live in host memory; device pools start cold
                    for scheme in rounds:
                        rounds[scheme].append(round(served_rps(scheme, bs), 2))
                for scheme, v in rounds.items():
                    res[dist][scheme][str(n)] = {"rps": round(float(np.median(v)), 2)}
                    if n_rounds > 1:
                        res[dist][scheme][str(n)]["rounds"] = v
                res[dist]["shared"][str(n)] = {"rps": round(direct_rps(shared, tok, texts, batches, warm), 2)}
                for scheme in ("dedicated", "compress"):
                    if n <= args.model_files:
                        res[dist][scheme][str(n)] = swapped(scheme, batches)
                print(dist, n, {k: v[str(n)]["rps"] for k, v in res[dist].items() if str(n) in v}, flush=True)
            for scheme in ("dedicated", "compress"):
                if scheme not in swap_stats:  # no count ran within the model files: measure them on a trace of their own
                    swapped(scheme, trace(args.model_files, dist, warm + measured_batches, seed=args.model_files))
            # Swapping schemes beyond the model files: derived from measured per-miss load time, per-request
            # compute time and the LRU's miss rate on the same trace.
            for scheme, st in swap_stats.items():
                # A request's compute alone; when no tenant group had a single request (only counts above
                # the model files ran), a group's compute per request stands in.
                t_load = float(np.median(st["load_s"])) if st["load_s"] else 0.0
                t_req = float(np.median(st["single_s"] or st["per_request_s"]))
                st["median_load_ms"], st["median_request_ms"] = round(t_load * 1e3, 1), round(t_req * 1e3, 1)
                for n in counts:
                    batches = trace(n, dist, warm + measured_batches, seed=n)
                    misses, reqs = lru_misses(batches, st["capacity"], warm)
                    derived = reqs / (reqs * t_req + misses * t_load)
                    row = res[dist][scheme].setdefault(str(n), {"rps": round(derived, 2), "derived": True,
                                                                "miss_rate": round(misses / reqs, 3)})
                    row["derived_rps"] = round(derived, 2)

        u = res["uniform"]
        out = headline(u)
        out["throughput"] = {d: dict(v) for d, v in res.items()}
        samples = ("load_s", "single_s", "per_request_s")
        out["swapping"] = {k: {kk: vv for kk, vv in v.items() if kk not in samples} for k, v in swap_stats.items()}
        out["disk_bytes"] = disk
        out["plot_bytes"] = plot_bytes

        # Memory (Table 2 analog): weights held in memory, base + per tenant, and tenants that fit 2 GiB.
        head_bytes = LABELS * (H + 1) * 4
        mem = {
            "dedicated": (0, swap_stats["dedicated"]["model_bytes"]),
            "compress": (0, swap_stats["compress"]["model_bytes"]),
            "shared": (root_bytes, head_bytes),
            "hBERT-adapter": (root_bytes, adapter_bytes),
            "hBERT": (upper_bytes, adapter_bytes),
        }
        out["memory"] = {k: {"base_bytes": b, "per_tenant_bytes": p, "tenants_in_2gib": int((BUDGET - b) // p)}
                         for k, (b, p) in mem.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    name = result_name("bench_tenants", args) + ("_adapter-" + args.adapter.replace(":", "-") if args.adapter else "")
    png = "tenants_throughput" + name.removeprefix("bench_tenants") + ".png"
    plot_throughput(res, DOCS / png)
    schemes = ("hBERT", "hBERT-adapter", "shared", "dedicated", "compress")
    text = "### Throughput (requests / s, batches of 32 x 128 tokens of real BBC text)\n\n"
    for dist in ("uniform", "zipf"):
        rows = []
        for s in schemes:
            cells = []
            for n in counts:
                c = res[dist][s][str(n)]
                cells.append(f"{c['rps']:.2f}" + (" (derived)" if c.get("derived") else "")
                             + (f", miss {c['miss_rate']:.2f}" if "miss_rate" in c else ""))
            rows.append((s, *cells))
        text += f"Tenants drawn {dist}:\n\n" + table(rows, ("scheme", *(f"{n:,} tenants" for n in counts))) + "\n\n"
    text = (f"Root: {root.spec.name}, split {l_low}+{bert.config.num_hidden_layers - l_low}; tenants of hBERT and "
            f"hBERT-adapter: {describe_adapter(spec.to_dict())} in the upper layers.\n\n" + text)
    text += (f"Plot: `docs/{png}`. Dedicated and compress models are real fp16 safetensors files "
             f"({args.model_files} per scheme; page cache dropped before every load, so a miss reads the disk); beyond "
             f"{args.model_files} tenants their figures are derived: requests / (requests x median single-request compute "
             "+ LRU misses on the same trace x median load time), labelled (derived). Swapping: "
             + "; ".join(f"{k}: LRU of {v['capacity']} models of {v['model_bytes'] / 2**20:.1f} MiB, median load "
                         f"{v['median_load_ms']} ms, median single-request compute {v['median_request_ms']} ms"
                         for k, v in out["swapping"].items())
             + f". Disk: {', '.join(f'{k} {v / 2**30:.2f} GiB' for k, v in disk.items())}.\n\n")
    text += (f"hBERT and hBERT-adapter with tenants drawn uniformly are the medians of {uniform_rounds} rounds in which the two "
             f"alternate, each round on a fresh trace of {measured_batches} measured batches (requests / s per round: "
             + "; ".join(f"{k:,} tenants: hBERT {res['uniform']['hBERT'][str(k)].get('rounds')}, hBERT-adapter "
                         f"{res['uniform']['hBERT-adapter'][str(k)].get('rounds')}" for k in counts)
             + f"). Every other cell is one run of {measured_batches} batches after one warm-up batch.\n\n")
    rows = [(k, f"{v['base_bytes'] / 2**20:.1f}", f"{v['per_tenant_bytes'] / 2**10:,.1f}", f"{v['tenants_in_2gib']:,}")
            for k, v in out["memory"].items()]
    text += "### Memory for model weights (2 GiB budget)\n\n" + table(rows, ("scheme", "base MiB", "per tenant KiB",
                                                                            "tenants held in 2 GiB")) + "\n\n"
    text += ("Dedicated/compress/shared/hBERT-adapter hold fp32 weights for compute; adapters are kept in host memory "
             "in fp16 and widened in the device pool. hBERT's base is the upper layers only: the lower layers' work "
             "is the PLOT, an LMDB file read through the page cache, not weights in the budget.")
    out["root"], out["l_low"], out["adapter"] = root.spec.name, l_low, adapter
    command = ("python benchmarks/bench_tenants.py" + (" --quick" if args.quick else "")
               + (f" --model-files {args.model_files}" if args.model_files != MODEL_FILES else "")
               + (f" --counts {','.join(map(str, counts))}" if counts != COUNTS else "")
               + (f" --adapter {args.adapter}" if args.adapter else "") + root_flags(args))
    finish(name, text, out, command)


if __name__ == "__main__":
    main()
