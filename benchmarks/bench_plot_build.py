"""Where a root PLOT build's time goes (window compute, int8 encoding, LMDB writes), and its rate
before and after windows ran on their present tokens alone, measured side by side.

The keys are an evenly spaced sample of the default root's real build plan (the general corpus's
tri-grams, their bi-gram back-offs and the vocabulary's uni-grams, in the plan's proportions),
computed in the build's chunks.  Variants, rounds interleaved:

- ``masked``: every window a length-3 sequence with its absent tokens masked out (the build
  before; :meth:`WindowedLower.masked_states`);
- ``present``: each window on its present tokens alone (the build now), compared byte for byte
  with ``masked`` after encoding;
- ``present, bf16 GEMMs``: the same inside :func:`hmi.model.kernels.bf16_matmuls` where the CPU
  multiplies bf16 natively: not the same values, so not what the build does; shown for the
  fraction of stored int8 codes it changes.

Then the whole build (``hmi.plot.build.build``: compute, encode, write, progress records) of the
sample into a fresh LMDB store, as the product runs it.

Usage: python benchmarks/bench_plot_build.py [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, round_robin, start, table  # noqa: E402


def plan_sample(root, n: int) -> tuple[np.ndarray, dict]:
    """``n`` keys evenly spaced through the root PLOT's build plan (sorted), and the plan's mix."""
    from hmi.data import load_corpus
    from hmi.plot.build import Selection, count_ngrams, plan_keys, tokenize_corpus
    from hmi.plot.keys import unpack

    keys, counts = count_ngrams(tokenize_corpus(root.tokenizer, load_corpus("general"), progress=False))
    plan = plan_keys(keys, counts, Selection("all"), len(root.tokenizer))
    sample = plan[np.linspace(0, len(plan) - 1, min(n, len(plan))).astype(np.int64)]
    present = (unpack(plan) > 0).sum(1)
    mix = {"planned": int(len(plan)), "three_tokens": int((present == 3).sum()),
           "two_tokens": int((present == 2).sum()), "one_token": int((present == 1).sum())}
    return sample, mix


def masked_lower(lower):
    """The build's window compute before: masked length-3 sequences, gated."""
    def run(windows: torch.Tensor) -> torch.Tensor:
        h = lower.masked_states(windows)
        return torch.where(lower.window_mask(windows).unsqueeze(-1), h * torch.sigmoid(lower.gate(h)), 0.0)
    return run


