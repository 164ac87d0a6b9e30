"""Writes docs/RESULTS.md from the results records (``make results``).

Every benchmark writes a page under docs/results/ with its command, machine, date and commit
and its JSON record (``benchmarks.common.finish``).  docs/results/claims.json names the figures
the project claims, each by its record and a key in it (optionally over another key, as a ratio),
with the target it is held to; this script reads each value from its record and writes one row
per claim, then one row per page.  Nothing in RESULTS.md is written by hand, so a rerun that
changes a figure changes the page (and ``tests/test_results.py`` fails until ``make results``).

Usage: python scripts/results.py [--check]   (--check: exit 1 when docs/RESULTS.md differs)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
RECORDS = DOCS / "results"
OUT = DOCS / "RESULTS.md"
NOT_RECORDED = "not recorded"


@dataclass
class Record:
    """One results page: its name (the file's stem), title line, command, machine, date and
    commit (``NOT_RECORDED`` on pages written before benchmarks recorded them) and JSON record."""

    name: str
    command: str
    machine: str
    date: str
    commit: str
    data: dict


def read_record(page: Path) -> Record:
    text = page.read_text()
    blocks = re.findall(r"```json\n(.*?)\n```", text, re.S)
    if not blocks:
        raise ValueError(f"{page}: no JSON record")

    def line(label: str) -> str:
        m = re.search(rf"^{label}: (.*)$", text, re.M)
        return m.group(1).strip() if m else NOT_RECORDED

    command = line("Command").strip("`")
    date, commit = NOT_RECORDED, NOT_RECORDED
    if (m := re.search(r"^Date: (.*?) UTC; commit (\S+)$", text, re.M)) is not None:
        date, commit = m.group(1), m.group(2)
    return Record(page.stem, command, line("Machine"), date, commit, json.loads(blocks[-1]))


def records() -> dict[str, Record]:
    return {p.stem: read_record(p) for p in sorted(RECORDS.glob("*.md"))}


def lookup(data, key: str | list[str]):
    """The value at ``key`` of a record: a name, or a list of names (list items by index)."""
    v = data
    for part in [key] if isinstance(key, str) else key:
        if isinstance(v, list):
            v = v[int(part)]
        elif isinstance(v, dict) and part in v:
            v = v[part]
        else:
            raise KeyError(key)
    return v


def value(claim: dict, rec: Record) -> str:
    """A claim's figure as RESULTS.md writes it: its ``format`` (a format spec; ``,.2f`` unless said)."""
    v = lookup(rec.data, claim["key"])
    if "over" in claim:
        v = v / lookup(rec.data, claim["over"])
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return format(v, claim.get("format", ",.2f"))


def kind_of(machine: str) -> str:
    """The CPU kind a page's machine line names (AVX-512 or AVX2), as a table cell."""
    if "AVX512" in machine or "AVX-512" in machine:
        return "AVX-512"
    if "AVX2" in machine:
        return "AVX2"
    return "CPU kind not recorded"


def render(recs: dict[str, Record], claims: list[dict]) -> str:
    out = ["# Results", "",
           "Written by `make results` (`scripts/results.py`) from the records under `docs/results/`:",
           "each value is read from the JSON record of the page it links to, which gives the command,",
           "the machine, and (on pages written since benchmarks record them) the date and commit.",
           "The claims and their targets are listed in `docs/results/claims.json`. Do not edit this page:",
           "rerun the benchmark, then `make results`.", ""]
    sections: dict[str, list[dict]] = {}
    for c in claims:
        sections.setdefault(c["section"], []).append(c)
    for section, rows in sections.items():
        out += [f"## {section}", "", "| claim | value | target | record | machine | measured |", "|---|---|---|---|---|---|"]
        for c in rows:
            rec = recs[c["record"]]
            when = NOT_RECORDED if rec.date == NOT_RECORDED else f"{rec.date}, {rec.commit}"
            out.append(f"| {c['what']} | {value(c, rec)} | {c.get('target', '-')} | [{rec.name}](results/{rec.name}.md) "
                       f"| {kind_of(rec.machine)} | {when} |")
        out.append("")
    out += ["## Every results page", "", "| page | command | machine | measured |", "|---|---|---|---|"]
    for rec in recs.values():
        when = NOT_RECORDED if rec.date == NOT_RECORDED else f"{rec.date}, {rec.commit}"
        out.append(f"| [{rec.name}](results/{rec.name}.md) | `{rec.command}` | {rec.machine} | {when} |")
    return "\n".join(out) + "\n"


def claims() -> list[dict]:
    return json.loads((RECORDS / "claims.json").read_text())["claims"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/RESULTS.md is not what the records give")
    args = ap.parse_args()
    text = render(records(), claims())
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("docs/RESULTS.md matches the records" if same else "docs/RESULTS.md differs: run make results")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(DOCS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
