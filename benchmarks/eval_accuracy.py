"""Test accuracy of hBERT (PLOT + adapters) next to full fine-tuning and adapters on the
full-context model, on real tasks (one of them a tagging task).

Usage: python benchmarks/eval_accuracy.py [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import finish, start, table  # noqa: E402

TASKS = ["news-topic", "review-sentiment", "pos-tagging"]


def train_full_context(bert, spec, ex_train, ex_dev, ex_test, mode: str, epochs: int, lr: float, seed: int = 0):
    """Reference schemes on the full-context root: all weights trained ("full") or a library
    adapter in every layer ("adapter"), with the same head, loss, batches and early stopping."""
    from hmi.adapters.interop import attach, library_model
    from hmi.adapters.train import IGNORE, metrics_of, pad

    torch.manual_seed(seed)
    model = library_model(bert)
    if mode == "adapter":
        attach(model, "t", spec, 0, train=True)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    head = nn.Linear(bert.config.hidden_size, spec.num_labels)
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    tagging = spec.head == "tagging"
    drop = nn.Dropout(0.1)

    def batch(exs):
        ids, mask = pad(exs)
        T = ids.shape[1]
        if tagging:
            y = torch.full((len(exs), T), IGNORE)
            for i, e in enumerate(exs):
                y[i, :len(e.target)] = torch.tensor(e.target)
        else:
            y = torch.tensor([e.target for e in exs])
        return torch.from_numpy(ids), torch.from_numpy(mask), y

    def logits(ids, mask, train):
        model.train(train)
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = head(drop(h) if train else h)
        return out if tagging else out[:, 0]

    @torch.no_grad()
    def evaluate(exs):
        preds, gold = [], []
        for s in range(0, len(exs), 64):
            ids, mask, y = batch(exs[s:s + 64])
            p = logits(ids, mask, False).argmax(-1)
            keep = y != IGNORE if tagging else torch.ones_like(y, dtype=torch.bool)
            preds.append(p[keep].numpy())
            gold.append(y[keep].numpy())
        return metrics_of(np.concatenate(preds), np.concatenate(gold), spec.num_labels)

    rng = np.random.default_rng(seed)
    best, best_state = -1.0, None
    for _ in range(epochs):
        order = rng.permutation(len(ex_train))
        for s in range(0, len(order), 32):
            ids, mask, y = batch([ex_train[i] for i in order[s:s + 32]])
            out = logits(ids, mask, True)
            loss = F.cross_entropy(out.reshape(-1, spec.num_labels), y.reshape(-1), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        dev = evaluate(ex_dev)["accuracy"]
        if dev > best:
            best = dev
            best_state = ({k: v.clone() for k, v in model.state_dict().items()}, {k: v.clone() for k, v in head.state_dict().items()})
    model.load_state_dict(best_state[0])
    head.load_state_dict(best_state[1])
    return evaluate(ex_test)


def main() -> None:
    args = start(__doc__)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.train import FinetuneConfig, encode, finetune
    from hmi.data import is_tagging, load_task, task_labels
    from hmi.model.artifact import load_root
    from hmi.plot.default import ensure_root_plot, open_root_version
    from hmi.plot.lookup import PlotLookup

    caps = {"news-topic": 500, "review-sentiment": 1200, "pos-tagging": 500} if args.quick else \
        {"news-topic": 1700, "review-sentiment": 4000, "pos-tagging": 2000}
    n_eval = 300 if args.quick else 1000
    epochs = 3 if args.quick else 5
    max_len = 128
    root = load_root()
    ensure_root_plot(root, progress=False)
    lookup = PlotLookup([open_root_version(root)], policy="backoff")
    rows, res, gaps = [], {"tasks": {}}, []
    for task in TASKS:
        labels = tuple(task_labels(task))
        spec = AdapterSpec("bottleneck", head="tagging" if is_tagging(task) else "classification", labels=labels)
        train = load_task(task, "train", caps[task])
        dev = load_task(task, "dev", n_eval // 2)
        test = load_task(task, "test", n_eval)
        t0 = time.time()
        _, m = finetune(root.bert, root.spec.l_low, lookup, root.tokenizer, spec, train, dev, test,
                        FinetuneConfig(epochs=epochs, lr=1e-3, max_len=max_len, patience=epochs), progress=False)
        t_hbert = time.time() - t0
        ex = {k: encode(root.tokenizer, v, spec, max_len) for k, v in (("train", train), ("dev", dev), ("test", test))}
        t0 = time.time()
        full = train_full_context(root.bert, spec, ex["train"], ex["dev"], ex["test"], "full", epochs, 5e-5)
        t_full = time.time() - t0
        t0 = time.time()
        adap = train_full_context(root.bert, spec, ex["train"], ex["dev"], ex["test"], "adapter", epochs, 1e-3)
        t_adap = time.time() - t0
        metric = "accuracy"
        vals = {"hbert": m["test"][metric], "full_ft": full[metric], "adapters_full_context": adap[metric]}
        res["tasks"][task] = {**{k: round(100 * v, 2) for k, v in vals.items()}, "train": len(train), "test": len(test)}
        gaps.append(100 * (vals["full_ft"] - vals["hbert"]))
        rows.append((task + (" (token acc.)" if is_tagging(task) else ""), len(train), f"{100 * vals['full_ft']:.1f}",
                     f"{100 * vals['adapters_full_context']:.1f}", f"{100 * vals['hbert']:.1f}"))
        del t_hbert, t_full, t_adap
        print(rows[-1], flush=True)
    res["avg_gap_vs_full_ft"] = round(float(np.mean(gaps)), 2)
    res["root_artifact"] = root.artifact_id
    text = table(rows, ("task", "train examples", "full fine-tuning", "adapters, full context", "hBERT (PLOT + adapters)"))
    text += (f"\n\nTest accuracy in % (up to {n_eval} test examples per task; for pos-tagging, accuracy over words, which is "
             f"micro-F1 for single-label tagging). Average gap of hBERT to full fine-tuning: "
             f"{res['avg_gap_vs_full_ft']} points. {epochs} epochs, best epoch on dev, bottleneck adapters "
             f"(reduction 16; in the upper 3 layers for hBERT, in all 6 for the full-context adapters), AdamW; hBERT "
             f"reads the root PLOT with back-off, as served.")
    finish("eval_accuracy", text, res, "python benchmarks/eval_accuracy.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
