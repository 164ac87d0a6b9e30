"""``hmi domain create`` on the local home, as a user runs it: a stop does not lose its work."""

import pytest

import hmi.cli.domains as domains_cli
import hmi.version_tree.tree as tree_mod
from hmi.bootstrap import ensure_data
from hmi.cli import main
from hmi.data import load_corpus
from hmi.home import hmi_home

CHUNK = 4096


@pytest.mark.slow
def test_a_local_domain_create_stopped_in_its_plot_build_continues_there_when_run_again(
        real_root, tmp_path, monkeypatch, capsys):
    """Ctrl+C during the branch's PLOT build: the command says how to go on; run again, it takes the
    distillation's last checkpoint and the PLOT's last chunk written, and leaves nothing behind."""
    monkeypatch.setattr(domains_cli, "load_current_root", lambda root, l_low: real_root)
    ensure_data()  # the packaged corpora, prepared once per checkout
    corpus = tmp_path / "licenses.txt"
    corpus.write_text("\n".join(load_corpus("legal", 500)) + "\n")
    real_build = tree_mod.build

    def chunked(*a, stop_at=None, **kw):
        def hear(fraction, info):
            if stop_at is not None and info["entries"] >= stop_at:
                raise KeyboardInterrupt  # what Ctrl+C raises in the main thread
        return real_build(*a, **{**kw, "batch_windows": CHUNK, "on_progress": hear})

    argv = ["domain", "create", "licenses", "--corpus", str(corpus), "--steps", "2"]
    monkeypatch.setattr(tree_mod, "build", lambda *a, **kw: chunked(*a, stop_at=2 * CHUNK, **kw))
    try:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
    except KeyboardInterrupt:
        pytest.fail("the stop reached the user as a traceback instead of how to go on")
    assert stopped.value.code == 130 and "run again continues" in capsys.readouterr().err
    assert "licenses" not in tree_mod.VersionTree(real_root).nodes()

    monkeypatch.setattr(tree_mod, "build", chunked)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"distillation from step 2, the PLOT build from entry {2 * CHUNK}" in out and "domain licenses" in out
    assert "licenses" in tree_mod.VersionTree(real_root).nodes()
    assert list((hmi_home() / "calibration").rglob("*.ckpt*")) == []
