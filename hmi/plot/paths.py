"""Where a root's PLOT lives and what it records, for every root (encoder or decoder).

A root exposes ``artifact_id``, ``l_low``, ``hidden_size``, ``tokenizer``, ``plot_kind``
("encoder": a value holds the three states of a tri-gram window; "causal": one state) and
``plot_lower`` (the module that turns windows into values and merges them).  The root PLOT of an
artifact is ``$HMI_HOME/plots/<artifact_id>/root``, built from the general corpus.
"""

from __future__ import annotations

from pathlib import Path

from hmi.data import load_corpus
from hmi.home import hmi_home
from hmi.plot.build import Selection, build_from_corpus
from hmi.plot.codec import leaf_chunks, value_bytes
from hmi.plot.lookup import PlotVersion
from hmi.plot.store import PlotMeta, PlotStore


def plot_meta(root) -> PlotMeta:
    """What a PLOT built from ``root`` records (checked whenever it is opened, the value format
    aside: an existing PLOT keeps its own). New encoder PLOTs store int8 rows with a scale each,
    a third of fp16's disk at hidden 384 for a 0.0002 lower pooled cosine
    (``docs/results/bench_plot_formats.md``); a decoder's causal PLOT keeps fp16 (its hidden states
    have outlier dimensions that one scale per row would flatten). Either in leaf-sized records."""
    n = 1 if root.plot_kind == "causal" else 3
    dtype = "float16" if root.plot_kind == "causal" else "int8"
    return PlotMeta(root_artifact=root.artifact_id, l_low=root.l_low, hidden_size=root.hidden_size, n=n,
                    kind=root.plot_kind, dtype=dtype, chunks=leaf_chunks(value_bytes(dtype, n, root.hidden_size)))


def root_plot_path(root, home: Path | None = None) -> Path:
    return artifact_plot_path(root.artifact_id, home)


def artifact_plot_path(artifact_id: str, home: Path | None = None) -> Path:
    """Where the root PLOT of the artifact ``artifact_id`` lives, without loading the root."""
    return Path(home or hmi_home()) / "plots" / artifact_id / "root"


def ensure_root_plot(root, lines: list[str] | None = None, home: Path | None = None, progress: bool = True) -> dict:
    """Builds (or finishes, or confirms) the root PLOT of ``root`` from ``lines`` (by default the
    general corpus)."""
    if lines is None:
        lines = load_corpus("general")
    store = PlotStore(root_plot_path(root, home), meta=plot_meta(root), readonly=False)
    try:
        return build_from_corpus(store, root.plot_lower, root.tokenizer, lines, Selection("all"), progress=progress)
    finally:
        store.close()


def open_root_store(root, home: Path | None = None, writable: bool = False) -> PlotStore:
    """``writable``: for the miss policy ``compute+insert``, which keeps misses in it (``hmi.plot.kept``)."""
    return PlotStore(root_plot_path(root, home), readonly=not writable, expect=plot_meta(root))


def open_root_version(root, home: Path | None = None, writable: bool = False) -> PlotVersion:
    return PlotVersion("root", open_root_store(root, home, writable), root.plot_lower)
