"""The tenant life cycle of one serving process: which tenants it serves (and in which
version), creating, retraining and deleting them, and publishing what their jobs produce."""

from __future__ import annotations

import logging
from dataclasses import replace

from hmi.adapters.spec import AdapterSpec
from hmi.adapters.store import TenantMissingError
from hmi.errors import Kind, Refusal
from hmi.scheduler.types import TenantEntry
from hmi.services.jobs import new_job_id

log = logging.getLogger("hmi.server")


def is_private(rec: dict) -> bool:
    """Whether a record is a private tenant's: its adapter stays on its own side (``hmi.split``)."""
    return rec.get("model") == "private"


def private_error(name: str, what: str) -> Refusal:
    return Refusal(Kind.CONFLICT, "private_tenant", f"tenant {name!r} is private: {what}; it runs its adapter on its own side "
                    "with hmi.split, calling this server's base executor (POST /v1/base/...)")


def entry_of(name: str, rec: dict) -> TenantEntry:
    """The serving entry of an encoder tenant's registry record."""
    return TenantEntry(name, AdapterSpec.from_dict(rec["spec"]), rec.get("domain", "root"), rec.get("version", 0),
                       rec.get("truncate", False), rec.get("weight", 1.0))


class ServedTenants:
    """Which tenants this process answers for now, and how: the scheduler's and the batcher's
    view of them (``hmi.scheduler.types.TenantView``), kept in step with the registry by
    ``Tenants``.  Encoder tenants of another root, or of this root split at another layer, are
    known but not served (``wrong_root``)."""

    def __init__(self, root_fingerprint: str, root_name: str, l_low: int, layers: int):
        self.root_fingerprint, self.root_name = root_fingerprint, root_name
        self.l_low, self.layers = l_low, layers
        self._entries: dict[str, TenantEntry] = {}
        self._foreign: dict[str, str] = {}  # tenant -> the root (fingerprint) and split it was trained on
        self._gpt_ready: dict[str, float] = {}  # decoder tenants that can generate -> their weight

    def entry(self, tenant: str) -> TenantEntry:
        """The tenant's entry as this process serves it; a Refusal when it serves none."""
        e = self._entries.get(tenant)
        if e is None and tenant in self._foreign:
            raise Refusal(Kind.CONFLICT, "wrong_root", self.foreign_message(tenant))
        if e is None:
            raise Refusal(Kind.NOT_FOUND, "unknown_tenant", f"tenant {tenant!r} is not servable")
        return e

    def weight(self, tenant: str) -> float:
        """A tenant's share of the batches (or of the decoder's rows) relative to the others (1
        unless the admin set it; the root's own requests, ``""``, weigh 1)."""
        e = self._entries.get(tenant)
        return e.weight if e is not None else self._gpt_ready.get(tenant, 1.0)

    def decoder_ready(self, tenant: str) -> bool:
        """Whether a decoder tenant's LoRA is published and its generations are accepted."""
        return tenant in self._gpt_ready

    def count(self) -> int:
        """The encoder tenants served."""
        return len(self._entries)

    def count_whole(self) -> int:
        """The encoder tenants served on the full root (``AdapterSpec.whole``): each of their texts
        costs what the full root with an adapter costs."""
        return sum(e.whole for e in list(self._entries.values()))

    def names(self) -> list[str]:
        """The tenants this process answers for now: encoder and decoder."""
        return [*self._entries, *self._gpt_ready]

    def kind(self, tenant: str) -> str | None:
        """``encoder`` or ``decoder`` when this process answers for the tenant now, else None."""
        return "encoder" if tenant in self._entries else "decoder" if tenant in self._gpt_ready else None

    def split(self, l_low: int) -> str:
        """A split of this root as people write it: ``3+3``."""
        return f"{l_low}+{self.layers - l_low}"

    def foreign_message(self, tenant: str) -> str:
        return (f"tenant {tenant!r} was trained on {self._foreign[tenant]}; this server serves {self.root_name} "
                f"(fingerprint {self.root_fingerprint[:12]}) split {self.split(self.l_low)}: serve that root and "
                "split to use it")

    def is_foreign(self, tenant: str) -> bool:
        return tenant in self._foreign

    # -- changes (``Tenants``) -------------------------------------------------------------------
    def serve(self, name: str, rec: dict) -> None:
        """Serves the tenant of a published registry record (encoder or decoder)."""
        self._foreign.pop(name, None)
        if rec.get("model") == "decoder":
            self._gpt_ready[name] = rec.get("weight", 1.0)
        else:
            self._entries[name] = entry_of(name, rec)

    def foreign(self, name: str, trained_on: str | None) -> None:
        """Records that an encoder tenant was trained on another root or split (``trained_on`` says
        which, for people): known, not served (None: on this root and split after all)."""
        if trained_on is None:
            self._foreign.pop(name, None)
        else:
            self._foreign[name] = trained_on

    def drop(self, name: str) -> bool:
        """Stops serving a tenant; whether it was served."""
        self._foreign.pop(name, None)
        return self._entries.pop(name, None) is not None or self._gpt_ready.pop(name, None) is not None

    def set_weight(self, name: str, weight: float) -> None:
        if name in self._entries:
            self._entries[name] = replace(self._entries[name], weight=weight)
        elif name in self._gpt_ready:
            self._gpt_ready[name] = weight


