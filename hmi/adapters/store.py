"""Tenant adapter store: safetensors on disk (versioned, atomic), a host-memory LRU bounded in MB.

Layout: ``<dir>/<tenant>/<version>/adapter.safetensors`` (adapter + head, fp16 by default) and
``.../tenant.json`` (spec, domain, metrics); ``<dir>/<tenant>/CURRENT`` names the version served.
A version folder is written under a temporary name, flushed and renamed into place; replacing a
tenant's adapter is then one atomic rename of ``CURRENT`` (file and folder fsynced).  A crash at
any point leaves the old version or the new one served, never neither.  Fine-tune jobs write a
version named by their job id without publishing it; the server publishes it only if the tenant
still belongs to that job.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from hmi.adapters.spec import AdapterSpec, canonical_names, layer_of
from hmi.io import atomic_write_text, fsync_dir, write_durable
from hmi.names import is_valid_name

POINTER = "CURRENT"
TMP = ".tmp-"  # a version being written: ``.tmp-<version>-<8 hex>``
WEIGHTS = "adapter.safetensors"
INFO = "tenant.json"


class TenantMissingError(KeyError):
    """No stored adapter for this tenant."""

    def __str__(self) -> str:
        return f"unknown tenant {self.args[0]!r}"


def check_tenant_name(name: str) -> str:
    if not is_valid_name(name):
        raise ValueError(f"invalid tenant name {name!r}: use 1-63 characters a-z, 0-9, '_' or '-', "
                         "starting with a letter or digit")
    return name


def weights_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class AdapterStore:
    """Disk tier + host tier of tenant adapters. Thread-safe; several processes may write
    distinct versions of one tenant at once (only ``publish`` switches what is served)."""

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

    def current(self, tenant: str) -> Path | None:
        """The folder of the version served, or None."""
        base = self.path(tenant)
        try:
            version = (base / POINTER).read_text().strip()
        except FileNotFoundError:
            return base if (base / WEIGHTS).exists() else None  # a tenant stored before versions existed
        return base / version

    def save(self, tenant: str, spec: AdapterSpec, weights: dict[str, torch.Tensor], info: dict | None = None,
             version: str | None = None, publish: bool = True) -> str:
        """Writes a version of a tenant's adapter (flushed to disk) and, with ``publish``, serves
        it. Returns the version's name."""
        version = version or f"v{uuid.uuid4().hex[:12]}"
        if not is_valid_name(version):
            raise ValueError(f"invalid version name {version!r}")
        base = self.path(tenant)
        base.mkdir(parents=True, exist_ok=True)
        cur = self.current(tenant)
        if (base / version).exists() and (cur is None or cur.name != version):
            shutil.rmtree(base / version)  # left by an earlier run of the same job, never served
        tmp = base / f"{TMP}{version}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_durable(tmp / WEIGHTS, save({k: v.detach().to(self.dtype).contiguous().cpu() for k, v in weights.items()}))
            write_durable(tmp / INFO, json.dumps({"spec": spec.to_dict(), **(info or {})}, indent=1).encode())
            fsync_dir(tmp)
            os.rename(tmp, base / version)
            fsync_dir(base)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if publish:
            self.publish(tenant, version)
        return version

    def publish(self, tenant: str, version: str) -> None:
        """Serves ``version`` from now on (one atomic rename), then removes the older versions."""
        base = self.path(tenant)
        if not (base / version / WEIGHTS).exists():
            raise TenantMissingError(tenant)
        atomic_write_text(base / POINTER, version)
        self.invalidate(tenant)
        self._prune(base, keep=version)

    def discard(self, tenant: str, version: str) -> None:
        """Removes a version that will never be served (its job no longer owns the tenant)."""
        base = self.path(tenant)
        cur = self.current(tenant)
        if cur is None or cur.name != version:
            shutil.rmtree(base / version, ignore_errors=True)
        if base.exists() and not any(base.iterdir()):
            base.rmdir()

    @staticmethod
    def _prune(base: Path, keep: str) -> None:
        for p in base.iterdir():
            if p.is_dir() and p.name != keep and not p.name.startswith(TMP):
                shutil.rmtree(p, ignore_errors=True)
        for name in (WEIGHTS, INFO):  # the files of a tenant stored before versions existed
            (base / name).unlink(missing_ok=True)

    def delete(self, tenant: str) -> None:
        """Removes a tenant's every version: one rename makes it disappear, then the files go."""
        final = self.path(tenant)
        if self.current(tenant) is None:
            raise TenantMissingError(tenant)
        trash = self.root / f".deleted-{tenant}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        fsync_dir(self.root)
        self.invalidate(tenant)
        shutil.rmtree(trash, ignore_errors=True)

    def recover(self, keep: Callable[[str], bool] | None = None) -> None:
        """After a restart: removes deletions and writes that a crash cut short, and versions that
        were never published.  ``keep(version)`` (a home shared with running processes) spares the
        versions, finished or still being written, of jobs that are still running elsewhere."""
        def kept(v: Path) -> bool:
            version = v.name[len(TMP):].rpartition("-")[0] if v.name.startswith(TMP) else v.name  # save()'s names
            return keep is not None and keep(version)

        for p in self.root.iterdir():
            if p.name.startswith(".deleted-") or (p.name.startswith(".") and p.is_dir()):
                shutil.rmtree(p, ignore_errors=True)
                continue
            if not p.is_dir():
                continue
            cur = self.current(p.name) if is_valid_name(p.name) else None
            if cur is None and (p / POINTER).exists():
                continue
            for v in p.iterdir():
                if v.is_dir() and v != cur and not kept(v):
                    shutil.rmtree(v, ignore_errors=True)
            if cur is None and not any(v.is_dir() for v in p.iterdir()):
                shutil.rmtree(p, ignore_errors=True)  # nothing published, nothing being written: a job cut short

    def exists(self, tenant: str) -> bool:
        return self.current(tenant) is not None

    def file(self, tenant: str) -> Path:
        """The weights file served for a tenant."""
        cur = self.current(tenant)
        if cur is None:
            raise TenantMissingError(tenant)
        return cur / WEIGHTS

    def tenants(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()
                      if not p.name.startswith(".") and is_valid_name(p.name) and self.current(p.name) is not None)

    def cached(self, tenant: str) -> bool:
        """Whether the tenant's weights are in the host cache."""
        with self._lock:
            return tenant in self._cache

    def info(self, tenant: str) -> dict:
        cur = self.current(tenant)
        if cur is None or not (cur / INFO).exists():
            raise TenantMissingError(tenant)
        return json.loads((cur / INFO).read_text())

    def spec(self, tenant: str) -> AdapterSpec:
        return AdapterSpec.from_dict(self.info(tenant)["spec"])

    def adapter_layers(self, tenant: str) -> int | None:
        """How many layers the served version of a tenant's adapter has weights in (its file's
        header read, not its tensors); None when it has no stored weights."""
        cur = self.current(tenant)
        if cur is None or not (cur / WEIGHTS).exists():
            return None
        with safe_open(str(cur / WEIGHTS), "pt") as f:
            found = {layer_of(k) for k in f.keys()} - {None}
        return max(found) + 1 if found else None

    def load(self, tenant: str, check=None) -> dict[str, torch.Tensor]:
        """A tenant's weights (stored dtype, fp16 by default) from the host cache, or from disk into
        the cache.  The pool casts them to its compute dtype when it copies them in.  ``check(weights)``,
        when given, runs on what is read from disk before it is cached (weights it refuses by
        raising are not cached)."""
        with self._lock:
            w = self._cache.get(tenant)
            if w is not None:
                self._cache.move_to_end(tenant)
                self.stats["host_hits"] += 1
                return w
        cur = self.current(tenant)
        if cur is None or not (cur / WEIGHTS).exists():
            raise TenantMissingError(tenant)
        w = canonical_names(load_file(str(cur / WEIGHTS)))
        if check is not None:
            check(w)
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
