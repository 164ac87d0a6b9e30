"""Every figure the README and the guide quote comes from the results records they cite: in each
paragraph that names pages under docs/ (or links to them), every measured number (a decimal, or an integer of two digits or
more; not inside code, not part of a name such as MiniLM-L6 or 3+3) is found, at the precision
written, among the numbers of those pages' JSON records. A rerun that changes a figure fails
here instead of leaving a stale sentence."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/index.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md")))


def cited_pages(name: str, paragraph: str) -> list[Path]:
    """The pages a paragraph of page ``name`` cites: paths under docs/, and relative links."""
    out = [ROOT / "docs" / p for p in re.findall(r"docs/([\w/.-]+\.md)", paragraph)]
    here = (ROOT / name).parent
    out += [(here / p).resolve() for p in re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]*)?\)", paragraph)
            if not p.startswith("docs/")]
    return out


def record_numbers(page: Path) -> list[float]:
    out: list[float] = []

    def walk(v):
        if isinstance(v, dict):
            for k, x in v.items():  # keys count too: a record keyed by tenant count or split
                if re.fullmatch(r"-?\d+(\.\d+)?", k):
                    out.append(float(k))
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))

    for block in re.findall(r"```json\n(.*?)\n```", page.read_text(), re.S):
        walk(json.loads(block))
    return out


def figures(paragraph: str) -> list[str]:
    """The numbers a paragraph quotes, as written (code spans and names left out)."""
    prose = re.sub(r"`[^`]*`", " ", paragraph)
    return [m.group(0) for m in re.finditer(r"(?<![\w.+\-/,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w+]|\.\d|,\d)", prose)
            if "." in m.group(0) or len(m.group(0).replace(",", "")) >= 2]


def found(figure: str, numbers: list[float]) -> bool:
    value = float(figure.replace(",", ""))
    places = len(figure.split(".")[1]) if "." in figure else 0
    return any(round(n, places) == value for n in numbers)


def paragraphs(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_every_figure_the_readme_and_the_guide_quote_is_in_a_record_they_cite():
    missing = []
    for name in PAGES:
        for paragraph in paragraphs((ROOT / name).read_text()):
            cited = cited_pages(name, paragraph)
            if not cited:
                continue
            numbers = [n for page in cited if page.exists() for n in record_numbers(page)]
            missing += [(name, f, [p.name for p in cited]) for f in figures(paragraph) if not found(f, numbers)]
    assert not missing, missing


def test_the_check_finds_a_figure_no_record_holds():
    """The check itself: a figure that is not in the cited record is caught."""
    numbers = record_numbers(ROOT / "docs" / "results" / "bench_front.md")
    assert found("1.327", numbers) and not found("1.328", numbers)
    assert figures("at 2.31 times, 100 tenants on MiniLM-L6 3+3 (`--max-len 128`)") == ["2.31", "100"]
    assert figures("10,000 tenants, then 413, (twice)") == ["10,000", "413"]
