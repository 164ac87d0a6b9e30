"""Materializing a PLOT from a corpus: count n-grams, select, compute in batches, write.

The target list of keys is a pure function of the corpus, the selection and the tokenizer, in
sorted key order; it is written in fixed chunks, each committed in the same LMDB transaction as
the progress record, so a killed build resumes at the next chunk and ends with the same bytes
as an uninterrupted one.  Rerunning a finished build does nothing.  Before computing, a build
publishes its plan, so that the PLOT can be served while it is built (``hmi.plot.pending``).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from hmi.model.hplm import WindowedEncoder, as_numpy_ids
from hmi.plot.keys import bigram_backoff, causal_windows, encoder_windows, pack, unpack
from hmi.plot.pending import PLAN_FILE, plan_path
from hmi.plot.store import PlotStore

CHUNK = 2048
CORPUS_RECORD = "corpus"  # the store record naming what a PLOT was built from


@dataclass(frozen=True)
class Selection:
    """Which tri-grams to store: ``all``, the ``top_k`` most frequent, or the most frequent
    ones until they cover ``alpha`` of all tri-gram occurrences."""

    mode: str = "all"  # "all" | "top_k" | "alpha"
    top_k: int = 0
    alpha: float = 1.0

    def __post_init__(self):
        if self.mode not in ("all", "top_k", "alpha"):
            raise ValueError(f"unknown selection {self.mode!r}; use all, top_k or alpha")
        if self.mode == "alpha" and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.mode == "top_k" and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def describe(self) -> str:
        return {"all": "all", "top_k": f"top_k={self.top_k}", "alpha": f"alpha={self.alpha}"}[self.mode]


def count_ngrams(token_lists: list[list[int]], batch: int = 512, causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Distinct tri-gram keys (encoder windows, or ``causal`` windows) of a tokenized corpus and
    their occurrence counts.

    Returns (keys (K,) uint64 sorted, counts (K,) int64).
    """
    windows = causal_windows if causal else encoder_windows
    parts = []
    for i in range(0, len(token_lists), batch):
        ids, mask = as_numpy_ids(token_lists[i:i + batch])
        parts.append(pack(windows(ids, mask)[mask.astype(bool)]))
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return np.unique(np.concatenate(parts), return_counts=True)


def select_trigrams(keys: np.ndarray, counts: np.ndarray, sel: Selection) -> np.ndarray:
    """The tri-gram keys a selection keeps (sorted).

    ``alpha``: the most frequent keys (ties broken by key) until their occurrences reach
    ``alpha`` of the total; alpha = 0 keeps none, alpha = 1 keeps all.
    """
    if sel.mode == "all" or len(keys) == 0:
        return np.sort(keys)
    order = np.lexsort((keys, -counts))
    if sel.mode == "top_k":
        return np.sort(keys[order[:sel.top_k]])
    if sel.alpha <= 0:
        return np.zeros(0, np.uint64)
    cum = np.cumsum(counts[order])
    n = int(np.searchsorted(cum, sel.alpha * cum[-1] - 1e-9) + 1)
    return np.sort(keys[order[:n]])


def plan_keys(trigram_keys: np.ndarray, counts: np.ndarray, sel: Selection, vocab_size: int,
              with_backoff: bool = True, causal: bool = False) -> np.ndarray:
    """Every key the build writes: the selected tri-grams, plus (``with_backoff``) the bi-grams
    of all corpus windows (``(0, c, r)``; causal ``(0, b, c)``) and the uni-grams of the whole
    vocabulary (``(0, c, 0)``; causal ``(0, 0, c)``)."""
    parts = [select_trigrams(trigram_keys, counts, sel)]
    if with_backoff:
        parts.append(bigram_backoff(trigram_keys))
        uni = np.zeros((vocab_size - 1, 3), dtype=np.int64)
        uni[:, 2 if causal else 1] = np.arange(1, vocab_size)
        parts.append(pack(uni))
    return np.unique(np.concatenate(parts))


def build_fingerprint(keys: np.ndarray, artifact: str, weights: str = "") -> str:
    """The identity of a build: its keys, the root artifact and, for an encoder that is not the
    root's own (a domain branch's), that encoder's ``weights`` fingerprint."""
    h = hashlib.sha256(artifact.encode())
    if weights:
        h.update(weights.encode())
    h.update(np.ascontiguousarray(keys, dtype=np.uint64).tobytes())
    return h.hexdigest()[:24]


