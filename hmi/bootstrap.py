"""The embedded default made ready: prepared data, a calibrated root and its root PLOT, each only
when missing.  Used by ``hmi serve``, ``hmi prepare``, ``hmi demo`` and the benchmarks.

Imports of the model side (torch, transformers) happen inside the functions: importing this
module must not load transformers before :func:`quiet_transformers` has switched it offline
(the data and allocator modules load neither)."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from hmi.allocator import tune_allocator
from hmi.data import corpus_texts, data_dir, held_out_texts
from hmi.data.prepare import prepare
from hmi.model.aliases import DECODER_L_LOW, DEFAULT_L_LOW, DEFAULT_ROOT, calibration_recipe, default_l_low, pointer_name, source_of


def offline() -> None:
    """Nothing is fetched from a model hub (read when the libraries are imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def quiet_transformers() -> None:
    """Offline, and without the libraries' per-call warnings."""
    offline()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # The adapters library warns on every forward of a model that holds inactive adapters.
    logging.getLogger("adapters").setLevel(logging.ERROR)


def ensure_data() -> None:
    """Fetches and prepares the tasks and corpora unless they are prepared already. One process
    prepares at a time (an exclusive lock beside the data): another that needs the data waits for
    it, then finds it prepared."""
    if (data_dir() / "stats.json").exists():
        return
    data_dir().mkdir(parents=True, exist_ok=True)
    with open(data_dir() / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if not (data_dir() / "stats.json").exists():
            prepare(data_dir())


def prepare_data_in_background() -> multiprocessing.Process | None:
    """Starts ``ensure_data`` in a process of its own when the data is not prepared yet, and
    returns it (None when there is nothing to do); whatever needs the data later calls
    ``ensure_data``, which waits for it."""
    if (data_dir() / "stats.json").exists():
        return None
    proc = multiprocessing.get_context("spawn").Process(target=ensure_data, name="hmi-data")
    proc.start()
    return proc


def calibrate_default(l_low: int | None = None, seed: int = 0, backoff: bool = True, eval_texts: int = 256,
                      home: Path | None = None, root: str = DEFAULT_ROOT, max_minutes: float | None = None,
                      **config) -> tuple[str, dict]:
    """Calibrates a root's windowed lower layers (by default the packaged MiniLM-L6's, split 3+3)
    on the recipe's corpus (``CalibrationConfig.corpus``, resumable) with the root's recipe (``calibration_recipe``); ``config``
    overrides it. ``max_minutes`` limits this call (``hmi.training.calibrate.calibrate``).
    Returns (artifact id, its metadata)."""
    from hmi.model.artifact import uncalibrated_root
    from hmi.model.catalog import root_spec
    from hmi.training.calibrate import CalibrationConfig, calibrate

    ensure_data()
    cfg = CalibrationConfig(seed=seed, backoff=backoff, **{**calibration_recipe(root), **config})
    spec = root_spec(root, l_low, home)
    return calibrate(uncalibrated_root(spec), corpus_texts(cfg.corpus), held_out_texts(eval_texts), cfg, home=home,
                     max_minutes=max_minutes)


def check_shipped(l_low: int = DEFAULT_L_LOW) -> tuple[str | None, str]:
    """Calibrates with the defaults in a throw-away home; returns (the shipped artifact's id for
    this root and split or None, the id just calibrated): equal ids are equal weights, bit for bit."""
    from hmi.model.artifact import find_shipped
    from hmi.model.root import default_spec, load_bert

    shipped = find_shipped(load_bert(default_spec(l_low).model_dir), l_low)
    with tempfile.TemporaryDirectory(prefix="hmi-check-") as tmp:
        artifact_id, _ = calibrate_default(l_low, home=Path(tmp))
    return (shipped.name if shipped else None), artifact_id


def check_shipped_decoder(l_low: int = DECODER_L_LOW) -> tuple[str | None, str]:
    """``check_shipped`` for the decoder root: (the shipped windows' artifact folder or None, the
    folder just calibrated with the defaults); the folder's name holds the weights' digest."""
    from hmi.model.decoder import load_decoder
    from hmi.training.calibrate_decoder import calibrate_and_save, decoder_recipe, find_shipped_decoder

    shipped = find_shipped_decoder(load_decoder(l_low=l_low))
    with tempfile.TemporaryDirectory(prefix="hmi-check-") as tmp:
        root, _ = calibrate_and_save(Path(tmp), l_low, decoder_recipe(l_low))
    return (shipped.name if shipped else None), root.artifact_id


def prepare_default(home: Path, root: str = DEFAULT_ROOT, l_low: int | None = None, plot: bool = True):
    """Data, calibrated root and (with ``plot``) root PLOT, each only when missing (with progress
    bars); the default root's shipped calibration is installed rather than recomputed where it fits."""
    from hmi.model.artifact import current_artifact_id, install_shipped, load_root
    from hmi.model.catalog import root_spec
    from hmi.model.root import load_bert
    from hmi.plot.paths import ensure_root_plot
    from hmi.training.calibrate import CalibrationConfig

    ensure_data()
    spec = root_spec(root, l_low, home)
    if current_artifact_id(home, spec.pointer) is None:
        shipped = install_shipped(load_bert(spec.model_dir), spec.l_low, home) if spec.source is None else None
        if shipped is not None:
            print(f"root artifact {shipped}: the calibrated lower layers shipped with hmi, checked against the root")
        else:
            steps = CalibrationConfig(**calibration_recipe(root)).steps
            print(f"calibrating the root {spec.name} at L_low={spec.l_low} (first start only: {steps} steps, about "
                  "10 minutes on 2 cores for MiniLM-L6, 1 to 3.5 hours for mpnet-base; stopped, it continues "
                  "from its last checkpoint)")
            calibrate_default(spec.l_low, home=home, root=root)
    root = load_root(home=home, spec=spec)
    if plot:
        summary = ensure_root_plot(root, home=home)
        if not summary.get("up_to_date"):
            print(f"root PLOT ready: {summary['entries']} entries")
    return root


def learn_served_backoff(root, store, cfg=None) -> dict | None:
    """What ``hmi prepare`` does last: where ``--miss-policy auto`` serves a learned back-off on
    ``root`` at its split (``auto_miss_policy``) and none ships for its artifact, the one of its root
    PLOT ``store`` is trained (or resumed from its last checkpoint) as ``hmi plot learn-backoff``
    trains it (``cfg``: its ``TrainConfig``, default the command's), so that a prepared home serves
    the root's choice. Returns the training's record, or None where there was nothing to train."""
    from hmi.model.aliases import auto_miss_policy
    from hmi.plot import learned
    from hmi.plot.lookup import LEARNED_POLICIES
    from hmi.training import backoff

    if learned.trained(learned.place_shipped(store, root)) or \
            auto_miss_policy(root.spec.source, root.spec.l_low) not in LEARNED_POLICIES:
        return None
    print("training the root PLOT's learned back-off, which `--miss-policy auto` serves on this root "
          "(as `hmi plot learn-backoff` does; stopped, it continues from its last checkpoint)", flush=True)
    return backoff.train(store, cfg or backoff.TrainConfig())


def is_prepared(home: Path, root: str = DEFAULT_ROOT, l_low: int | None = None, plot: bool = True) -> bool:
    """Whether data, a calibrated root and (with ``plot``) its complete root PLOT exist, read from
    their records alone (no tokenizing, no model loading)."""
    if l_low is None and default_l_low(root) is None:
        return False
    from hmi.model.artifact import current_artifact_id

    artifact = current_artifact_id(home, pointer_name(source_of(root), l_low or default_l_low(root)))
    if artifact is None or not (data_dir() / "stats.json").exists():
        return False
    return not plot or root_plot_state(home, artifact).get("complete", False)


def _root_plot_dir(home: Path, artifact: str) -> Path:
    """Where an artifact's root PLOT lives (``hmi.plot.paths.root_plot_path``, without loading the root)."""
    return Path(home) / "plots" / str(artifact) / "root"


def root_plot_state(home: Path, artifact: str) -> dict:
    """The build record of an artifact's root PLOT (``{}`` when there is none yet, or when the
    building child has created the store but not written its metadata yet)."""
    import lmdb

    from hmi.plot.store import PlotMissingError, PlotStore

    plot = _root_plot_dir(home, artifact)
    if not (plot / "data.mdb").exists():
        return {}
    try:
        store = PlotStore(plot, readonly=True)
    except (PlotMissingError, lmdb.NotFoundError):  # its tables or metadata not written yet
        return {}
    try:
        return store.get_record("build") or {}
    finally:
        store.close()


def _prepare_child(home: str, root: str, l_low: int | None, plot: bool = True) -> None:
    quiet_transformers()
    tune_allocator()
    prepare_default(Path(home), root, l_low, plot)


def prepare_in_child(home: Path, root: str = DEFAULT_ROOT, l_low: int | None = None, plot: bool = True):
    """The embedded default made ready in a child process when anything is missing, so that the
    memory calibration and the PLOT build take returns to the system when the child ends (the
    serving process keeps freed heap for reuse, ``hmi.allocator``); then the root loaded here.
    Without ``plot`` the root PLOT is left to ``build_root_plot_in_background``."""
    from hmi.model.artifact import load_root
    from hmi.model.catalog import root_spec

    if not is_prepared(home, root, l_low, plot):
        child = multiprocessing.get_context("spawn").Process(target=_prepare_child,
                                                             args=(str(home), root, l_low, plot), name="hmi-prepare")
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"hmi: preparing the embedded default failed (exit code {child.exitcode}); "
                             "the messages above say why, and the next start resumes where it stopped")
    return load_root(home=home, spec=root_spec(root, l_low, home))


def _build_plot_child(home: str, root: str, l_low: int | None, decoder: bool = False) -> None:
    quiet_transformers()
    tune_allocator()
    try:
        os.nice(5)  # serving goes first: the build only makes answers faster
    except OSError:
        pass
    from hmi.plot.paths import ensure_root_plot

    if decoder:
        from hmi.training.calibrate_decoder import load_calibrated_decoder

        target = load_calibrated_decoder(Path(home))
    else:
        from hmi.model.artifact import load_root
        from hmi.model.catalog import root_spec

        target = load_root(home=Path(home), spec=root_spec(root, l_low, Path(home)))
    ensure_root_plot(target, home=Path(home), progress=False)


def build_root_plot_in_background(home: Path, artifact: str, root: str = DEFAULT_ROOT, l_low: int | None = None,
                                  timeout_s: float = 600.0, decoder: bool = False):
    """Starts the build of a calibrated root's PLOT (``decoder``: the current calibrated decoder
    root's causal PLOT) in a child process unless it is complete, and returns it (None when there
    is nothing to build) once the build has published its plan, from when on the PLOT can be
    served as it will be (``hmi.plot.pending``)."""
    if root_plot_state(home, artifact).get("complete"):
        return None
    child = start_root_plot_build(home, root, l_low, decoder)
    deadline = time.monotonic() + timeout_s
    while not _plan_published(home, artifact):
        if not child.is_alive():
            raise SystemExit(f"hmi: building the root PLOT failed (exit code {child.exitcode}); the messages above "
                             "say why, and the next start resumes where it stopped")
        if time.monotonic() > deadline:
            child.terminate()
            raise SystemExit(f"hmi: the root PLOT's build published no plan in {timeout_s:g} s")
        time.sleep(0.2)
    return child


def start_root_plot_build(home: Path, root: str = DEFAULT_ROOT, l_low: int | None = None, decoder: bool = False):
    """Starts (or resumes) the root PLOT's build (``decoder``: the decoder root's) in a child
    process and returns it at once; it opens nothing here, so a serving process that reads the
    PLOT may call it."""
    child = multiprocessing.get_context("spawn").Process(target=_build_plot_child,
                                                         args=(str(home), root, l_low, decoder),
                                                         name="hmi-plot-build", daemon=True)
    child.start()
    return child


def _calibrate_decoder_child(home: str, l_low: int) -> None:
    quiet_transformers()
    tune_allocator()
    from hmi.training.calibrate_decoder import calibrate_and_save, decoder_recipe

    ensure_data()
    calibrate_and_save(Path(home), l_low, decoder_recipe(l_low))


def prepare_decoder(home: Path, l_low: int = DECODER_L_LOW, plot: bool = False):
    """The calibrated decoder root (SmolLM2-135M): the home's current one; else the calibrated
    windows shipped with the package where they fit the installed decoder (checked by fingerprint
    and sha256); else calibrated in a child process (its memory returns to the system when it
    ends).  With ``plot`` its causal PLOT is built here (in the foreground, where missing or
    unfinished); else it is left to ``build_root_plot_in_background(decoder=True)``."""
    from hmi.model.decoder import load_decoder
    from hmi.training.calibrate_decoder import load_calibrated_decoder

    decoder = load_decoder(l_low=l_low)
    root = load_calibrated_decoder(home, decoder)
    if root is None:
        root = _install_or_calibrate_decoder(home, decoder, l_low)
    if plot:
        from hmi.plot.paths import ensure_root_plot

        ensure_root_plot(root, home=home)
    return root


def _install_or_calibrate_decoder(home: Path, decoder, l_low: int):
    from hmi.training.calibrate_decoder import decoder_recipe, install_shipped_decoder, load_calibrated_decoder

    name = install_shipped_decoder(home, decoder)
    if name is not None:
        print(f"decoder root {name}: the calibrated windows shipped with hmi, checked against the decoder")
    else:
        print(f"calibrating the decoder's windowed lower layers (L_low = {l_low}; first start only, "
              f"{decoder_recipe(l_low).steps} steps)")
        child = multiprocessing.get_context("spawn").Process(target=_calibrate_decoder_child, args=(str(home), l_low),
                                                             name="hmi-prepare-decoder")
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"hmi: calibrating the decoder failed (exit code {child.exitcode}); the messages above "
                             "say why")
    return load_calibrated_decoder(home, decoder)


