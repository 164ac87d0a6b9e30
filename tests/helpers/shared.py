"""What a test run prepares once and many tests read: a home with the default root's artifact and
its full root PLOT, and the decoder's fp32 copy (dequantized from its GGUF).

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


def prepare_root_home(home: Path) -> None:
    """The default root's (shipped) artifact, its full root PLOT and, beside the PLOT, the shipped
    learned back-off (which a server's first start places there)."""
    from hmi.bootstrap import prepare_default
    from hmi.model.artifact import SHIPPED_DIR
    from hmi.plot import learned
    from hmi.plot.paths import root_plot_path

    root = prepare_default(home)
    learned.install(root_plot_path(root, home), SHIPPED_DIR / root.artifact_id)


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
