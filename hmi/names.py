"""Names of tenants and domains: one rule for both, matched against the whole string."""

from __future__ import annotations

import re

NAME_PATTERN = r"[a-z0-9][a-z0-9_-]{0,62}"
_NAME = re.compile(NAME_PATTERN)


def is_valid_name(name: object) -> bool:
    """1-63 characters a-z, 0-9, '_' or '-', starting with a letter or digit; nothing after
    (``fullmatch``: ``re.match`` with ``$`` would also accept a trailing newline)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None
