"""The embedded default: the root PLOT of the current root artifact, built from the general corpus."""

from __future__ import annotations

from pathlib import Path

from hmi.home import hmi_home
from hmi.model.artifact import Root
from hmi.plot.build import Selection, build_from_corpus
from hmi.plot.lookup import PlotVersion
from hmi.plot.store import PlotMeta, PlotStore


def plot_meta(root: Root) -> PlotMeta:
    return PlotMeta(root_artifact=root.artifact_id, l_low=root.spec.l_low, hidden_size=root.hidden_size)


def root_plot_path(root: Root, home: Path | None = None) -> Path:
    return (home or hmi_home()) / "plots" / root.artifact_id / "root"


def ensure_root_plot(root: Root, lines: list[str] | None = None, home: Path | None = None,
                     progress: bool = True) -> dict:
    """Builds (or finishes, or confirms) the root PLOT from the general corpus."""
    if lines is None:
        from hmi.data import load_corpus

        lines = load_corpus("general")
    store = PlotStore(root_plot_path(root, home), meta=plot_meta(root), readonly=False)
    try:
        return build_from_corpus(store, root.windowed, root.tokenizer, lines, Selection("all"), progress=progress)
    finally:
        store.close()


def open_root_version(root: Root, home: Path | None = None) -> PlotVersion:
    store = PlotStore(root_plot_path(root, home), readonly=True, expect=plot_meta(root))
    return PlotVersion("root", store, root.windowed)
