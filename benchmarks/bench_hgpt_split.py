"""hGPT's split against the full model, side by side on one engine: perplexity of held-out real
text and generation speed with the calibrated windows of 2 layers (the shipped split) and of a
deeper split (``hmi calibrate --decoder --l-low 8``), each over its causal PLOT, and with no
windows at all (the full model: every layer in the engine, with its KV cache).  The same requests
and tenants (rank-8 LoRA on q and v of every layer the split leaves to the engine), rounds
interleaved.

Usage: python benchmarks/bench_hgpt_split.py [--quick] [--deep 8]
The deeper split's windows are the home's newest calibrated artifact of that split; its causal
PLOT is built first where it is not (about half an hour for 8 layers on 2 cores).
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_hgpt import lora_base, prompts, random_lora  # noqa: E402
from benchmarks.common import finish, start, table  # noqa: E402

SHALLOW = 2
TENANTS = 10


def split_roots(home: Path, deep: int) -> dict:
    """The three variants' decoder roots: the full model (no windows), the shipped split and the
    home's deeper one."""
    from hmi.model.decoder import DecoderRoot, load_decoder
    from hmi.training.calibrate_decoder import decoder_folders, find_shipped_decoder, load_decoder_folder

    base = load_decoder(l_low=SHALLOW)
    full = DecoderRoot(base.model, base.tokenizer, 0, "smollm2-135m-full")
    shallow_folder = (decoder_folders(home, SHALLOW) or [find_shipped_decoder(base)])[0]
    deep_folders = decoder_folders(home, deep)
    if shallow_folder is None or not deep_folders:
        missing = deep if not deep_folders else SHALLOW
        raise SystemExit(f"no calibrated decoder windows of {missing} layers in {home}: run "
                         f"`hmi calibrate --decoder --l-low {missing}` first")
    return {"full model (no windows)": full,
            f"hGPT, {SHALLOW} windowed layers": load_decoder_folder(shallow_folder, base),
            f"hGPT, {deep} windowed layers": load_decoder_folder(deep_folders[0])}


def runtime(root, home: Path, tmp: Path, miss_policy: str = "compute", store=None):
    """The generation engine of ``root`` over its causal PLOT (the full model: an empty store whose
    every lookup computes the token's embedding), with ``TENANTS`` random rank-8 LoRA tenants;
    ``miss_policy`` ``backoff``: a tri-gram the PLOT lacks is served from its bi-/uni-gram; ``store``:
    an engine's already open (LMDB opens an environment once per process)."""
    from hmi.hgpt.generation import EngineConfig
    from hmi.hgpt.runtime import HgptRuntime
    from hmi.plot.paths import ensure_root_plot, open_root_store
    from hmi.plot.store import PlotMeta, PlotStore

    if store is not None:
        pass
    elif root.l_low == 0:
        store = PlotStore(tmp / "no-windows", meta=PlotMeta(root.artifact_id, 0, root.hidden_size, n=1, kind="causal"),
                          readonly=False)
    else:
        ensure_root_plot(root, home=home)
        store = open_root_store(root, home)
    spec, base = lora_base(root)
    g = torch.Generator().manual_seed(0)
    tenants = {f"t{i}": random_lora(base, g) for i in range(TENANTS)}
    rt = HgptRuntime(root, store, lambda t: (spec, tenants[t]), miss_policy=miss_policy,
                     cfg=EngineConfig(rank=8, max_active=64, max_len=256, lora_slots=TENANTS))
    rt.service.shutdown()  # driven directly here
    return rt


def generate(rt, texts: list[str], new_tokens: int, seed: int) -> tuple[float, int]:
    """Seconds to generate ``new_tokens`` for every text (greedy, tenants drawn), tokens generated."""
    from hmi.hgpt.generation import GenRequest

    rng = random.Random(seed)
    reqs = [GenRequest(f"t{rng.randrange(TENANTS)}", t, max_new_tokens=new_tokens) for t in texts]
    t0 = time.perf_counter()
    out = rt.engine.generate(reqs)
    return time.perf_counter() - t0, sum(r["tokens"] for r in out)


