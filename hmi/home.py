"""The HMI home directory: root artifacts, PLOTs, domains, tenants, registry."""

from __future__ import annotations

import os
from pathlib import Path


def hmi_home() -> Path:
    """``HMI_HOME``, else ``$XDG_DATA_HOME/hmi`` (default ``~/.local/share/hmi``)."""
    env = os.environ.get("HMI_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "hmi"
