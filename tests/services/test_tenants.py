"""The tenant life cycle of one serving process (``hmi.services.tenants.Tenants``) on a real
registry and adapter store."""

import pytest

from hmi.adapters.spec import AdapterSpec
from hmi.errors import Refusal
from tests.helpers.servers import tiny_server


def test_a_deleted_tenant_leaves_no_usage_token_or_entry_behind(tmp_path):
    server = tiny_server(tmp_path, job_concurrency=0)
    try:
        rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
        server.tenants.register("gone", rec)
        rec = server.registry.get("tenants", "gone")
        server.tenants.serve_new_version("gone", rec)
        server.usage.record("gone", 3, 0.02)
        assert server.served.entry("gone").name == "gone"
        assert server.usage.report("gone", rec)["requests"] == 3
        server.tenants.delete("gone", rec)
        with pytest.raises(Refusal):
            server.served.entry("gone")
        assert server.registry.get("tenants", "gone") is None
        assert server.usage.report("gone", rec)["requests"] == 0  # a tenant created again under the name starts at 0
        server.tenants.register("gone", {**rec, "state": "training"})  # the name is free again
    finally:
        server.shutdown()