def main() -> None:
    args = start(__doc__, lambda ap: ap.add_argument("--deep", type=int, default=8, help="the deeper split (default 8)"))
    from hmi.data import held_out_texts
    from hmi.home import hmi_home
    from hmi.model.decoder import perplexity
    from hmi.training.demo import DEMO_DECODER_TENANTS, train_demo_decoder

    home = hmi_home()
    roots = split_roots(home, args.deep)
    texts = held_out_texts(32 if args.quick else 128)
    res: dict = {"variants": {}}
    tmp = Path(tempfile.mkdtemp(prefix="hmi-bench-hgpt-split-"))
    deep_backoff = f"hGPT, {args.deep} windowed layers, misses backed off"
    try:
        runtimes = {name: runtime(root, home, tmp) for name, root in roots.items()}
        runtimes[deep_backoff] = runtime(roots[f"hGPT, {args.deep} windowed layers"], home, tmp, "backoff",
                                         runtimes[f"hGPT, {args.deep} windowed layers"].store)
        roots[deep_backoff] = roots[f"hGPT, {args.deep} windowed layers"]
        with torch.no_grad():
            ppl_full = perplexity(roots["full model (no windows)"], texts, "full")
            for name, root in roots.items():
                # As served: through the engine's own lookup (its PLOT, and its miss policy).
                ppl = ppl_full if root.l_low == 0 else perplexity(root, texts, "served", served=runtimes[name].lookup.merged)
                res["variants"][name] = {"windowed_layers": root.l_low, "artifact": root.artifact_id,
                                         "miss_policy": runtimes[name].miss_policy if root.l_low else None,
                                         "ppl": round(ppl, 3), "ppl_ratio": round(ppl / ppl_full, 3)}
        for rt in runtimes.values():
            rt.lookup.hits.clear()  # the speed runs' hit rates, not the perplexity texts'
        n_req, new_tokens, rounds = (32, 16, 2) if args.quick else (64, 24, 3)
        reqs_text = prompts(roots["full model (no windows)"].tokenizer, n_req)
        prompt_tokens = 32 * n_req
        for rt in runtimes.values():
            generate(rt, reqs_text[:4], 4, 0)  # warm-up
        times = {name: {"prefill": [], "generate": []} for name in runtimes}
        for r in range(rounds):
            for name, rt in runtimes.items():
                times[name]["prefill"].append(generate(rt, reqs_text, 1, r)[0])
                sec, tokens = generate(rt, reqs_text, new_tokens, r)
                times[name]["generate"].append(sec / tokens)
        for name, rt in runtimes.items():
            hits = dict(rt.lookup.hits)
            served = sum(v for k, v in hits.items() if k.startswith("trigram"))
            res["variants"][name].update({
                "prefill_tokens_per_s": round(prompt_tokens / min(times[name]["prefill"]), 1),
                "tokens_per_s": round(1 / min(times[name]["generate"]), 2),
                "trigram_hit_rate": round(served / max(1, sum(hits.values())), 4) if roots[name].l_low else None})
        for name, rt in runtimes.items():  # the demo decoder tenant's fine-tune job on each split
            if name == deep_backoff:  # trains what the computing lookup trains (misses matter when serving)
                continue
            t0 = time.perf_counter()
            _, _, metrics = train_demo_decoder(DEMO_DECODER_TENANTS[0], roots[name], rt.lookup, 8, progress=False)
            res["variants"][name]["finetune"] = {**{k: metrics[k] for k in ("dev_ppl_before", "dev_ppl_after")},
                                                 "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    full = res["variants"]["full model (no windows)"]
    rows = []
    for name, v in res["variants"].items():
        v["tokens_per_s_over_full"] = round(v["tokens_per_s"] / full["tokens_per_s"], 3)
        v["prefill_over_full"] = round(v["prefill_tokens_per_s"] / full["prefill_tokens_per_s"], 3)
        rows.append((name, v["windowed_layers"], f"{v['ppl']:.2f}", f"{v['ppl_ratio']:.3f}",
                     f"{v['prefill_tokens_per_s']:,.0f}", f"{v['prefill_over_full']:.2f}",
                     f"{v['tokens_per_s']:.1f}", f"{v['tokens_per_s_over_full']:.2f}",
                     f"{v['finetune']['dev_ppl_before']:.2f} -> {v['finetune']['dev_ppl_after']:.2f} "
                     f"({v['finetune']['seconds']:.0f} s)" if "finetune" in v else "(the row above's)"))
    deep = res["variants"][f"hGPT, {args.deep} windowed layers"]
    backed = res["variants"][deep_backoff]
    res.update({"ppl_full": round(ppl_full, 3), "windowed_layers": args.deep, "ppl_ratio_calibrated": deep["ppl_ratio"],
                "tokens_per_s_over_full": deep["tokens_per_s_over_full"], "prefill_over_full": deep["prefill_over_full"],
                "backoff_ppl_ratio": backed["ppl_ratio"], "backoff_tokens_per_s_over_full": backed["tokens_per_s_over_full"],
                "backoff_prefill_over_full": backed["prefill_over_full"],
                "requests": n_req, "prompt_tokens": 32, "new_tokens": new_tokens, "tenants": TENANTS,
                "eval_texts": len(texts)})
    text = table(rows, ("engine", "windowed layers (of 30)", "perplexity", "of the full model's",
                        "prompt tokens/s", "of full", "generated tokens/s", "of full",
                        "a tenant's LoRA fine-tune: dev perplexity"))
    text += (f"\n\nPerplexity of {len(texts)} held-out real texts of four tasks (up to 128 tokens), SmolLM2-135M. "
             f"Speed: {n_req} requests of 32-token real prompts, {TENANTS} tenants drawn (rank-8 LoRA on q and v of "
             f"every layer above the split), all decoded together by the generation engine; prompt tokens/s from "
             f"runs that generate one token, generated tokens/s from runs of {new_tokens} new tokens (greedy), best "
             f"of {rounds} interleaved rounds. The windowed variants read their causal PLOT (built from the general "
             f"corpus), computing what it lacks, or (misses backed off) serving a tri-gram it lacks from its bi- or "
             f"uni-gram; perplexity is measured as served, through each engine's own lookup. The full model runs every "
             f"layer. The fine-tune is "
             f"`demo-legal-gpt`'s job (rank-8 LoRA on legal text, "
             f"{DEMO_DECODER_TENANTS[0]['max_train']} lines, {DEMO_DECODER_TENANTS[0]['epochs']} epoch) on each engine's "
             f"lower side: its dev perplexity before and after, and its time.")
    finish("bench_hgpt_split", text, res, "python benchmarks/bench_hgpt_split.py" + (" --quick" if args.quick else "")
           + (f" --deep {args.deep}" if args.deep != 8 else ""))


if __name__ == "__main__":
    main()
