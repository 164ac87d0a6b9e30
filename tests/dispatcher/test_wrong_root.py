"""A tenant belongs to the root it was trained on: another root's server keeps its record but
neither serves nor retrains it, and says why."""

import pytest

from hmi.adapters.spec import AdapterSpec
from hmi.dispatcher.validation import ApiError
from hmi.scheduler.types import RequestError
from tests.dispatcher.test_server import tiny_server


def test_tenant_of_another_root_is_refused_with_409_naming_both_roots(tmp_path):
    rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
    first = tiny_server(tmp_path)
    first._register("alpha", rec)
    fingerprint = first.root_fingerprint
    first.shutdown()

    same = tiny_server(tmp_path)
    assert same.resolve("alpha").name == "alpha"
    same.shutdown()

    other = tiny_server(tmp_path, seed=1)
    try:
        assert other.root_fingerprint != fingerprint
        with pytest.raises(RequestError) as e:
            other.resolve("alpha")
        assert e.value.status == 409 and e.value.code == "wrong_root"
        assert fingerprint[:12] in str(e.value) and other.root_fingerprint[:12] in str(e.value)
        with pytest.raises(ApiError) as e:
            other.update_tenant("alpha", {"train": []})
        assert e.value.status == 409
    finally:
        other.shutdown()


def test_tenants_recorded_before_roots_were_belong_to_the_default_root(tmp_path):
    from dataclasses import replace

    rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
    server = tiny_server(tmp_path)
    server._register("old", rec)
    record = {k: v for k, v in server.registry.get("tenants", "old").items() if k != "root"}
    server.registry.put("tenants", "old", record)  # as written before roots were recorded
    server.shutdown()
    default = tiny_server(tmp_path)
    try:
        assert default.resolve("old").name == "old"
        default.root.spec = replace(default.root.spec, source="mpnet-base")  # another root's server
        assert not default._own_root(record)
    finally:
        default.shutdown()
