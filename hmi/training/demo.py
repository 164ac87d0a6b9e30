"""The demo tenants: what they are trained on, and their fine-tune, the one a server's job runs
for them (``POST /v1/tenants`` with ``demo_body``) and the one that made the shipped adapters
(``hmi.adapters.shipped``; ``hmi demo --ship``); the decoder demo tenant (``hmi serve --hgpt``)
the same way."""

from __future__ import annotations

import os

import torch

from hmi.adapters.spec import AdapterSpec
from hmi.data import job_rows, job_texts, task_labels
from hmi.training.finetune import FinetuneConfig, finetune
from hmi.training.finetune_lm import LmFinetuneConfig, finetune_lm

# Sentiment on PLOT representations reads the token mean better than [CLS] (docs/decisions.md).
# 200 dev and test texts each (for early stopping and the job's metrics): the first start's demo
# tenant serves sooner than with the default 500.  News articles and reviews run past the token
# limit: the demo tenants cut them (in training and inference alike) rather than refuse them.
DEMO_TENANTS = [
    {"name": "demo-news", "dataset": "news-topic", "pooling": "cls", "max_train": 800, "max_eval": 200, "epochs": 3},
    {"name": "demo-reviews", "dataset": "review-sentiment", "pooling": "mean", "max_train": 1500, "max_eval": 200,
     "epochs": 3},
]
MAX_LEN = 128  # the server's default token limit, which the demo tenants' jobs read texts with
# The decoder demo tenant's POST /v1/tenants body (its LoRA has the server's rank).
DEMO_DECODER_TENANTS = [{"name": "demo-legal-gpt", "model": "decoder", "corpus": "legal", "max_train": 160, "epochs": 1}]


def demo_body(d: dict) -> dict:
    """The ``POST /v1/tenants`` body of demo tenant ``d``."""
    return {"name": d["name"], "task": {"type": "classification", "labels": list(task_labels(d["dataset"])),
                                        "pooling": d["pooling"]},
            "dataset": d["dataset"], "max_train": d["max_train"], "max_eval": d["max_eval"], "epochs": d["epochs"],
            "truncate": True}


def demo_spec(d: dict) -> AdapterSpec:
    """The spec a server gives demo tenant ``d`` (the task's default adapter)."""
    return AdapterSpec.for_task("classification", task_labels(d["dataset"]), None, pooling=d["pooling"])


def train_demo(d: dict, bert, l_low: int, lookup, tokenizer, progress: bool = True):
    """Demo tenant ``d``'s fine-tune as its server job runs it (seed 0, the job's thread count,
    texts cut at the default limit); returns (spec, canonical weights, metrics)."""
    job_threads()
    spec = demo_spec(d)
    train, dev, test = job_rows({"dataset": d["dataset"], "max_train": d["max_train"], "max_eval": d["max_eval"]})
    cfg = FinetuneConfig(epochs=d["epochs"], seed=0, max_len=MAX_LEN, truncate=True)
    weights, metrics = finetune(bert, l_low, lookup, tokenizer, spec, train, dev, test, cfg, progress=progress)
    return spec, weights, metrics


def job_threads() -> None:
    """The thread count a server's job worker trains with (``hmi.services.workers``)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


def train_demo_decoder(d: dict, root, lookup, rank: int, progress: bool = True):
    """Decoder demo tenant ``d``'s fine-tune as its server job runs it (``root`` the calibrated
    decoder root, ``lookup`` its causal PLOT as the server reads it, ``rank`` the server's LoRA
    rank); returns (spec, canonical weights, metrics)."""
    job_threads()
    spec = AdapterSpec.decoder(rank=rank)
    train, dev = job_texts({"corpus": d["corpus"], "max_train": d["max_train"]})
    weights, metrics = finetune_lm(root, lookup, spec, train, dev, LmFinetuneConfig(epochs=d["epochs"]),
                                   progress=progress)
    return spec, weights, metrics
