"""What decides whether a start must prepare the embedded default (in a child process) or can
serve at once: the records of data, root artifact and root PLOT, read without loading a model."""

from hmi.bootstrap import is_prepared
from hmi.data import data_dir
from hmi.io import atomic_write_text
from hmi.plot.store import PlotMeta, PlotStore


def test_a_home_is_prepared_only_with_a_current_root_and_its_complete_root_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    assert not is_prepared(tmp_path)  # nothing yet
    (data_dir() / "stats.json").write_text("{}")
    (tmp_path / "roots").mkdir()
    atomic_write_text(tmp_path / "roots" / "current", "art")
    assert not is_prepared(tmp_path)  # no PLOT
    store = PlotStore(tmp_path / "plots" / "art" / "root", meta=PlotMeta("art", 3, 8), readonly=False)
    store.put_record("build", {"done": 5, "total": 10, "complete": False})
    store.close()
    assert not is_prepared(tmp_path)  # an interrupted build
    store = PlotStore(tmp_path / "plots" / "art" / "root", readonly=False)
    store.put_record("build", {"done": 10, "total": 10, "complete": True})
    store.close()
    assert is_prepared(tmp_path)
