"""The documentation site: MkDocs builds docs/ in strict mode (a broken link or a page missing
from the navigation fails), and the HTTP reference page is the one the server's OpenAPI
document renders (scripts/http_reference.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_in_strict_mode_without_a_warning(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (make setup installs it with the dev extra)")
    out = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "WARNING" not in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "openapi" / "index.html").exists()


def test_the_http_reference_page_is_the_one_the_openapi_document_renders():
    sys.path.insert(0, str(ROOT))
    from scripts.http_reference import PAGE, document, markdown

    assert PAGE.read_text() == markdown(document()), "run: python scripts/http_reference.py"
