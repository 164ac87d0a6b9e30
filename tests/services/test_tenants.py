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


def test_a_fine_tune_records_the_miss_policy_it_read_with_and_a_server_of_another_names_its_tenant(
        tmp_path, monkeypatch):
    """A tenant trained under one miss policy and served under another answers otherwise than its
    fine-tune measured: the job records the policy (``metrics.miss_policy``) and a server serving
    another one names the tenant (``hmi serve`` says so at start); one serving the same, or a
    tenant that records none (trained before the record was kept), is not named."""
    from tests.helpers.servers import ADMIN, train_once

    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    train_once(tmp_path, "alpha", miss_policy="compute")
    same = tiny_server(tmp_path, miss_policy="compute")
    try:
        assert same.registry.get("tenants", "alpha")["metrics"]["miss_policy"] == "compute"
        rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
        same.tenants.register("older", rec)  # no record of its policy
        assert same.tenants.trained_with_another_policy("compute") == []
    finally:
        same.shutdown()
    other = tiny_server(tmp_path, miss_policy="backoff")
    try:
        assert other.tenants.trained_with_another_policy(other.lookup.policy) == ["alpha"]
    finally:
        other.shutdown()
