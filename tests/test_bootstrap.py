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
    assert is_prepared(tmp_path, plot=False)  # enough to serve while the PLOT is built beside the server
    store = PlotStore(tmp_path / "plots" / "art" / "root", meta=PlotMeta("art", 3, 8), readonly=False)
    store.put_record("build", {"done": 5, "total": 10, "complete": False})
    store.close()
    assert not is_prepared(tmp_path)  # an interrupted build
    store = PlotStore(tmp_path / "plots" / "art" / "root", readonly=False)
    store.put_record("build", {"done": 10, "total": 10, "complete": True})
    store.close()
    assert is_prepared(tmp_path)


def test_calibrating_a_packaged_root_follows_its_recipe_and_options_override_it(monkeypatch):
    """`hmi calibrate --root mpnet-base` and a first start on it calibrate with the 12-layer root's
    recipe (1,600 steps at 3e-4 on every corpus, bf16 GEMMs where native), not the six-layer default root's; a time limit goes to the call,
    not into the recipe."""
    import hmi.bootstrap as bootstrap
    from hmi.bootstrap import calibrate_default

    seen = []
    monkeypatch.setattr(bootstrap, "ensure_data", lambda: None)
    monkeypatch.setattr(bootstrap, "corpus_texts", lambda name: ["a text"])
    monkeypatch.setattr(bootstrap, "held_out_texts", lambda n: ["another"])
    monkeypatch.setattr("hmi.model.catalog.root_spec", lambda root, l_low, home: root)
    monkeypatch.setattr("hmi.model.artifact.uncalibrated_root", lambda spec: spec)
    monkeypatch.setattr("hmi.training.calibrate.calibrate",
                        lambda root, train, held, cfg, home=None, max_minutes=None:
                        seen.append((root, cfg, max_minutes)) or ("id", {}))
    calibrate_default(root="mpnet-base", max_minutes=60)
    calibrate_default(root="mpnet-base", steps=5)
    calibrate_default()
    (r1, mpnet, limit), (_, mpnet_5, _), (r3, minilm, no_limit) = seen
    assert (r1, mpnet.steps, mpnet.lr, mpnet.bf16, limit) == ("mpnet-base", 1600, 3e-4, True, 60)
    assert (mpnet_5.steps, mpnet_5.lr) == (5, 3e-4)
    assert (r3, minilm.steps, minilm.lr, minilm.bf16, no_limit) == ("minilm-l6", 600, 5e-4, False, None)
    assert (mpnet.corpus, mpnet_5.corpus, minilm.corpus) == ("all", "all", "general")  # the recipes' text


class Exits:
    """A started process that has exited with ``code``."""

    def __init__(self, code):
        self.exitcode = code

    def join(self):
        pass


def test_a_background_build_that_stops_unfinished_is_resumed_a_bounded_number_of_times(caplog):
    from hmi.bootstrap import keep_building

    codes = iter([-9, 1, 0])
    started = []

    def start():
        started.append(1)
        return Exits(next(codes))

    assert keep_building(start, Exits(1), stopping=lambda: False) == 3  # killed, failed, failed, then done
    assert len(started) == 3
    assert keep_building(lambda: Exits(1), Exits(1), stopping=lambda: False, attempts=2) == 2
    assert "stopped 3 times" in caplog.text  # then serving goes on without it, and says so
    assert keep_building(lambda: Exits(1), Exits(-15), stopping=lambda: True) == 0  # shutting down: not restarted
    assert keep_building(lambda: Exits(1), Exits(0), stopping=lambda: False) == 0


def test_a_root_plot_its_builder_has_only_begun_to_create_reads_as_not_built_yet(tmp_path):
    import lmdb

    from hmi.bootstrap import root_plot_state
    from hmi.plot.store import PlotMeta, PlotStore

    plot = tmp_path / "plots" / "art" / "root"
    plot.mkdir(parents=True)
    lmdb.open(str(plot), max_dbs=4).close()  # the environment, before its tables
    assert root_plot_state(tmp_path, "art") == {}
    PlotStore(plot, meta=PlotMeta("art", 2, 8), readonly=False).close()  # its tables and metadata
    assert root_plot_state(tmp_path, "art") == {}  # and no build record yet


def test_a_process_that_needs_the_data_waits_for_the_one_preparing_it_and_prepares_nothing_itself(tmp_path, monkeypatch):
    """`hmi serve` prepares the data in a process of its own while it imports the server; the
    preparation child that needs the data then waits on the lock instead of preparing it twice."""
    import fcntl
    import threading

    import hmi.bootstrap as bootstrap

    monkeypatch.setenv("HMI_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    calls = []
    monkeypatch.setattr(bootstrap, "prepare", lambda out: calls.append(out))
    with open(tmp_path / "data" / ".prepare.lock", "a") as held:  # the background preparation, under way
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=bootstrap.ensure_data)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # waiting for the lock
        (data_dir() / "stats.json").write_text("{}")  # the background preparation finishes
    waiter.join(10)
    assert not waiter.is_alive() and calls == []
    assert bootstrap.prepare_data_in_background() is None  # prepared: nothing to start
