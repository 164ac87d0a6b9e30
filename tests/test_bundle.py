"""Offline bundles (hmi.bundle, ``hmi bundle``): files cut into pieces of at most a given size,
each checked by sha256 before anything is written, unpacked to the same bytes."""

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from hmi.bundle import MANIFEST, BundleError, check, pack, unpack
from hmi.cli import main


def tree(base: Path) -> dict[str, bytes]:
    """A few files of several sizes, one executable, in nested folders."""
    rng = __import__("random").Random(0)
    files = {"wheels/a-1.0-py3-none-any.whl": rng.randbytes(200_000), "wheels/b.whl": b"",
             "hmi/model/shipped/x/windowed.safetensors": rng.randbytes(70_001), "run.sh": b"#!/bin/sh\necho hi\n"}
    for name, data in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(data)
    os.chmod(base / "run.sh", 0o755)
    return files


def test_a_bundle_is_cut_into_pieces_no_larger_than_asked_and_unpacks_to_the_same_bytes_and_modes(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    files = tree(src)
    m = pack([src / "wheels", src / "hmi", src / "run.sh"], tmp_path / "b", 64 * 1024, base=src)
    pieces = sorted((tmp_path / "b").glob("piece-*"))
    assert len(pieces) == len(m["pieces"]) >= 5
    assert all(p.stat().st_size <= 64 * 1024 for p in pieces)
    assert sum(p.stat().st_size for p in pieces) == m["bytes"]
    assert {f["name"] for f in m["files"]} == set(files)
    assert check(tmp_path / "b") == {"missing": [], "damaged": [], "present": len(pieces), "pieces": len(pieces),
                                     "bytes": m["bytes"]}
    unpack(tmp_path / "b", out)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    assert os.stat(out / "run.sh").st_mode & 0o111
    assert not (tmp_path / "b.partial").exists()


def test_a_missing_or_damaged_piece_is_named_and_nothing_is_unpacked(tmp_path):
    src = tmp_path / "src"
    tree(src)
    pack([src], tmp_path / "b", 64 * 1024, base=tmp_path)
    (tmp_path / "b" / "piece-0001").unlink()
    damaged = tmp_path / "b" / "piece-0003"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 1
    damaged.write_bytes(bytes(data))
    state = check(tmp_path / "b")
    assert state["missing"] == ["piece-0001"] and state["damaged"] == ["piece-0003"]
    with pytest.raises(BundleError, match="missing: piece-0001; damaged .*piece-0003. Nothing was unpacked"):
        unpack(tmp_path / "b", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_whose_bytes_differ_from_the_manifest_leaves_the_file_there_as_it_was(tmp_path):
    src = tmp_path / "src"
    tree(src)
    pack([src / "run.sh"], tmp_path / "b", 64 * 1024, base=src)
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    (tmp_path / "b" / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.sh").write_text("the old one")
    with pytest.raises(BundleError, match="run.sh: its sha256 differs"):
        unpack(tmp_path / "b", tmp_path / "out")
    assert (tmp_path / "out" / "run.sh").read_text() == "the old one"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["run.sh"]  # no temporary file left


def test_a_bundle_that_names_a_file_outside_its_folder_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "piece-0000").write_bytes(data)
    (tmp_path / "b" / MANIFEST).write_text(json.dumps({
        "format": 1, "bytes": len(data), "sha256": digest, "pieces": [{"name": "piece-0000", "bytes": len(data), "sha256": digest}],
        "files": [{"name": "../escaped", "bytes": 2, "sha256": hashlib.sha256(b"hi").hexdigest()}]}))
    with pytest.raises(BundleError, match="outside its folder"):
        unpack(tmp_path / "b", tmp_path / "out")
    assert not (tmp_path / "escaped").exists()


def test_pack_refuses_a_folder_that_exists_a_path_outside_its_base_and_a_link(tmp_path):
    src = tmp_path / "src"
    tree(src)
    (tmp_path / "exists").mkdir()
    with pytest.raises(BundleError, match="exists: give a new folder"):
        pack([src], tmp_path / "exists", 1 << 20, base=tmp_path)
    with pytest.raises(BundleError, match="is not under"):
        pack([src], tmp_path / "b", 1 << 20, base=src / "wheels")
    (src / "link").symlink_to(src / "run.sh")
    with pytest.raises(BundleError, match="symbolic link"):
        pack([src], tmp_path / "b", 1 << 20, base=tmp_path)
    assert not (tmp_path / "b").exists()


def test_the_command_line_packs_checks_and_unpacks_and_says_which_piece_is_missing(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    files = tree(src)
    monkeypatch.chdir(src)
    assert main(["bundle", "pack", str(tmp_path / "b"), "wheels", "hmi", "run.sh", "--piece-mb", "0.0625"]) == 0
    assert "hmi bundle unpack" in capsys.readouterr().out
    (tmp_path / "b" / "piece-0002").rename(tmp_path / "piece-0002")
    assert main(["bundle", "check", str(tmp_path / "b")]) == 1
    assert "missing: piece-0002" in capsys.readouterr().out
    assert main(["bundle", "unpack", str(tmp_path / "b"), "--into", str(tmp_path / "out")]) == 2
    assert "Nothing was unpacked" in capsys.readouterr().err
    (tmp_path / "piece-0002").rename(tmp_path / "b" / "piece-0002")
    assert main(["bundle", "check", str(tmp_path / "b")]) == 0
    assert main(["bundle", "unpack", str(tmp_path / "b"), "--into", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == files["wheels/a-1.0-py3-none-any.whl"]
    assert main(["bundle", "check", str(tmp_path / "nothing")]) == 2
    assert "not a bundle" in capsys.readouterr().err


def test_unpacking_needs_the_standard_library_alone(tmp_path):
    """A host unpacks a bundle before any of HMI's dependencies is installed (python -S: no site-packages)."""
    import subprocess
    import sys

    src = tmp_path / "src"
    files = tree(src)
    pack([src], tmp_path / "b", 64 * 1024, base=src)
    repo = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(repo)!r}); from hmi.bundle import unpack; unpack(sys.argv[1], sys.argv[2]); "
            "import hmi.io; assert 'lmdb' not in sys.modules and 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(tmp_path / "b"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "run.sh").read_bytes() == files["run.sh"]
