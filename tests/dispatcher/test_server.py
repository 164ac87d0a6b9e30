"""The server through real HTTP on localhost, on a tiny root (real tokenizer, real LMDB, real jobs)."""

import json
import time
import urllib.request

import pytest

from hmi.client import ApiError, Client
from hmi.dispatcher.app import ROUTES
from hmi.dispatcher.openapi import ROUTE_DOCS
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import ADMIN, LONG_JOB, TRAIN, domain_corpus, raw, tiny_server


def test_domain_lifecycle_create_tenant_on_branch_update_delete(live):
    admin = live["admin"]
    job = admin.create_domain("legal", corpus=domain_corpus(), alpha=0.5, steps=3)["job"]
    done = admin.wait_job(job, 300)
    assert done["state"] == "succeeded", done
    assert done["metrics"]["fpt"]["objective"] == "distill" and done["metrics"]["plot"]["unigrams"] > 0
    names = [d["name"] for d in admin.domains()]
    assert names[:2] == ["root", "legal"]
    out = admin.create_tenant("lawyer", ["neg", "pos"], domain="legal", training_data={"train": TRAIN}, epochs=1)
    assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    assert admin.infer("lawyer", ["the license grants permission"])[0]["label"] in ("neg", "pos")
    updated = admin.wait_job(admin.update_domain("legal", corpus=domain_corpus(seed=3), steps=2, objective="mlm")["job"], 300)
    assert updated["state"] == "succeeded" and updated["metrics"]["fpt"]["objective"] == "mlm", updated
    assert admin.infer("lawyer", ["the license grants permission"])[0]["label"] in ("neg", "pos")
    with pytest.raises(ApiError) as e:
        admin.delete_domain("legal")
    assert e.value.status == 409 and e.value.code == "domain_in_use"
    admin.delete_tenant("lawyer")
    admin.delete_domain("legal")
    assert [d["name"] for d in admin.domains()] == ["root"]


def test_domain_corpus_can_be_uploaded_as_a_file(live):
    import uuid

    boundary = uuid.uuid4().hex
    text = "\n".join(domain_corpus(600, seed=7)).encode()
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nuploaded\r\n'.encode(),
             f'--{boundary}\r\nContent-Disposition: form-data; name="steps"\r\n\r\n2\r\n'.encode(),
             f'--{boundary}\r\nContent-Disposition: form-data; name="corpus"; filename="c.txt"\r\n'
             f'Content-Type: text/plain\r\n\r\n'.encode() + text + b"\r\n",
             f"--{boundary}--\r\n".encode()]
    req = urllib.request.Request(live["url"] + "/v1/domains", data=b"".join(parts), method="POST")
    req.add_header("Content-Type", f"multipart/form-data; boundary={boundary}")
    req.add_header("Authorization", f"Bearer {ADMIN}")
    with urllib.request.urlopen(req, timeout=60) as r:
        job = json.loads(r.read())["job"]
    assert live["admin"].wait_job(job, 300)["state"] == "succeeded"
    live["admin"].delete_domain("uploaded")


def test_lifecycle_create_infer_update_infer_delete(live):
    admin, alpha = live["admin"], live["alpha"]
    out = alpha.infer("alpha", ["a great story", "an awful film"])
    assert {o["label"] for o in out} <= {"neg", "pos"} and abs(sum(out[0]["scores"].values()) - 1) < 1e-4
    tag = live["beta"].infer("beta", ["the dog runs fast"])
    assert [t["token"] for t in tag[0]["tokens"]] == ["the", "dog", "runs", "fast"]
    job = alpha.update_tenant("alpha", training_data={"train": TRAIN}, epochs=1)["job"]
    done = alpha.wait_job(job, 300)
    assert done["state"] == "succeeded" and done["metrics"]["train"]["n"] == 8
    assert admin.tenant("alpha")["version"] == 2
    assert len(alpha.infer("alpha", ["great"])) == 1
    tmp = admin.create_tenant("gamma", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1, pooling="mean")
    assert admin.wait_job(tmp["job"], 300)["state"] == "succeeded"
    assert admin.tenant("gamma")["spec"]["pooling"] == "mean"
    admin.infer("gamma", ["x y"])
    admin.delete_tenant("gamma")
    with pytest.raises(ApiError) as e:
        admin.infer("gamma", ["x y"])
    assert e.value.status == 404
    assert not (live["home"] / "tenants" / "gamma").exists()


