"""A tenant belongs to the root it was trained on: another root's server keeps its record but
neither serves nor retrains it, and says why."""

import json

import pytest

from hmi.adapters.spec import AdapterSpec
from hmi.errors import Kind, Refusal
from hmi.services.registry import Registry
from tests.helpers.servers import ADMIN, TRAIN, tiny_server, train_once


def test_tenant_of_another_root_is_refused_with_409_naming_both_roots(tmp_path):
    rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
    first = tiny_server(tmp_path)
    first.tenants.register("alpha", rec)
    fingerprint = first.served.root_fingerprint
    first.shutdown()

    same = tiny_server(tmp_path)
    assert same.served.entry("alpha").name == "alpha"
    same.shutdown()

    other = tiny_server(tmp_path, seed=1)
    try:
        assert other.served.root_fingerprint != fingerprint
        with pytest.raises(Refusal) as e:
            other.served.entry("alpha")
        assert e.value.kind == Kind.CONFLICT and e.value.code == "wrong_root"
        assert fingerprint[:12] in str(e.value) and other.served.root_fingerprint[:12] in str(e.value)
        with pytest.raises(Refusal) as e:
            other.tenants.update("alpha", {"train": []})
        assert e.value.kind == Kind.CONFLICT
    finally:
        other.shutdown()


def refusal(home, tenant, **server) -> Refusal:
    """What a server on ``home`` (``tiny_server``'s options) answers for ``tenant``: a refusal."""
    s = tiny_server(home, **server)
    try:
        with pytest.raises(Refusal) as e:
            s.served.entry(tenant)
        return e.value
    finally:
        s.shutdown()


def serves(home, tenant, **server) -> bool:
    s = tiny_server(home, **server)
    try:
        return s.served.entry(tenant).name == tenant
    finally:
        s.shutdown()


def test_tenant_trained_at_another_split_of_the_same_root_is_refused_with_409_naming_both_splits(tmp_path):
    """Its adapter has weights for the upper layers of its own split: on a server of a higher split
    it would be served in part and answer wrongly, on a lower one it would miss layers."""
    rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
    first = tiny_server(tmp_path, l_low=2)
    first.tenants.register("alpha", rec)
    first.shutdown()
    for l_low in (1, 3):
        e = refusal(tmp_path, "alpha", l_low=l_low)
        assert e.kind == Kind.CONFLICT and e.code == "wrong_root"
        assert "split 2+2" in str(e) and f"split {l_low}+{4 - l_low}" in str(e)
    assert serves(tmp_path, "alpha", l_low=2)


def test_tenants_recorded_before_splits_were_belong_to_the_split_of_their_stored_adapter(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    train_once(tmp_path, "alpha")  # split 2+2: an adapter of two upper layers
    reg = Registry(tmp_path / "registry")
    reg.put("tenants", "alpha", {k: v for k, v in reg.get("tenants", "alpha").items() if k != "l_low"})
    reg.close()
    e = refusal(tmp_path, "alpha", l_low=3)
    assert e.code == "wrong_root" and "split 2+2" in str(e)
    assert serves(tmp_path, "alpha", l_low=2)


def test_tenants_recorded_before_roots_were_belong_to_the_default_root(tmp_path):
    rec = {"domain": "root", "spec": AdapterSpec(labels=("neg", "pos")).to_dict(), "state": "ready"}
    server = tiny_server(tmp_path)
    server.tenants.register("old", rec)
    record = {k: v for k, v in server.registry.get("tenants", "old").items() if k != "root"}
    server.registry.put("tenants", "old", record)  # as written before roots were recorded
    server.shutdown()
    default = tiny_server(tmp_path)
    try:
        assert default.served.entry("old").name == "old"
    finally:
        default.shutdown()
    other = tiny_server(tmp_path, source="mpnet-base")  # a server of another root, same weights
    try:
        with pytest.raises(Refusal) as e:
            other.served.entry("old")
        assert e.value.code == "wrong_root"
    finally:
        other.shutdown()


def test_a_job_of_another_roots_tenant_is_left_to_a_server_of_that_root(tmp_path, monkeypatch):
    """A stopped server's unfinished job of a tenant trained on root A: a server of root B neither
    runs it (it would train the tenant on B) nor fails it; the next server of root A runs it again."""
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    first = tiny_server(tmp_path)
    fingerprint = first.served.root_fingerprint
    first.shutdown()
    spec = AdapterSpec(labels=("neg", "pos")).to_dict()

    reg = Registry(tmp_path / "registry")
    reg.create("tenants", "alpha", {"state": "training", "spec": spec, "token_hash": "alpha", "job": "j-alpha",
                                    "root": fingerprint, "domain": "root"})
    job = {"id": "j-alpha", "kind": "create", "tenant": "alpha", "spec": spec, "state": "running", "attempt": 1,
           "inputs_kept": True, "owner": "gone-host:1", "epochs": 1}
    reg.create("jobs", "j-alpha", job)
    (tmp_path / "jobs").mkdir(exist_ok=True)
    (tmp_path / "jobs" / "j-alpha.json").write_text(json.dumps({"train": TRAIN}))
    reg.close()

    other = tiny_server(tmp_path, seed=1)
    try:
        assert other.resumed == [] and other.recovered == []
        kept = other.registry.get("jobs", "j-alpha")
        assert {k: kept[k] for k in job} == job  # neither claimed nor failed
        assert other.registry.get("tenants", "alpha")["state"] == "training"
    finally:
        other.shutdown()
    assert (tmp_path / "jobs" / "j-alpha.json").is_file()

    same = tiny_server(tmp_path)
    try:
        assert same.resumed == ["j-alpha"]
    finally:
        same.shutdown()
