"""docs/RESULTS.md is what the records give (``make results``): a rerun of a benchmark that
changes a claimed figure fails here until the page is written again, and a claim whose record
or key is gone fails too."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_script", ROOT / "scripts" / "results.py")
results = sys.modules["results_script"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results)


def test_results_md_is_written_from_the_records_byte_for_byte():
    assert (ROOT / "docs" / "RESULTS.md").read_text() == results.render(results.records(), results.claims()), \
        "docs/RESULTS.md is not what the records give: run make results"


def test_every_claim_names_a_record_and_a_key_it_holds():
    recs = results.records()
    for c in results.claims():
        assert c["record"] in recs, c
        results.value(c, recs[c["record"]])


def test_a_changed_record_changes_the_claim_and_a_missing_key_is_an_error():
    rec = results.Record("x", "python benchmarks/x.py", "2 CPU cores (AMD EPYC, AVX2)", "2026-12-02 10:00", "abc1234",
                         {"a": {"b, c 0.5": 0.8466}, "n": 2})
    claim = {"section": "s", "what": "w", "record": "x", "key": ["a", "b, c 0.5"]}
    assert results.value(claim, rec) == "0.85"
    assert results.value({**claim, "format": ".1%"}, rec) == "84.7%"
    assert results.value({**claim, "over": "n"}, rec) == "0.42"
    text = results.render({"x": rec}, [claim])
    assert "| w | 0.85 | - | [x](results/x.md) | AVX2 | 2026-12-02 10:00, abc1234 |" in text
    with pytest.raises(KeyError):
        results.value({**claim, "key": ["a", "missing"]}, rec)


def test_every_results_page_has_its_command_and_machine():
    for rec in results.records().values():
        assert rec.command != results.NOT_RECORDED and rec.machine != results.NOT_RECORDED, rec.name
