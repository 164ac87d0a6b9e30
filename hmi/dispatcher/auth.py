"""Tokens: an admin token, and per-tenant tokens stored only as hashes."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from hmi.io import atomic_write_text


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(24)}"


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def admin_token(home: Path) -> tuple[str, bool]:
    """The admin token: ``HMI_ADMIN_TOKEN`` when set, else the one in ``<home>/admin_token``
    (mode 0600), generated on first start.  Returns (token, newly generated)."""
    env = os.environ.get("HMI_ADMIN_TOKEN")
    if env:
        return env, False
    path = home / "admin_token"
    if path.exists():
        return path.read_text().strip(), False
    token = new_token("hmi_admin")
    atomic_write_text(path, token + "\n", mode=0o600)
    return token, True
