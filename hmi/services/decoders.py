"""The decoder (hGPT) side of a server, present once ``hmi serve --hgpt`` enables it."""

from __future__ import annotations

from hmi.errors import Kind, Refusal


class Decoders:
    """Holds the hGPT runtime (``hmi.hgpt.runtime.HgptRuntime``) when the server
    serves decoder tenants, and answers for it when it does not."""

    def __init__(self):
        self.runtime = None

    def enable(self, runtime) -> None:
        self.runtime = runtime

    def require(self):
        """The hGPT runtime, or a 404 telling how to enable it."""
        if self.runtime is None:
            raise Refusal(Kind.NOT_FOUND, "hgpt_disabled", "this server does not serve decoder tenants (start it with --hgpt)")
        return self.runtime

    def forget(self, tenant: str) -> None:
        """Drops a decoder tenant's resident copy (a new version, or deleted)."""
        if self.runtime is not None:
            self.runtime.forget(tenant)

    def on_device(self, tenant: str) -> bool:
        return self.runtime is not None and self.runtime.engine.pool.slot_of(tenant) is not None

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.shutdown()