@torch.no_grad()
def build(store: PlotStore, encoder: WindowedEncoder, keys: np.ndarray, batch_windows: int = CHUNK,
          progress: bool = True, desc: str = "PLOT build", on_progress=None, weights: str = "") -> dict:
    """Computes and writes the representation of every key, resuming where a previous run of the
    same keys and encoder stopped (``weights``: the encoder's fingerprint where it is not the
    root's, so that no resume mixes two encoders' values); ``on_progress(fraction done, info)``
    hears every chunk.

    Returns a summary: entries written by this run, total entries, bytes, seconds.
    """
    fp = build_fingerprint(keys, store.meta.root_artifact, weights)
    state = store.get_record("build") or {}
    if state.get("fingerprint") == fp and state.get("complete"):
        return {"written": 0, "entries": len(store), "seconds": 0.0, "resumed_from": len(keys), "up_to_date": True}
    done = state.get("done", 0) if state.get("fingerprint") == fp else 0
    if done == 0 and len(store):
        store.clear()  # another plan was (partly) built here: start from an empty table
    publish_plan(store, keys, fp, done)
    start = time.time()
    encoder.eval()
    bar = tqdm(total=len(keys), initial=done, desc=desc, unit="ngram", disable=not progress, smoothing=0.1)
    pos = done
    while pos < len(keys):
        chunk = keys[pos:pos + batch_windows]
        reps = encoder.lower(torch.from_numpy(unpack(chunk))).numpy()
        pos += len(chunk)
        store.put_many(chunk, reps, records={"build": {"fingerprint": fp, "done": pos, "total": len(keys),
                                                       "complete": pos >= len(keys)}})
        bar.update(len(chunk))
        if on_progress is not None:
            on_progress(pos / max(1, len(keys)), {"entries": pos})
    bar.close()
    plan_path(store.path, fp).unlink(missing_ok=True)
    seconds = time.time() - start
    stats = store.stats()
    store.put_record("stats", stats)
    return {"written": len(keys) - done, "entries": stats["entries"], "value_bytes": stats["value_bytes"],
            "file_bytes": stats["file_bytes"], "seconds": round(seconds, 2), "resumed_from": done,
            "ngrams_per_s": round((len(keys) - done) / max(seconds, 1e-9), 1), "up_to_date": False}


def publish_plan(store: PlotStore, keys: np.ndarray, fingerprint: str, done: int) -> None:
    """Before a build computes anything: its plan beside the store (written whole, then renamed)
    and its record, so that readers can serve the PLOT as it will be (``hmi.plot.pending``)."""
    for old in store.path.glob(PLAN_FILE.format(fingerprint="*")):
        if old != plan_path(store.path, fingerprint):
            old.unlink(missing_ok=True)
    path = plan_path(store.path, fingerprint)
    if not path.exists():
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, np.asarray(keys, dtype=np.uint64))
        os.replace(tmp, path)
    store.put_record("build", {"fingerprint": fingerprint, "done": done, "total": len(keys), "complete": False})


def plot_corpus(store: PlotStore) -> str:
    """The corpus a PLOT was built from (``hmi plot build --corpus``: a prepared corpus, names joined
    by commas, ``all``, or a file); ``general``, the corpus ``hmi prepare`` builds a root PLOT
    from, where the PLOT predates the record."""
    return store.get_record(CORPUS_RECORD) or "general"


def tokenize_corpus(tokenizer, lines: list[str], max_len: int = 128, progress: bool = True) -> list[list[int]]:
    """Token ids of each line (as the tokenizer frames a text for serving), truncated as serving truncates."""
    out = []
    for i in tqdm(range(0, len(lines), 1000), desc="tokenize", unit="klines", disable=not progress):
        enc = tokenizer(lines[i:i + 1000], truncation=True, max_length=max_len)
        out.extend(enc["input_ids"])
    return out


def build_from_corpus(store: PlotStore, encoder: WindowedEncoder, tokenizer, lines: list[str], sel: Selection,
                      max_len: int = 128, with_backoff: bool = True, progress: bool = True,
                      corpus: str = "general") -> dict:
    """The whole pipeline of ``hmi plot build``: tokenize, count, select, compute, write; the
    store records ``corpus``, what ``lines`` are (``plot_corpus``).
    ``encoder`` is a root's windowed encoder, or a decoder's ``CausalLower`` (``causal`` windows)."""
    t0 = time.time()
    causal = bool(getattr(encoder, "causal", False))
    token_lists = tokenize_corpus(tokenizer, lines, max_len, progress)
    keys, counts = count_ngrams(token_lists, causal=causal)
    plan = plan_keys(keys, counts, sel, len(tokenizer) if with_backoff else 0, with_backoff, causal)
    summary = build(store, encoder, plan, progress=progress)
    store.put_record(CORPUS_RECORD, corpus)
    summary.update({"corpus": corpus, "corpus_lines": len(lines), "distinct_trigrams": int(len(keys)),
                    "trigram_occurrences": int(counts.sum()), "planned": int(len(plan)),
                    "selection": sel.describe(), "total_seconds": round(time.time() - t0, 2)})
    return summary