def test_auth_matrix(live):
    url = live["url"]
    alpha, beta, admin = live["alpha"], live["beta"], live["admin"]
    nobody, wrong = Client(url, ""), Client(url, "hmi_t_not-a-token")
    cases = [
        (lambda c: c.infer("alpha", ["x"]), {"admin": 200, "alpha": 200, "beta": 403, "nobody": 401, "wrong": 401}),
        (lambda c: c.tenants(), {"admin": 200, "alpha": 403, "beta": 403, "nobody": 401, "wrong": 401}),
        (lambda c: c.tenant("beta"), {"admin": 200, "alpha": 403, "beta": 200, "nobody": 401, "wrong": 401}),
        (lambda c: c.domains(), {"admin": 200, "alpha": 403, "beta": 403, "nobody": 401, "wrong": 401}),
        (lambda c: c.delete_tenant("beta"), {"alpha": 403, "nobody": 401, "wrong": 401}),
        (lambda c: c.create_tenant("zeta", ["a", "b"], training_data={"train": TRAIN}),
         {"alpha": 403, "beta": 403, "nobody": 401}),
    ]
    clients = {"admin": admin, "alpha": alpha, "beta": beta, "nobody": nobody, "wrong": wrong}
    for call, expect in cases:
        for who, status in expect.items():
            try:
                call(clients[who])
                got = 200
            except ApiError as exc:
                got = exc.status
            assert got == status, (who, status, got)


BAD = [  # (method, path, body, status, code)
    ("POST", "/v1/tenants/alpha/infer", b"{not json", 400, "malformed_json"),
    ("POST", "/v1/tenants/alpha/infer", b"", 400, "empty_body"),
    ("POST", "/v1/tenants/alpha/infer", [1, 2], 400, "invalid_body"),
    ("POST", "/v1/tenants/alpha/infer", {}, 400, "missing_field"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": "text"}, 400, "invalid_type"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": []}, 400, "empty_inputs"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": [""]}, 400, "empty_input"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": [3]}, 400, "invalid_type"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": ["x"] * 9}, 413, "too_many_inputs"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": ["x" * 2001]}, 413, "input_too_long"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": ["word " * 300]}, 413, "input_too_long"),
    ("POST", "/v1/tenants/alpha/infer", {"inputs": ["x"], "extra": 1}, 400, "unknown_field"),
    ("POST", "/v1/tenants/nobody/infer", {"inputs": ["x"]}, 404, "unknown_tenant"),
    ("POST", "/v1/tenants", {"task": {"type": "classification", "labels": ["a", "b"]}}, 400, "missing_field"),
    ("POST", "/v1/tenants", {"name": "Bad Name", "task": {"type": "classification", "labels": ["a", "b"]},
                             "training_data": {"train": TRAIN}}, 400, "invalid_name"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["a"]},
                             "training_data": {"train": TRAIN}}, 400, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "span", "labels": ["a", "b"]},
                             "training_data": {"train": TRAIN}}, 400, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["a", "b"]},
                             "adapter": {"kind": "prefix"}, "training_data": {"train": TRAIN}}, 400, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["a", "b"], "pooling": "max"},
                             "training_data": {"train": TRAIN}}, 400, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["a", "b"]},
                             "adapter": {"kind": "lora", "rank": "8"}, "training_data": {"train": TRAIN}}, 400, "invalid_type"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "adapter": {"kind": "lora", "targets": ["out"]}, "training_data": {"train": TRAIN}}, 400, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "adapter": {"kind": "lora", "targets": ["q", "q"]}, "training_data": {"train": TRAIN}}, 422, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "adapter": {"targets": ["q"]}, "training_data": {"train": TRAIN}}, 422, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "adapter": {"kind": "bottleneck", "rank": 8}, "training_data": {"train": TRAIN}}, 422, "invalid_spec"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]}}, 400, "missing_field"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "training_data": {"train": []}}, 400, "empty_training_data"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "xyz"]},
                             "training_data": {"train": TRAIN}}, 422, "labels_missing"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "training_data": {"train": [{"text": "", "label": "pos"}]}}, 400, "invalid_example"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "tagging", "labels": ["N", "V"]},
                             "training_data": {"train": [{"tokens": ["a"], "tags": []}]}}, 400, "invalid_example"),
    ("POST", "/v1/tenants", {"name": "n1", "domain": "nowhere", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "training_data": {"train": TRAIN}}, 404, "unknown_domain"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "dataset": "no-such-task"}, 400, "unknown_dataset"),
    ("POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "training_data": {"train": TRAIN}, "epochs": 0}, 400, "invalid_value"),
    ("POST", "/v1/tenants", {"name": "alpha", "task": {"type": "classification", "labels": ["neg", "pos"]},
                             "training_data": {"train": TRAIN}}, 409, "tenant_exists"),
    ("POST", "/v1/tenants", b"x" * (2 * 2**20), 413, "body_too_large"),
    ("POST", "/v1/tenants/nobody/update", {"training_data": {"train": TRAIN}}, 404, "unknown_tenant"),
    ("DELETE", "/v1/tenants/nobody", None, 404, "unknown_tenant"),
    ("GET", "/v1/jobs/nojob", None, 404, "unknown_job"),
    ("DELETE", "/v1/jobs/nojob", None, 404, "unknown_job"),
    ("GET", "/v1/domains/nowhere", None, 404, "unknown_domain"),
    ("POST", "/v1/domains", {"name": "d1", "corpus": ["too small"]}, 422, "corpus_too_small"),
    ("POST", "/v1/domains", {"name": "d1"}, 400, "missing_field"),
    ("POST", "/v1/domains", {"name": "Bad!", "corpus_name": "legal"}, 400, "invalid_name"),
    ("POST", "/v1/domains", {"name": "d1", "corpus_name": "legal", "alpha": 2}, 400, "invalid_value"),
    ("POST", "/v1/domains", {"name": "d1", "parent": "nowhere", "corpus_name": "legal"}, 404, "unknown_domain"),
    ("POST", "/v1/domains", {"name": "d1", "corpus_name": "klingon"}, 400, "unknown_corpus"),
    ("POST", "/v1/domains", {"name": "d1", "corpus": [1, 2]}, 400, "invalid_type"),
    ("POST", "/v1/domains/nowhere/update", {"corpus_name": "legal"}, 404, "unknown_domain"),
    ("DELETE", "/v1/domains/nowhere", None, 404, "unknown_domain"),
    ("GET", "/v1/nothing", None, 404, "not_found"),
    ("PUT", "/v1/tenants", {}, 405, "method_not_allowed"),
]


