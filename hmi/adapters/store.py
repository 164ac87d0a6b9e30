"""Tenant adapter store: safetensors on disk (atomic), a host-memory LRU bounded in MB.

Layout: ``<dir>/<tenant>/adapter.safetensors`` (adapter + head, fp16 by default) and
``<dir>/<tenant>/tenant.json`` (spec, domain, metrics).  A tenant's files are written into a
temporary folder and renamed into place, so a reader sees the old version or the new one.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hmi.adapters.spec import AdapterSpec

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class TenantMissingError(KeyError):
    """No stored adapter for this tenant."""

    def __str__(self) -> str:
        return f"unknown tenant {self.args[0]!r}"


def check_tenant_name(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise ValueError(f"invalid tenant name {name!r}: use 1-63 characters a-z, 0-9, '_' or '-', "
                         "starting with a letter or digit")
    return name


def weights_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class AdapterStore:
    """Disk tier + host tier of tenant adapters. Thread-safe."""

    def __init__(self, root: Path | str, host_cache_mb: float = 1024, dtype: torch.dtype = torch.float16,
                 pin_memory: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = int(host_cache_mb * 2**20)
        self.dtype = dtype
        self.pin_memory = pin_memory  # page-locked host copies for asynchronous GPU transfers
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stats = Counter()

    def path(self, tenant: str) -> Path:
        return self.root / check_tenant_name(tenant)

    def save(self, tenant: str, spec: AdapterSpec, weights: dict[str, torch.Tensor], info: dict | None = None) -> None:
        """Writes (or replaces) a tenant's adapter atomically and drops its cached copy."""
        final = self.path(tenant)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{tenant}.new-"))
        try:
            save_file({k: v.detach().to(self.dtype).contiguous().cpu() for k, v in weights.items()},
                      str(tmp / "adapter.safetensors"))
            (tmp / "tenant.json").write_text(json.dumps({"spec": spec.to_dict(), **(info or {})}, indent=1))
            old = None
            if final.exists():
                old = self.root / f".{tenant}.old-{tmp.name[-8:]}"
                final.rename(old)
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self.invalidate(tenant)

    def delete(self, tenant: str) -> None:
        final = self.path(tenant)
        if not final.exists():
            raise TenantMissingError(tenant)
        trash = self.root / f".{tenant}.deleted"
        if trash.exists():
            shutil.rmtree(trash)
        final.rename(trash)
        self.invalidate(tenant)
        shutil.rmtree(trash, ignore_errors=True)

    def exists(self, tenant: str) -> bool:
        return (self.path(tenant) / "adapter.safetensors").exists()

    def tenants(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / "tenant.json").exists())

    def info(self, tenant: str) -> dict:
        p = self.path(tenant) / "tenant.json"
        if not p.exists():
            raise TenantMissingError(tenant)
        return json.loads(p.read_text())

    def spec(self, tenant: str) -> AdapterSpec:
        return AdapterSpec.from_dict(self.info(tenant)["spec"])

    def load(self, tenant: str) -> dict[str, torch.Tensor]:
        """A tenant's weights (stored dtype, fp16 by default) from the host cache, or from disk into
        the cache.  The pool casts them to its compute dtype when it copies them in."""
        with self._lock:
            w = self._cache.get(tenant)
            if w is not None:
                self._cache.move_to_end(tenant)
                self.stats["host_hits"] += 1
                return w
        p = self.path(tenant) / "adapter.safetensors"
        if not p.exists():
            raise TenantMissingError(tenant)
        w = load_file(str(p))
        if self.pin_memory:
            w = {k: v.pin_memory() for k, v in w.items()}
        size = weights_bytes(w)
        with self._lock:
            self.stats["disk_loads"] += 1
            if tenant not in self._cache:
                self._cache[tenant] = w
                self._bytes += size
                self._sizes[tenant] = size
                while self._bytes > self.capacity and len(self._cache) > 1:
                    victim, _ = self._cache.popitem(last=False)
                    self._bytes -= self._sizes.pop(victim)
                    self.stats["host_evictions"] += 1
        return w

    def invalidate(self, tenant: str) -> None:
        with self._lock:
            if self._cache.pop(tenant, None) is not None:
                self._bytes -= self._sizes.pop(tenant)

    @property
    def host_bytes(self) -> int:
        return self._bytes
