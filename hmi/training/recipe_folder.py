"""Where a calibration keeps its resumable state: one folder per recipe.

A run of hours keeps a checkpoint and, once finished, a ``done`` file in its work folder.  With one
folder per root and split, running another recipe (more steps, another rate) started over in the
same folder and lost the first recipe's state: that recipe, run again, trained from its first step.
Each recipe now has a folder of its own: the run's name, then a digest of the settings where the
recipe differs from the default one (none for the default).  A folder of the earlier layout that
holds this recipe's state is renamed to its new name, so a run stopped before continues.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path


def recipe_key(recipe, default) -> str:
    """A digest (10 hex digits) of the settings in which dataclass ``recipe`` differs from
    ``default``, "" when it differs in none.  A setting added later with a default that keeps the
    earlier behaviour leaves every existing key as it was."""
    base = asdict(default)
    changed = {k: v for k, v in asdict(recipe).items() if k not in base or v != base[k]}
    return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10] if changed else ""


def recipe_folder(base: Path, run: str, recipe, default, holds: Callable[[Path], bool]) -> Path:
    """``base/<run>`` for the default recipe, ``base/<run>-<recipe_key>`` for another.  Where the
    keyed folder does not exist yet and ``holds(base/<run>)`` (the earlier layout's folder holds
    this recipe's state), that folder is renamed to it."""
    key = recipe_key(recipe, default)
    folder = base / (f"{run}-{key}" if key else run)
    earlier = base / run
    if key and not folder.exists() and earlier.is_dir() and holds(earlier):
        earlier.rename(folder)
    return folder
