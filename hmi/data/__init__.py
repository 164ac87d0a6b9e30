"""Real tasks and domain corpora, read from the cache that ``hmi data prepare`` writes.

The loader API used by calibration, PLOT building, fine-tuning, tests and benchmarks.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

TASKS = ["news-topic", "review-sentiment", "tweet-sentiment", "license-category", "pos-tagging"]
CORPORA = ["news", "legal", "reviews", "social", "software", "literature", "general"]
TASK_DOMAIN = {"news-topic": "news", "review-sentiment": "reviews", "tweet-sentiment": "social",
               "license-category": "legal", "pos-tagging": "literature"}


class DataMissingError(RuntimeError):
    """The data cache has not been prepared."""


def data_dir() -> Path:
    """Where prepared data lives: ``HMI_DATA_DIR``, else ``data/cache`` of the checkout."""
    env = os.environ.get("HMI_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data" / "cache"


def _need(path: Path) -> Path:
    if not path.exists():
        raise DataMissingError(f"{path} is missing: run `hmi data prepare` first")
    return path


def task_labels(task: str) -> list[str]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return json.loads(_need(data_dir() / "tasks" / task / "labels.json").read_text())


def is_tagging(task: str) -> bool:
    return task == "pos-tagging"


def load_task(task: str, split: str, max_n: int | None = None) -> list[dict]:
    """Rows of a task split: ``{"text", "label"}`` or, for tagging, ``{"tokens", "tags"}``.

    ``max_n`` keeps the first ``max_n`` rows; the split order is a fixed hash order, so a
    capped split is a stable subset of the full one, with every label kept in proportion.
    """
    if split not in ("train", "dev", "test"):
        raise ValueError(f"unknown split {split!r}; use train, dev or test")
    task_labels(task)
    path = _need(data_dir() / "tasks" / task / f"{split}.jsonl")
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
            if max_n is not None and len(rows) >= max_n:
                break
    return rows


def load_corpus(name: str, max_lines: int | None = None) -> list[str]:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    out = []
    with open(_need(data_dir() / "corpora" / f"{name}.txt")) as f:
        for line in f:
            if line.strip():
                out.append(line.rstrip("\n"))
                if max_lines is not None and len(out) >= max_lines:
                    break
    return out


def corpus_texts(spec: str) -> list[str]:
    """The lines of a corpus choice: one prepared corpus's name, several joined by commas (in that
    order), or ``all``: every domain corpus (``general`` is a sample of them, so it is left out)."""
    names = [n for n in CORPORA if n != "general"] if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no corpus named in {spec!r}; use all, or names among {', '.join(CORPORA)}")
    return [line for name in names for line in load_corpus(name)]


def held_out_texts(n: int = 256) -> list[str]:
    """Real text never used for calibration: test texts of the four text tasks, in turn."""
    per = [load_task(t, "test", n) for t in ("news-topic", "review-sentiment", "tweet-sentiment", "license-category")]
    out = []
    for i in range(n):
        for rows in per:
            if i < len(rows) and len(out) < n:
                out.append(rows[i]["text"])
    return out


def job_rows(data: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """The (train, dev, test) rows of an encoder fine-tune job's ``data``: a prepared dataset's
    splits (``dataset``, ``max_train``, ``max_eval``) or the rows it carries (``train``, ``dev``,
    ``test``)."""
    if data.get("dataset"):
        name, n_eval = data["dataset"], data.get("max_eval", 500)
        return (load_task(name, "train", data.get("max_train")), load_task(name, "dev", n_eval),
                load_task(name, "test", n_eval))
    return data["train"], data.get("dev") or [], data.get("test") or []


def hold_out(train: list[dict], dev: list[dict], n: int | None = None) -> tuple[list[dict], list[dict], int]:
    """(train, dev, how many training rows became dev): without dev rows, ``n`` training rows drawn
    with a fixed seed (the same ones for the same rows: an update, a resumed job) become the dev
    split, each split kept in the rows' order; with dev rows, or ``n`` None or 0, the splits as they
    are. Asked for, not by default: on 640 rows a tenth held out scored within one run's spread of
    training on every row at the first setting, at three times the job's time
    (``docs/results/eval_hold_out.md``)."""
    n = 0 if dev or n is None else n
    if n < 0:
        raise ValueError(f"holding out {n} training rows: give a count of 0 or more")
    if not n:
        return train, dev, 0
    if n >= len(train):
        raise ValueError(f"holding out {n} of {len(train)} training rows leaves none to train on")
    picked = set(random.Random(0).sample(range(len(train)), n))
    return [r for i, r in enumerate(train) if i not in picked], [train[i] for i in sorted(picked)], n


# a dataset job's unlabeled texts (distillation): lines of its task's domain corpus, four per training
# text up to this many
DATASET_UNLABELED_LINES = 2000


def job_unlabeled(data: dict, n_train: int) -> list[str]:
    """The unlabeled texts of an encoder fine-tune job's ``data``: those it carries
    (``unlabeled``), or for a prepared dataset the first lines of its task's domain corpus, which
    holds none of the dataset's dev and test texts (it may hold its training texts: the tweets'
    corpus is that task's training split): four per training text (``n_train``), at most
    ``DATASET_UNLABELED_LINES``."""
    if data.get("dataset"):
        return load_corpus(TASK_DOMAIN[data["dataset"]], min(DATASET_UNLABELED_LINES, 4 * n_train))
    return list(data.get("unlabeled") or [])


def job_texts(data: dict) -> tuple[list[str], list[str]]:
    """The (train, dev) texts of a decoder fine-tune job's ``data``: a prepared corpus's first
    lines (``corpus``, ``max_train``) or the texts it carries (``texts``); a tenth of them, at
    least one and at most 32, is held out for early stopping."""
    texts = load_corpus(data["corpus"], (data.get("max_train") or 400) + 32) if data.get("corpus") else data["texts"]
    n_dev = max(1, min(32, len(texts) // 10))
    return texts[n_dev:] or texts, texts[:n_dev]


def job_lines(data: dict) -> list[str]:
    """The corpus lines of a domain job's ``data``: a prepared corpus (``corpus_name``,
    ``max_lines``) or the lines it carries (``lines``)."""
    if data.get("corpus_name"):
        return load_corpus(data["corpus_name"], data.get("max_lines"))
    return data["lines"]