def keep_building(start: Callable[[], object], first, stopping: Callable[[], bool], attempts: int = 3,
                  log=logging.getLogger("hmi.server"), what: str = "the root PLOT") -> int:
    """Watches a background build (``first``, a started process) and starts it again with
    ``start()`` when it stops unfinished, as the build resumes where it stopped, up to
    ``attempts`` times, unless ``stopping()`` (the server is shutting down).  Returns the restarts
    made.  Meanwhile serving goes on: the values the PLOT lacks are computed on demand."""
    proc, restarts = first, 0
    while True:
        proc.join()
        if proc.exitcode == 0 or stopping():
            return restarts
        if restarts == attempts:
            log.error("%s's build stopped %d times (exit code %s); serving goes on, computing what it lacks; the "
                      "next start resumes the build", what, restarts + 1, proc.exitcode)
            return restarts
        restarts += 1
        log.warning("%s's build stopped (exit code %s); resuming it (%d of %d)", what, proc.exitcode, restarts,
                    attempts)
        proc = start()


def _plan_published(home: Path, artifact: str) -> bool:
    from hmi.plot.pending import plan_path

    state = root_plot_state(home, artifact)
    return bool(state) and (state.get("complete") or plan_path(_root_plot_dir(home, artifact), state["fingerprint"]).exists())
