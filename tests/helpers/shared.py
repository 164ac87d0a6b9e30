"""What a test run prepares once and many tests read: the decoder's fp32 copy (dequantized from its
GGUF), and the soak's home: the default root's artifact, the decoder's shipped windows and small
root PLOTs of both.

Both workers of ``make test`` share them: the first to need one builds it under a lock in the
run's common temporary folder, the other waits for it and reuses it.  Tests never write into
them: a test that needs them links them into a home of its own (``link_home``).
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock


def shared_folder(tmp_path_factory, worker_id: str) -> Path:
    """The run's folder common to all its workers (the base temporary folder's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return (base if worker_id == "master" else base.parent) / "shared"


def prepared(folder: Path, name: str, make) -> Path:
    """``folder / name``, made by ``make(path)`` once (under a lock; a ``.done`` mark after it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path, done = folder / name, folder / f"{name}.done"
    with FileLock(str(folder / f"{name}.lock")):
        if not done.exists():
            make(path)
            done.touch()
    return path


# The lines of the general corpus the soak's root PLOTs are built from (of 11,894): with every
# uni-gram and bi-gram of the back-off, about 80k entries for the encoder, 1/6 of the full PLOT.  A
# server serves a complete PLOT whatever it holds, so the soak's server neither builds one for
# minutes before it starts nor builds the decoder's beside its workload; the shipped demo adapters
# were trained on the full PLOTs, so the soak runs without the demo tenants (``--no-demo``).
ENCODER_PLOT_LINES = 1000
DECODER_PLOT_LINES = 200


def prepare_soak_home(home: Path, decoder_copy: Path) -> None:
    """The default root's (shipped) artifact and, beside its root PLOT (from the first
    ``ENCODER_PLOT_LINES`` lines of the general corpus), the shipped learned back-off; the
    decoder's fp32 copy (linked from ``decoder_copy``), its shipped calibrated windows and its
    causal PLOT (from ``DECODER_PLOT_LINES`` lines)."""
    from hmi.bootstrap import prepare_decoder, prepare_default
    from hmi.data import load_corpus
    from hmi.model.artifact import SHIPPED_DIR
    from hmi.plot import learned
    from hmi.plot.paths import ensure_root_plot, root_plot_path

    general = load_corpus("general")
    root = prepare_default(home, plot=False)
    ensure_root_plot(root, general[:ENCODER_PLOT_LINES], home=home, progress=False)
    learned.install(root_plot_path(root, home), SHIPPED_DIR / root.artifact_id)
    link_home(decoder_copy, home)
    ensure_root_plot(prepare_decoder(home), general[:DECODER_PLOT_LINES], home=home, progress=False)


def prepare_decoder_copy(home: Path) -> None:
    """The decoder's fp32 copy in ``home`` (``hmi.model.decoder.dequantized_dir``)."""
    from hmi.model.decoder import load_decoder

    load_decoder(2, home=home)


def link_home(source: Path, home: Path) -> Path:
    """``home`` holding what ``source`` prepared, without copying it: hard links of its files under
    ``roots/`` and ``models/`` (the artifacts, the decoder's fp32 copy; rewritten only by atomic
    replacement, which replaces the link) and a symbolic link to each of its root PLOTs
    (``plots/<artifact>/root``), so that what ``home`` writes (other PLOTs, tenants) stays in it."""
    for part in ("roots", "models"):
        for file in sorted((source / part).rglob("*")):
            target = home / file.relative_to(source)
            if file.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(file, target)
    for plot in sorted(source.glob("plots/*/root")):
        target = home / plot.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(plot, target_is_directory=True)
    return home