class Tenants:
    """The tenant life cycle of one serving process, kept in step with the registry: which
    tenants ``served`` holds, creating, retraining and deleting them, and publishing what their
    jobs produce.

    Encoder tenants record the root they were trained on (its fingerprint); those of another root
    stay in the registry but are not served here (``wrong_root``).  On a home shared with
    other serving processes, a tenant is brought up to its registry record whenever it is used
    (``resolve``): a record is known by its creation time and version."""

    def __init__(self, registry, store, scheduler, jobs, auth, decoders, usage, served: ServedTenants,
                 default_root: bool, shared_home: bool = False):
        self.registry, self.store, self.scheduler, self.jobs = registry, store, scheduler, jobs
        self.auth, self.decoders, self.usage, self.served = auth, decoders, usage, served
        self.default_root, self.shared_home = default_root, shared_home
        self._synced: dict[str, tuple] = {}  # tenant -> (created, version) of the record served (shared home)
        # (tenant, created, version) of a record without a split -> the split its stored adapter gives:
        # read once, not on every request a shared home brings the record up to date for
        self._stored_split: dict[tuple, int | None] = {}
        for name, rec in self.registry.items("tenants"):
            self.auth.remember(name, rec.get("token_hash", ""))
            if rec["state"] == "importing":
                rec = self.recover_import(name, rec)
            if rec.get("model") != "decoder" and (other := self._trained_elsewhere(name, rec)):
                served.foreign(name, other)
            elif rec["state"] in ("ready", "updating") and not is_private(rec):
                served.serve(name, rec)

    def trained_with_another_policy(self, policy: str) -> list[str]:
        """The encoder tenants served here whose adapter was trained on features read with another
        miss policy than ``policy`` (their fine-tune records it in ``metrics.miss_policy``; tenants
        trained before it did, and uploaded adapters, are not known): their answers may differ from
        the accuracy their fine-tune measured until an update trains them again."""
        return sorted(name for name, rec in self.registry.items("tenants")
                      if rec.get("model") != "decoder" and not is_private(rec) and not self.served.is_foreign(name)
                      and not rec.get("spec", {}).get("whole")  # served on the full root: no PLOT read
                      and (rec.get("metrics") or {}).get("miss_policy", policy) != policy)

    # -- serving ---------------------------------------------------------------------------------
    async def resolve(self, tenant: str) -> TenantEntry:
        """The tenant's entry for a request, brought up to its registry record first on a shared
        home (the read is awaited: a registry kept by another process does not hold up the loop)."""
        if self.shared_home:
            self.apply_record(tenant, await self.registry.aget("tenants", tenant))
        return self.served.entry(tenant)

    async def record(self, tenant: str) -> dict:
        """The tenant's registry record; ``NOT_FOUND`` when there is none."""
        rec = await self.registry.aget("tenants", tenant)
        if rec is None:
            raise Refusal(Kind.NOT_FOUND, "unknown_tenant", f"no tenant {tenant!r}")
        return rec

    def set_weight(self, tenant: str, weight: float) -> dict:
        """Records and applies a tenant's weight (the admin's); ``NOT_FOUND`` when there is no such tenant."""
        rec = self.registry.update("tenants", tenant, weight=weight)
        if rec is None:
            raise Refusal(Kind.NOT_FOUND, "unknown_tenant", f"no tenant {tenant!r}")
        self.served.set_weight(tenant, weight)
        return rec

    def apply_record(self, name: str, rec: dict | None) -> None:
        """Brings this process's view of a tenant up to its registry record ``rec`` (None: there is
        none), which another process sharing the home may have changed: a tenant created,
        retrained, re-uploaded (or deleted and created again under its name) there is served here
        in its published version, its cached copies dropped; a deleted one is dropped."""
        if rec is None:
            self._synced.pop(name, None)
            if self.served.drop(name):
                self.scheduler.forget(name)
            return
        if rec.get("model") != "decoder" and (other := self._trained_elsewhere(name, rec)):
            self.served.foreign(name, other)
            return
        self.served.foreign(name, None)
        published = rec["state"] in ("ready", "updating") or (rec["state"] == "importing" and rec.get("import_of") == "update")
        if not published:
            return
        self.auth.remember(name, rec.get("token_hash", ""))
        if is_private(rec):
            return
        seen = (rec.get("created"), rec.get("version", 0))
        if self._synced.get(name) != seen:
            self._synced[name] = seen
            self.serve_new_version(name, rec)
        else:
            self.served.set_weight(name, rec.get("weight", 1.0))

    def serve_new_version(self, name: str, rec: dict) -> None:
        """Drops every cached copy of a tenant whose published version changed, and serves it."""
        self.store.invalidate(name)
        if rec.get("model") == "decoder":
            self.decoders.forget(name)
        else:
            self.scheduler.forget(name)
        self.served.serve(name, rec)

    def is_foreign(self, job: dict) -> bool:
        """Whether a job belongs to a tenant trained on another root (a server of that root runs it)."""
        return self.served.is_foreign(job.get("tenant"))

    def _trained_elsewhere(self, name: str, rec: dict) -> str | None:
        """Where an encoder tenant was trained when that is not this server's root and split (for
        people: the root's fingerprint and the split), else None.  Records from before roots were
        recorded belong to the default root, the only one then; records from before splits were
        recorded were trained at the split their stored adapter's layers give."""
        if "root" not in rec:
            if not self.default_root:
                return "the default root"
        elif rec["root"] != self.served.root_fingerprint:
            return f"another root (fingerprint {rec['root'][:12]})"
        l_low = rec.get("l_low")
        if l_low is None and not is_private(rec):
            l_low = self._split_of_stored(name, rec)
        if l_low is not None and l_low != self.served.l_low:
            return f"this root (fingerprint {self.served.root_fingerprint[:12]}) split {self.served.split(l_low)}"
        return None

    def _split_of_stored(self, name: str, rec: dict) -> int | None:
        """The split a tenant's stored adapter was trained at (from its layers; None while it has none)."""
        key = (name, rec.get("created"), rec.get("version", 0))
        if key not in self._stored_split:
            upper = self.store.adapter_layers(name)
            if upper is None:
                return None  # nothing stored yet: asked again once there is
            self._stored_split[key] = self.served.layers - upper
        return self._stored_split[key]

    # -- life cycle ------------------------------------------------------------------------------
    def create(self, name: str, rec: dict, data: dict, **job) -> tuple[str, str]:
        """Registers a new tenant and queues its first fine-tune job; returns (token, job id).
        Refuses (``BUSY``) when the job queue is full, (``CONFLICT``) when the name is taken."""
        self.jobs.require_room()
        jid = new_job_id()
        token = self.register(name, {**rec, "state": "training", "job": jid})
        try:
            self.jobs.submit("create", name, rec["spec"], data, job_id=jid, **job)
        except BaseException:  # not queued (a full disk, a full queue): the name stays free
            self._undo(lambda: self.delete(name, self.registry.get("tenants", name) or {}), f"registering {name!r}")
            raise
        return token, jid

    def register(self, name: str, rec: dict) -> str:
        """Creates a tenant's record (version 0) with a new token, which it returns (shown once);
        409 when the name is taken."""
        token, digest = self.auth.issue()
        rec = {**rec, "token_hash": digest, "version": 0}
        if rec.get("model") != "decoder":
            rec["root"], rec["l_low"] = self.served.root_fingerprint, self.served.l_low
        if not self.registry.create("tenants", name, rec):
            raise Refusal(Kind.CONFLICT, "tenant_exists", f"tenant {name!r} already exists")
        self.auth.remember(name, digest)
        return token

    def create_private(self, name: str) -> str:
        """Registers a private tenant (ready at once, nothing to train here); returns its token."""
        return self.register(name, {"state": "ready", "model": "private", "domain": "root", "job": None})

    def update(self, name: str, data: dict, **job) -> str:
        """Queues a further fine-tune job of a ready tenant: one at a time per tenant (409 while
        one is queued or running), checked and claimed in one registry transaction."""
        if self.served.is_foreign(name):
            raise Refusal(Kind.CONFLICT, "wrong_root", self.served.foreign_message(name))
        self.jobs.require_room()
        jid = new_job_id()
        before = (self.registry.get("tenants", name) or {}).get("job")
        rec = self.registry.update_if("tenants", name, ("ready",), state="updating", job=jid)
        if rec is None:
            state = (self.registry.get("tenants", name) or {}).get("state", "deleted")
            raise Refusal(Kind.CONFLICT, "tenant_busy", f"tenant {name!r} is {state}; update it once it is ready")
        try:
            self.jobs.submit("update", name, rec["spec"], data, job_id=jid, **job)
        except BaseException:  # not queued: the tenant is ready again, serving what it served
            self._undo(lambda: self.registry.claim("tenants", name, {"job": jid, "state": "updating"}, state="ready",
                                                   job=before), f"claiming {name!r} for an update")
            raise
        return jid

    @staticmethod
    def _undo(fn, what: str) -> None:
        """Takes back a registry change whose job could not be queued; when that fails too (the
        disk still full), the next start's recovery does it."""
        try:
            fn()
        except Exception:  # noqa: BLE001 - logged; the original error is the one the client hears
            log.exception("taking back %s failed", what)

    def delete(self, tenant: str, rec: dict) -> None:
        """Stops serving the tenant at once, cancels its job, forgets its record, token, usage,
        resident copies and stored adapter."""
        self.served.drop(tenant)
        self.decoders.forget(tenant)
        if rec.get("job"):
            self.jobs.cancel(rec["job"])
        self.registry.delete("tenants", tenant)
        self.auth.forget(rec.get("token_hash", ""))
        self.usage.forget(tenant)
        self.scheduler.forget(tenant)
        try:
            self.store.delete(tenant)
        except TenantMissingError:
            pass

    def job_finished(self, job: dict, state: str, info: dict) -> None:
        """Publishes what a tenant's job produced (``succeeded``) or discards it; a tenant deleted
        (and maybe re-created) while its job ran never serves that job's weights."""
        t = job["tenant"]
        rec = self.registry.get("tenants", t)
        if rec is None or rec.get("job") != job["id"]:
            self.store.discard(t, job["id"])
            return
        if state == "succeeded":
            self.store.publish(t, job["id"])
            spec = rec.get("spec") if rec.get("model") == "decoder" else self.store.spec(t).to_dict()  # whole or not
            rec = self.registry.update("tenants", t, state="ready", version=rec.get("version", 0) + 1,
                                       metrics=info, error=None, spec=spec)
            self.serve_new_version(t, rec)
            return
        self.store.discard(t, job["id"])
        if job["kind"] == "create":
            self.registry.update("tenants", t, state="failed", error=info.get("error") or state)
        else:
            self.registry.update("tenants", t, state="ready")

    def recover_import(self, name: str, rec: dict) -> dict:
        """An upload a crash interrupted: a new tenant fails; an existing one serves whatever
        version its store's pointer names, under that version's spec."""
        if rec.get("import_of") == "new":
            return self.registry.update("tenants", name, state="failed", error="the upload was interrupted by a restart")
        try:
            spec = self.store.spec(name).to_dict()
        except TenantMissingError:
            spec = rec["spec"]
        return self.registry.update("tenants", name, state="ready", spec=spec, import_of=None)