@pytest.mark.parametrize("method, path, body, status, code", BAD)
def test_bad_request_gets_4xx_json_error_naming_the_problem(live, method, path, body, status, code):
    got, payload = raw(live["url"], method, path, body)
    assert got == status and payload["error"]["code"] == code, payload
    assert payload["error"]["message"]


def test_wrong_content_type_is_415(live):
    got, payload = raw(live["url"], "POST", "/v1/tenants/alpha/infer", b"inputs=x", ctype="text/plain")
    assert got == 415 and payload["error"]["code"] == "unsupported_media_type"


def test_server_survives_bad_input_and_still_serves(live):
    for method, path, body, *_ in BAD:
        raw(live["url"], method, path, body)
    assert live["alpha"].infer("alpha", ["great"])[0]["label"] in ("neg", "pos")


def test_openapi_describes_every_route(live):
    got, doc = raw(live["url"], "GET", "/openapi.json", token=None)
    assert got == 200
    for method, path, _ in ROUTES:
        assert (method, path) in ROUTE_DOCS
        assert method.lower() in doc["paths"][path]
        assert doc["paths"][path][method.lower()]["summary"] != "undocumented"


def test_metrics_and_health(live):
    req = urllib.request.urlopen(live["url"] + "/metrics", timeout=30).read().decode()
    for name in ("hmi_http_requests_total", "hmi_batch_size", "hmi_plot_hits_total", "hmi_adapter_residency_total",
                 "hmi_jobs", "hmi_queue_depth"):
        assert name in req
    got, health = raw(live["url"], "GET", "/healthz", token=None)
    assert got == 200 and health["status"] == "ok" and health["upper_precision"] == "fp32"
    assert health["miss_policy"] == "compute"  # what the server resolved (tiny_server's; `auto` names none)