def gemm_peak() -> float:
    """GFLOP/s of a large fp32 matrix product on this machine (the ceiling of the window compute)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    s = round_robin({"mm": lambda: a @ b}, rounds=5, warmup=2)["mm"]
    return 2 * 2048 ** 3 / s / 1e9


def window_gflop(lower, n_windows: int) -> float:
    """The masked window compute's matrix products: 3 rows a window through each layer's
    q, k, v, output and feed-forward projections (attention's 3 x 3 products left out)."""
    cfg = lower.layers[0].attention.self.query.weight.shape[0], lower.layers[0].intermediate.dense.weight.shape[0]
    hidden, inner = cfg
    return n_windows * 3 * len(lower.layers) * 2 * (4 * hidden * hidden + 2 * hidden * inner) / 1e9


def main() -> None:
    args = start(__doc__)
    from hmi.model.artifact import load_root
    from hmi.model.kernels import NATIVE_BF16, bf16_matmuls
    from hmi.plot import codec
    from hmi.plot.build import CHUNK, build
    from hmi.plot.keys import unpack
    from hmi.plot.paths import plot_meta
    from hmi.plot.store import PlotStore

    root = load_root()
    lower = root.windowed.lower.eval()
    keys, mix = plan_sample(root, 8 * CHUNK if args.quick else 24 * CHUNK)
    windows = [torch.from_numpy(unpack(keys[i:i + CHUNK])) for i in range(0, len(keys), CHUNK)]
    dtype = plot_meta(root).dtype
    masked = masked_lower(lower)

    def bf16_lower(w):
        with bf16_matmuls():
            return lower(w)

    variants = {"masked (before)": masked, "present tokens alone (now)": lower}
    if NATIVE_BF16:
        variants["present, bf16 GEMMs (not the build)"] = bf16_lower
    with torch.no_grad():
        outputs = {k: [f(w) for w in windows] for k, f in variants.items()}
        seconds = round_robin({k: (lambda f=f: [f(w) for w in windows]) for k, f in variants.items()},
                              rounds=2 if args.quick else 3)
    encoded = {k: np.concatenate([codec.encode(v.numpy(), dtype) for v in vs]) for k, vs in outputs.items()}
    reps = [v.numpy() for v in outputs["present tokens alone (now)"]]
    t_encode = round_robin({"e": lambda: [codec.encode(r, dtype) for r in reps]}, rounds=3)["e"]

    tmp = Path(tempfile.mkdtemp())
    try:
        def write():
            store = PlotStore(tmp / "w", meta=plot_meta(root), readonly=False)
            t = time.perf_counter()
            for i, r in enumerate(reps):
                store.put_many(keys[i * CHUNK:(i + 1) * CHUNK], r, records={"build": {"done": (i + 1) * CHUNK}})
            took = time.perf_counter() - t
            store.close()
            shutil.rmtree(tmp / "w")
            return took
        t_write = min(write() for _ in range(3)) - t_encode  # put_many encodes, then writes
        store = PlotStore(tmp / "b", meta=plot_meta(root), readonly=False)
        summary = build(store, root.plot_lower, keys, progress=False)
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    n = len(keys)
    peak = gemm_peak()
    achieved = window_gflop(lower, n) / seconds["masked (before)"]
    base = encoded["masked (before)"]
    rows, result = [], {"ngrams": n, "plan": mix, "chunk": CHUNK, "value_format": dtype, "native_bf16": NATIVE_BF16}
    for k, s in seconds.items():
        total = s + t_encode + t_write
        same = float((encoded[k] == base).mean())
        rows.append((k, f"{s:.2f}", f"{t_encode:.2f}", f"{t_write:.2f}", f"{n / total:,.0f}",
                     f"{seconds['masked (before)'] / s:.2f}", "yes" if same == 1.0 else f"no ({1 - same:.2%} of bytes differ)"))
        slug = k.split(" (")[0].replace(", ", "_").replace(" ", "_")
        result[f"{slug}_compute_s"] = round(s, 3)
        result[f"{slug}_ngrams_per_s"] = round(n / total, 1)
        result[f"{slug}_same_bytes_fraction"] = round(same, 6)
    result.update({"masked_gemm_gflops": round(achieved, 1), "fp32_gemm_peak_gflops": round(peak, 1),
                   "encode_s": round(t_encode, 3), "lmdb_write_s": round(t_write, 3),
                   "build_ngrams_per_s": summary["ngrams_per_s"],
                   "compute_speedup": round(seconds["masked (before)"] / seconds["present tokens alone (now)"], 3),
                   "build_speedup": round((seconds["masked (before)"] + t_encode + t_write)
                                          / (seconds["present tokens alone (now)"] + t_encode + t_write), 3)})
    text = table(rows, ("window compute", "compute s", "int8 encode s", "LMDB writes s", "n-grams/s",
                        "compute speed-up", "same bytes as before"))
    text += (f"\n\n{n:,} keys sampled evenly from the root PLOT's plan of {mix['planned']:,} ({mix['three_tokens']:,} "
             f"windows of three present tokens, {mix['two_tokens']:,} of two, {mix['one_token']:,} of one), chunks of {CHUNK}, "
             f"{dtype} values. The whole build of the sample as the product runs it (compute, encode, write, "
             f"progress records): {summary['ngrams_per_s']:,.0f} n-grams/s; build speed-up, compute + encode + "
             f"writes: {result['build_speedup']:.2f}x.\n\nThe masked window compute multiplies at about {achieved:.0f} GFLOP/s (its "
             f"projections and feed-forward layers alone, counted from the shapes), against {peak:.0f} GFLOP/s for a "
             f"2,048-square fp32 matrix product on the same cores: the build is bound by fp32 arithmetic, so a "
             f"faster build with the same values has to do fewer products (here: none for absent tokens).")
    finish("bench_plot_build", text, result, "python benchmarks/bench_plot_build.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
