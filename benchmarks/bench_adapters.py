"""Batched multi-tenant adapters against one request at a time, memory per tenant, swap-in cost.

Usage: python benchmarks/bench_adapters.py [--quick]
"""

from __future__ import annotations

import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, round_robin, start, table, timeit  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def alternating(a, b, rounds: int) -> tuple[float, float]:
    """Median seconds of ``a()`` and of ``b()`` over ``rounds`` rounds that run one after the other."""
    med = round_robin({"a": a, "b": b}, rounds)
    return med["a"], med["b"]


def padded_segments(x, slots: list[int], w):
    """The former layout of ``segment_bmm``, kept as the comparison: the requests of one tenant
    stacked into a zero-padded (tenants, longest segment, T, Din) operand, each tenant's matrix
    gathered once, one ``bmm``.  Shapes: x (N, T, Din); w (S, Din, Dout) -> (N, T, Dout)."""
    uniq = sorted(set(slots))
    seg = {s: i for i, s in enumerate(uniq)}
    rank, seen = [], {}
    for s in slots:
        rank.append(seen.get(s, 0))
        seen[s] = rank[-1] + 1
    inv, rank = torch.tensor([seg[s] for s in slots]), torch.tensor(rank)
    n, t, d_in = x.shape
    buf = x.new_zeros(len(uniq), max(seen.values()), t, d_in)
    buf[inv, rank] = x
    y = torch.bmm(buf.view(len(uniq), -1, d_in), w.index_select(0, torch.tensor(uniq)))
    return y.view(len(uniq), -1, t, w.shape[2])[inv, rank]


def layout_costs(rounds: int, g) -> tuple[list[tuple], dict]:
    """``segment_bmm`` (each request's matrix gathered, thin outputs transposed) against the
    padded per-tenant segments it replaced and against the untransposed per-request product, for
    the adapter products of a batch of 32 requests x 64 tokens (hidden 384) and several tenant
    mixes; each checked against the per-request loop."""
    import numpy as np

    from hmi.adapters.batched import segment_bmm, segment_plan

    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 65)
    mixes = {"uniform over 64 tenants": rng.integers(0, 64, 32).tolist(),
             "Zipf over 64 tenants": rng.choice(64, 32, p=p / p.sum()).tolist(),
             "one tenant with 28 requests, 4 others": [0] * 28 + [1, 2, 3, 4]}
    products = {"LoRA A (384 x 8)": (384, 8), "LoRA B (8 x 384)": (8, 384),
                "bottleneck down (384 x 24)": (384, 24), "bottleneck up (24 x 384)": (24, 384)}
    rows, out = [], {}
    for mix, slots in mixes.items():
        s, plan = torch.tensor(slots), segment_plan(slots)
        for name, (d_in, d_out) in products.items():
            x, w = torch.randn(32, 64, d_in, generator=g), torch.randn(64, d_in, d_out, generator=g)
            ref = torch.stack([x[n] @ w[k] for n, k in enumerate(slots)])
            fns = {"now": lambda: segment_bmm(x, s, w, plan=plan), "padded": lambda: padded_segments(x, slots, w),
                   "plain": lambda: torch.bmm(x, w.index_select(0, s))}
            for fn in fns.values():
                torch.testing.assert_close(fn(), ref, atol=1e-4, rtol=1e-4)
            med = round_robin(fns, rounds, warmup=3)
            out.setdefault(mix, {})[name] = {k: round(v * 1e6, 1) for k, v in med.items()}
            rows.append((mix, name, f"{med['padded'] * 1e6:.0f}", f"{med['plain'] * 1e6:.0f}", f"{med['now'] * 1e6:.0f}",
                         f"{med['padded'] / med['now']:.2f}"))
    return rows, out