def test_cancel_a_running_job(live):
    admin = live["admin"]
    out = admin.create_tenant("slow", ["neg", "pos"], **LONG_JOB)
    deadline = time.time() + 120
    while admin.job(out["job"])["state"] == "queued" and time.time() < deadline:
        time.sleep(0.2)
    admin.cancel_job(out["job"])
    job = admin.wait_job(out["job"], 120)
    assert job["state"] == "cancelled"
    assert admin.tenant("slow")["state"] == "failed"
    with pytest.raises(ApiError) as e:
        admin.infer("slow", ["x"])
    assert e.value.status == 409
    admin.delete_tenant("slow")


def test_restart_serves_finished_tenants_and_fails_interrupted_jobs(live, tmp_path):
    import shutil

    home = tmp_path / "copy"
    shutil.copytree(live["home"], home, ignore=shutil.ignore_patterns("lock.mdb"))
    from hmi.services.registry import Registry

    reg = Registry(home / "registry")
    reg.create("tenants", "halfbuilt", {"state": "training", "spec": {"labels": ["a", "b"]}, "token_hash": "x"})
    reg.create("jobs", "crashed1", {"id": "crashed1", "kind": "create", "tenant": "halfbuilt", "state": "running"})
    reg.close()
    server = tiny_server(home)
    url, stop = run_in_thread(server)
    try:
        c = Client(url, ADMIN)
        assert c.infer("alpha", ["a great film"])[0]["label"] in ("neg", "pos")
        job = c.job("crashed1")
        assert job["state"] == "failed" and "stopped" in job["error"]
        assert c.tenant("halfbuilt")["state"] == "failed"
        with pytest.raises(ApiError) as e:
            c.infer("halfbuilt", ["x"])
        assert e.value.status == 409
    finally:
        stop()


def test_full_queue_answers_429_with_retry_after(live, monkeypatch):
    from hmi.scheduler.types import QueueFullError

    def full(batch):
        raise QueueFullError("too many batches waiting")

    monkeypatch.setattr(live["server"].batcher, "submit", full)
    req = urllib.request.Request(live["url"] + "/v1/tenants/alpha/infer", data=json.dumps({"inputs": ["x"]}).encode(),
                                 method="POST", headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
    assert json.loads(e.value.read())["error"]["code"] == "overloaded"


def test_domain_commands_work_against_a_server(live, capsys):
    from hmi.cli import main

    assert main(["domain", "list", "--url", live["url"], "--token", ADMIN]) == 0
    assert "root" in capsys.readouterr().out
    assert main(["tenant", "list", "--url", live["url"], "--token", ADMIN]) == 0
    assert "alpha" in capsys.readouterr().out


def test_a_tenant_over_its_queue_is_refused_alone_while_another_is_served(live, monkeypatch):
    import asyncio

    import aiohttp

    monkeypatch.setattr(live["server"].batcher, "tenant_queue", 4)

    async def burst():
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            async def one(tenant, i):
                async with session.post(f"{live['url']}/v1/tenants/{tenant}/infer", json={"inputs": [f"a film {i}"]}) as r:
                    return tenant, r.status, (await r.json())

            return await asyncio.gather(*(one("alpha", i) for i in range(60)), *(one("beta", i) for i in range(3)))

    results = asyncio.run(burst())
    alpha = [(s, b) for t, s, b in results if t == "alpha"]
    assert [s for t, s, _ in results if t == "beta"] == [200] * 3
    refused = [b for s, b in alpha if s == 429]
    assert refused and all(b["error"]["code"] == "over_share" for b in refused)
    assert any(s == 200 for s, _ in alpha)


def test_the_admin_sets_a_tenants_share_and_nobody_else_may(live):
    got, out = raw(live["url"], "POST", "/v1/tenants/alpha/share", {"weight": 2.5})
    assert (got, out["weight"]) == (200, 2.5)
    assert live["admin"].tenant("alpha")["weight"] == 2.5 and live["server"].served.weight("alpha") == 2.5
    assert raw(live["url"], "POST", "/v1/tenants/alpha/share", {"weight": 2}, token=live["alpha"].token)[0] == 403
    assert raw(live["url"], "POST", "/v1/tenants/alpha/share", {"weight": 0})[0] == 400
    assert raw(live["url"], "POST", "/v1/tenants/nobody/share", {"weight": 1})[0] == 404
    raw(live["url"], "POST", "/v1/tenants/alpha/share", {"weight": 1})
