"""Bring your own adapter, or take yours away: a tenant's adapter uploaded into this server or
downloaded from it (the archives' formats are ``hmi.adapters.portable``'s)."""

from __future__ import annotations

from hmi.adapters.portable import RootShape
from hmi.adapters.spec import AdapterSpec
from hmi.errors import Kind, Refusal
from hmi.scheduler.types import TenantEntry


class AdapterTransfer:
    """Imports and exports tenants' adapters, checked against what this server's pools hold."""

    def __init__(self, root, registry, store, residency, tenants, decoders):
        self.root, self.registry, self.store, self.residency = root, registry, store, residency
        self.tenants, self.decoders = tenants, decoders

    def root_shape(self, model: str) -> RootShape:
        """What an adapter of an ``encoder`` or ``decoder`` tenant must fit on this server."""
        if model == "decoder":
            gpt = self.decoders.require()
            c = gpt.root.model.config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            return RootShape("llama", c.hidden_size, c.num_hidden_layers, gpt.root.l_low,
                             c.num_key_value_heads * head_dim, gpt.root.name)
        c = self.root.bert.config
        return RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, self.root.l_low, c.hidden_size,
                         self.root.spec.name)

    def pool_check(self, spec: AdapterSpec, weights: dict, model: str) -> None:
        """Raises ValueError unless the weights fill a device slot of this server (shapes, head width)."""
        if model == "decoder":
            self.decoders.require().engine.pool.check(weights, 0)
        else:
            self.residency.check(TenantEntry("upload", spec), weights)

    def import_adapter(self, name: str, model: str, spec: AdapterSpec, weights: dict, truncate: bool = False,
                       metrics: dict | None = None) -> str | None:
        """Serves an uploaded adapter: for a new tenant (returns its token, shown once) or as a new
        version of an existing tenant of the same kind (returns None).  The version is written
        before it is published, and the record says ``importing`` meanwhile: a crash leaves the
        old version served (or, for a new tenant, a failed record), never a mix.  A new tenant
        cuts long texts with ``truncate``; ``metrics`` are recorded (default: imported)."""
        try:
            self.pool_check(spec, weights, model)
        except ValueError as exc:
            raise Refusal(Kind.UNPROCESSABLE, "wrong_shape", f"the adapter does not fit this server: {exc}") from None
        rec = self.registry.get("tenants", name)
        if rec is None:
            token = self.tenants.register(name, {"state": "importing", "model": model, "domain": "root",
                                                 "spec": spec.to_dict(), "truncate": truncate, "job": None,
                                                 "import_of": "new"})
        else:
            token = None
            if rec.get("model", "encoder") != model:
                raise Refusal(Kind.UNPROCESSABLE, "wrong_tenant_kind", f"tenant {name!r} is an {rec.get('model', 'encoder')} tenant")
            if self.registry.update_if("tenants", name, ("ready",), state="importing", import_of="update") is None:
                raise Refusal(Kind.CONFLICT, "tenant_busy", f"tenant {name!r} is {rec['state']}; upload once it is ready")
        try:
            version = self.store.save(name, spec, weights, {"model": model, "imported": True}, publish=False)
            self.store.publish(name, version)
        except Exception:
            self.tenants.recover_import(name, self.registry.get("tenants", name))
            raise
        rec = self.registry.get("tenants", name)
        rec = self.registry.update("tenants", name, state="ready", spec=spec.to_dict(), version=rec.get("version", 0) + 1,
                                   metrics=metrics or {"imported": True}, error=None, import_of=None)
        self.tenants.serve_new_version(name, rec)
        return token

    def export_adapter(self, name: str, rec: dict) -> tuple[AdapterSpec, dict, str]:
        """(spec, canonical weights, model kind) of the published adapter of the tenant whose
        registry record is ``rec``; 409 while it has none."""
        if rec["state"] not in ("ready", "updating"):
            raise Refusal(Kind.CONFLICT, "tenant_not_ready", f"tenant {name!r} is {rec['state']}; it has no adapter to download yet")
        return AdapterSpec.from_dict(self.store.info(name)["spec"]), self.store.load(name), rec.get("model", "encoder")

    def load_decoder_tenant(self, name: str):
        """(AdapterSpec, weights) of a decoder tenant, for the generation engine."""
        return AdapterSpec.from_dict(self.store.info(name)["spec"]), self.store.load(name)