def kind_costs(bert, l_low: int, rounds: int, g) -> tuple[list[tuple], dict]:
    """What an adapter kind costs a batch of 32 distinct tenants in the shared upper layers (no
    adapter, bottleneck, LoRA on q and v, LoRA on every linear layer), and its weights per tenant."""
    from hmi.adapters.batched import Group, upper_forward
    from hmi.adapters.pool import SlotPool
    from hmi.adapters.spec import AdapterSpec
    from hmi.model.hplm import UpperLayers

    H, inter = bert.config.hidden_size, bert.config.intermediate_size
    n_layers, B = bert.config.num_hidden_layers - l_low, 32
    labels = tuple(f"c{i}" for i in range(5))
    specs = {"bottleneck r16 (default)": AdapterSpec("bottleneck", labels=labels),
             "LoRA r16 on q, v": AdapterSpec("lora", rank=16, alpha=16, labels=labels),
             "LoRA r16 on q, k, v, FFN in, FFN out": AdapterSpec("lora", rank=16, alpha=16, targets="all", labels=labels)}
    layers = UpperLayers(bert, l_low).layers
    slots = torch.arange(B)
    rows, results = [], {}
    for T in (32, 128):
        x = torch.randn(B, T, H, generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        fns = {"no adapter": lambda: upper_forward(layers, x, mask, [])}
        weights = {"no adapter": 0}
        for name, spec in specs.items():
            pool = SlotPool(spec.signature(H), B, n_layers, H, inter, max_labels=8, scaling=spec.scaling)
            for layer in pool.layers:
                for t in layer.values():
                    t.copy_(0.05 * torch.randn(t.shape, generator=g))
            weights[name] = sum(t[0].numel() for t in pool.layers[0].values()) * n_layers
            fns[name] = lambda pool=pool: upper_forward(layers, x, mask, [Group(slots, slots, pool, True)])
        with torch.no_grad():
            med = round_robin(fns, rounds)
        base = med["no adapter"]
        for name, sec in med.items():
            rows.append((name, T, f"{weights[name]:,}", f"{sec * 1e3:.1f}", f"{sec / base:.2f}"))
            results[f"{name} {T}tok over no adapter"] = round(sec / base, 3)
    return rows, results


def with_mkl(fn):
    """Runs ``fn`` with the linear layers on ATen's default (MKL) kernel."""
    from hmi.model import kernels

    saved, kernels.ONEDNN_LINEAR = kernels.ONEDNN_LINEAR, False
    try:
        return fn()
    finally:
        kernels.ONEDNN_LINEAR = saved


def main() -> None:
    args = start(__doc__, lambda ap: ap.add_argument("--tenants-10k", type=int, default=10_000))
    from hmi.adapters.batched import Group, batched_bottleneck, upper_forward
    from hmi.adapters.interop import attach, from_library, library_model
    from hmi.adapters.pool import SlotPool
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore, weights_bytes
    from hmi.model.hplm import UpperLayers
    from hmi.model.root import default_spec, load_bert

    repeat = 3 if args.quick else 7
    rounds = 7 if args.quick else 15
    spec = AdapterSpec("bottleneck", labels=tuple(f"c{i}" for i in range(5)))
    bert = load_bert(default_spec().model_dir)
    l_low, H = 3, bert.config.hidden_size
    n_layers = bert.config.num_hidden_layers - l_low
    B = 32
    g = torch.Generator().manual_seed(0)

    # 32 tenants with trained-looking (random, non-zero) adapters; the library holds them too.
    lib = library_model(bert)
    weights = {}
    for i in range(B):
        name = f"t{i}"
        attach(lib, name, spec, l_low)
        with torch.no_grad():
            for pname, p in lib.named_parameters():
                if f".{name}." in pname:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        w = from_library(lib, name, spec, l_low)
        w["head.w"] = 0.05 * torch.randn(H, 5, generator=g)
        w["head.b"] = torch.zeros(5)
        weights[name] = w
    lib.eval()
    pool = SlotPool(spec.signature(H), B, n_layers, H, bert.config.intermediate_size, max_labels=8)
    t0 = time.perf_counter()
    for i in range(B):
        pool.write(i, weights[f"t{i}"])
    swap_us = (time.perf_counter() - t0) / B * 1e6
    layers = UpperLayers(bert, l_low).layers
    all_slots = torch.arange(B)

    results, rows = {}, []
    with torch.no_grad():
        for T in (32, 128):
            x = torch.randn(B, T, H, generator=g)
            mask = torch.ones(B, T, dtype=torch.long)
            batched = lambda: upper_forward(layers, x, mask, [Group(torch.arange(B), all_slots, pool, True)])
            one = lambda: [upper_forward(layers, x[i:i + 1], mask[i:i + 1],
                                         [Group(torch.tensor([0]), torch.tensor([i]), pool, True)]) for i in range(B)]
            tb, to = alternating(batched, one, rounds)
            results[f"batched_vs_per_request_{T}tok"] = round(to / tb, 2)
            rows.append((f"upper layers, 32 tenants x {T} tokens", f"{tb * 1e3:.1f}", f"{to * 1e3:.1f}", f"{to / tb:.2f}"))
            if T == 128:
                tm, td = alternating(lambda: with_mkl(batched), batched, rounds)
                results["onednn_over_mkl_128tok"] = round(tm / td, 2)
                kernel_row = ("upper layers batched, 32 x 128 tokens", f"{tm * 1e3:.1f}", f"{td * 1e3:.1f}", f"{tm / td:.2f}")
            if T == 32:
                out = batched()
                errs = []
                for i in range(B):
                    lib.set_active_adapters(f"t{i}")
                    ref = UpperLayers(lib, l_low)(x[i:i + 1], mask[i:i + 1])
                    errs.append(float((out[i] - ref[0]).abs().max()))
                lib.set_active_adapters(None)
                results["max_abs_err_vs_reference"] = float(f"{max(errs):.2e}")
        a = torch.randn(B, 32, H, generator=g)
        lw = pool.layer(0)
        tb = timeit(lambda: batched_bottleneck(a, all_slots, lw["down_w"], lw["down_b"], lw["up_w"], lw["up_b"]), repeat * 5)
        tl = timeit(lambda: [torch.relu(a[i] @ lw["down_w"][i] + lw["down_b"][i]) @ lw["up_w"][i] + lw["up_b"][i]
                             for i in range(B)], repeat * 5)
        results["adapter_bmm_vs_loop"] = round(tl / tb, 2)
        rows.append(("bottleneck alone, stacked bmm vs loop (32 x 32 tok)", f"{tb * 1e3:.2f}", f"{tl * 1e3:.2f}", f"{tl / tb:.2f}"))

    kind_rows, kind_results = kind_costs(bert, l_low, rounds, g)
    layout_rows, results["segment_bmm_us"] = layout_costs(rounds * 3, g)
    results["upper_layers_time_by_kind"] = kind_results

    # Host memory per tenant and 10,000 tenants registered and servable in one process.
    host_bytes = weights_bytes({k: v.half() for k, v in weights["t0"].items()})
    results["host_bytes_per_tenant"] = host_bytes
    tmp = Path(tempfile.mkdtemp())
    try:
        n = args.tenants_10k
        base_rss = rss_mb()
        store = AdapterStore(tmp / "tenants", host_cache_mb=4096)
        t0 = time.perf_counter()
        for i in range(n):
            w = weights[f"t{i % B}"]
            store.save(f"tenant-{i:05d}", spec, w)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            store.load(f"tenant-{i:05d}")
        load_s = time.perf_counter() - t0
        results["rss_mb_10k_tenants"] = round(rss_mb(), 1)
        results["rss_mb_added_by_10k_tenants"] = round(rss_mb() - base_rss, 1)
        results["disk_load_us_per_tenant"] = round(load_s / n * 1e6, 1)
        results["tenants_registered"] = n
        results["save_s_10k"] = round(save_s, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["swap_in_us_per_tenant"] = round(swap_us, 1)
    text = table(rows, ("workload (CPU, fp32)", "batched ms", "one at a time ms", "speed-up"))
    text += ("\n\nBoth sides of a row alternate over " + str(rounds) + " rounds (medians), so drifts of this "
             "shared machine hit them alike. Linear layers run through oneDNN (`hmi/model/kernels.py`):\n\n"
             + table([kernel_row], ("workload (CPU, fp32)", "MKL ms", "oneDNN ms", "speed-up")))
    text += ("\n\nWhat the adapter kind costs the shared upper layers (32 distinct tenants in one batch, all "
             f"{n_layers} upper layers, median of {rounds} rounds that run every kind in turn):\n\n"
             + table(kind_rows, ("adapter", "tokens", "adapter weights per tenant", "ms", "time / no adapter")))
    text += ("\n\nOne adapter product for a batch of 32 requests x 64 tokens, each request with its tenant's "
             "matrix (`segment_bmm`), microseconds (median of " + str(rounds * 3) + " rounds that run the three in "
             "turn; each checked against the per-request loop): the padded per-tenant segments it used to stack, "
             "each request's matrix gathered and one `bmm`, and `segment_bmm` now (the same, with an output "
             "narrower than T computed transposed):\n\n"
             + table(layout_rows, ("tenants in the batch", "product", "padded segments us", "per request us",
                                   "segment_bmm us", "padded / segment_bmm")))
    text += (f"\n\nmax |batched - adapters library one tenant at a time|: {results['max_abs_err_vs_reference']}\n"
             f"host bytes per tenant (bottleneck r=24 on 3 layers + 5-class head, fp16): {host_bytes} "
             f"({host_bytes / 1024:.0f} KiB)\n"
             f"{n} tenants stored and loaded into host memory: process RSS {results['rss_mb_10k_tenants']} MB "
             f"(+{results['rss_mb_added_by_10k_tenants']} MB for the tenants; the root model included), "
             f"disk -> host {results['disk_load_us_per_tenant']} us per tenant, host -> pool {swap_us:.0f} us per tenant.")
    finish("bench_adapters", text, results, "python benchmarks/bench_adapters.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
