"""Authentication: an admin token, per-tenant tokens stored only as hashes, and ``Auth``, which
tells whom a token belongs to (the HTTP layer reads it off the request:
``hmi.dispatcher.validation.bearer``)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

from hmi.errors import Kind, Refusal
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


class Auth:
    """Who a request comes from: the admin, a tenant (its token's SHA-256 is in its registry
    record, confirmed on every request in constant time), or nobody (``UNAUTHENTICATED``).  Keeps the map from
    token digests to tenant names that lets a request find its record in one read; on a home
    shared with other serving processes, tokens issued there are read at most once a second.
    Tokens are random 192-bit secrets: looking up their SHA-256 leaks nothing useful."""

    def __init__(self, registry, admin: str, shared_home: bool = False):
        self.registry = registry
        self.admin = admin
        self.shared_home = shared_home
        self._owner_by_digest: dict[str, str] = {}
        self._read_at = 0.0  # when the map was last rebuilt from the registry (shared home)

    # -- tokens ----------------------------------------------------------------------------------
    @staticmethod
    def issue() -> tuple[str, str]:
        """A new tenant token: (the token, shown once; its digest, kept in the tenant's record)."""
        token = new_token("hmi_t")
        return token, hash_token(token)

    def remember(self, name: str, digest: str) -> None:
        """Records that ``digest`` belongs to tenant ``name`` (its record was written)."""
        self._owner_by_digest[digest] = name

    def forget(self, digest: str) -> None:
        self._owner_by_digest.pop(digest, None)

    # -- callers -------------------------------------------------------------------------------
    async def caller(self, token: str) -> str:
        """``admin`` or the name of the tenant whose token ``token`` is; ``UNAUTHENTICATED`` otherwise."""
        return (await self.identify(token))[0]

    async def identify(self, token: str) -> tuple[str, dict | None]:
        """(``caller``, the tenant's record that confirmed its token; None for the admin).  The
        record is awaited, so a registry kept by another process (a Ray actor's round trip) does
        not hold up the event loop."""
        if same(token, self.admin):
            return "admin", None
        digest = hash_token(token)
        name = self._owner(digest)
        rec = None if name is None else await self.registry.aget("tenants", name)
        if not self._owns(rec, digest):
            raise Refusal(Kind.UNAUTHENTICATED, "unauthorized", "the token is not valid")
        return name, rec

    async def require_admin(self, token: str) -> None:
        if await self.caller(token) != "admin":
            raise Refusal(Kind.FORBIDDEN, "forbidden", "this operation needs the admin token")

    async def require_owner(self, token: str, tenant: str) -> str:
        """The caller, when it is the admin or ``tenant`` itself; ``UNAUTHENTICATED`` or ``FORBIDDEN`` otherwise."""
        return self.may_act(await self.caller(token), tenant)

    @staticmethod
    def may_act(who: str, tenant: str) -> str:
        """``who`` (a ``caller``) if it may act on ``tenant``: the admin or the tenant; ``FORBIDDEN`` otherwise."""
        if who != "admin" and who != tenant:
            raise Refusal(Kind.FORBIDDEN, "forbidden", f"this token may not act on tenant {tenant!r}")
        return who

    def _owner(self, digest: str) -> str | None:
        """The tenant a digest was issued to as this process knows it; its record still has to
        confirm it (``_owns``)."""
        name = self._owner_by_digest.get(digest)
        if name is None and self.shared_home and time.time() - self._read_at > 1.0:
            self._read_at = time.time()
            self._owner_by_digest.update({rec.get("token_hash", ""): n for n, rec in self.registry.items("tenants")})
            name = self._owner_by_digest.get(digest)
        return name

    @staticmethod
    def _owns(rec: dict | None, digest: str) -> bool:
        return rec is not None and same(rec.get("token_hash", ""), digest)  # constant-time
