"""Hostile input and fault injection through real HTTP: protocol edge cases, racing updates, a full
job queue, a failing job thread, job time limits, 1,000 concurrent clients, and workers that die
with a killed server."""

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from hmi.dispatcher.gate import free_port
from hmi.dispatcher.schemas import models_of
from tests.helpers.servers import ADMIN, LONG_JOB, TRAIN, raw  # noqa: F401 - fixture

LABELS = {"type": "classification", "labels": ["neg", "pos"]}


def send_raw(url: str, method: str, path: str, headers: dict, body: bytes = b"") -> tuple[int, dict]:
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest(method, path)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"{}")
    conn.close()
    return out


def test_completions_authenticates_before_reading_the_body(live):
    deep = b"[" * 200_000
    for body in (deep, b"{not json", json.dumps({"model": "alpha", "prompt": "x"}).encode()):
        status, _, payload = send_raw(live["url"], "POST", "/v1/completions", {"Content-Type": "application/json"}, body)
        assert status == 401 and payload["error"]["code"] == "unauthorized"


def test_deeply_nested_json_is_a_400_not_a_500(live):
    status, _, payload = send_raw(live["url"], "POST", "/v1/tenants/alpha/infer",
                                  {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}, b"[" * 200_000)
    assert status == 400 and payload["error"]["code"] == "malformed_json"


def test_a_non_utf8_authorization_header_is_a_401(live):
    status, _, payload = send_raw(live["url"], "GET", "/v1/tenants", {"Authorization": b"Bearer \xff\xfe\x80"})
    assert status == 401 and payload["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("path, body", [
    ("/v1/tenants", {"name": "trailing\n", "task": LABELS, "training_data": {"train": TRAIN}}),
    ("/v1/domains", {"name": "trailing\n", "corpus_name": "legal"}),
])
def test_names_with_a_trailing_newline_are_refused(live, path, body):
    status, payload = raw(live["url"], "POST", path, body)
    assert status == 400 and payload["error"]["code"] == "invalid_name", payload


@pytest.mark.parametrize("body, code", [
    ({"name": "d1", "corpus_name": "legal", "max_lines": "many"}, "invalid_type"),
    ({"name": "d1", "corpus_name": "legal", "max_lines": 0}, "invalid_value"),
    ({"name": "d1", "corpus_name": "legal", "objective": "magic"}, "invalid_value"),
    ({"name": "d1", "corpus_name": "legal", "steps": 0}, "invalid_value"),
])
def test_domain_fields_are_validated(live, body, code):
    status, payload = raw(live["url"], "POST", "/v1/domains", body)
    assert status == 400 and payload["error"]["code"] == code, payload


@pytest.mark.parametrize("labels, code", [([["a"], "b"], "invalid_type"), ([1, 2], "invalid_type"),
                                          ([f"l{i}" for i in range(33)], "too_many_labels")])
def test_labels_must_be_a_short_enough_list_of_strings(live, labels, code):
    status, payload = raw(live["url"], "POST", "/v1/tenants", {"name": "n1", "task": {"type": "classification", "labels": labels},
                                                              "training_data": {"train": TRAIN}})
    assert status == 400 and payload["error"]["code"] == code, payload


def test_405_names_the_allowed_methods(live):
    status, headers, payload = send_raw(live["url"], "PUT", "/v1/tenants", {"Authorization": f"Bearer {ADMIN}"})
    assert status == 405 and payload["error"]["code"] == "method_not_allowed"
    assert set(headers["Allow"].replace(" ", "").split(",")) == {"GET", "POST"}


def test_only_one_update_per_tenant_at_a_time(live):
    results = []

    def update():
        results.append(raw(live["url"], "POST", "/v1/tenants/alpha/update", {"training_data": {"train": TRAIN}, "epochs": 1}))

    threads = [threading.Thread(target=update) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _ in results)
    assert statuses.count(202) == 1 and statuses.count(409) == 5, results
    job = next(p["job"] for s, p in results if s == 202)
    assert live["admin"].wait_job(job, 300)["state"] == "succeeded"


def test_a_full_job_queue_answers_429_and_creates_nothing(live, monkeypatch):
    monkeypatch.setattr(live["server"].jobs, "max_queued", 0)
    status, payload = raw(live["url"], "POST", "/v1/tenants", {"name": "queued-out", "task": LABELS, "training_data": {"train": TRAIN}})
    assert status == 429 and payload["error"]["code"] == "too_many_jobs"
    assert raw(live["url"], "GET", "/v1/tenants/queued-out")[0] == 404


def test_the_job_thread_survives_an_error_and_jobs_have_a_time_limit(live, monkeypatch):
    s, admin = live["server"], live["admin"]
    real = s.jobs.on_finish
    calls = []

    def failing(job, state, info):
        calls.append(job["id"])
        if len(calls) == 1:
            raise RuntimeError("injected failure while recording the job")
        return real(job, state, info)

    monkeypatch.setattr(s.jobs, "on_finish", failing)
    first = admin.create_tenant("jt1", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
    admin.wait_job(first["job"], 300)
    second = admin.create_tenant("jt2", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
    assert admin.wait_job(second["job"], 300)["state"] == "succeeded"  # the thread went on
    assert admin.infer("jt2", ["great"])[0]["label"] in ("neg", "pos")
    monkeypatch.setattr(s.jobs, "time_limit_s", 0.5)
    slow = admin.create_tenant("jt3", ["neg", "pos"], **LONG_JOB)
    job = admin.wait_job(slow["job"], 120)
    assert job["state"] == "failed" and "time limit" in job["error"]
    assert admin.tenant("jt3")["state"] == "failed"
    for t in ("jt1", "jt2", "jt3"):
        admin.delete_tenant(t)


def test_a_job_is_recorded_succeeded_only_once_its_tenant_is_served(live, monkeypatch):
    s, admin = live["server"], live["admin"]
    real, seen = s.jobs.on_finish, []

    def watching(job, state, info):
        seen.append(s.registry.get("jobs", job["id"])["state"])
        real(job, state, info)
        seen.append(s.registry.get("jobs", job["id"])["state"])

    monkeypatch.setattr(s.jobs, "on_finish", watching)
    out = admin.create_tenant("in-order", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
    assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    assert seen == ["running", "running"]  # the tenant was published before the job said so
    assert admin.tenant("in-order")["state"] == "ready"
    admin.delete_tenant("in-order")


def test_a_job_whose_result_cannot_be_published_fails_with_its_tenant(live, monkeypatch):
    s, admin = live["server"], live["admin"]

    def gone(tenant, version):  # what a version removed under the job looks like when published
        from hmi.adapters.store import TenantMissingError
        raise TenantMissingError(tenant)

    monkeypatch.setattr(s.store, "publish", gone)
    out = admin.create_tenant("unpublished", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
    job = admin.wait_job(out["job"], 300)
    assert job["state"] == "failed" and "publishing its result failed" in job["error"], job
    assert admin.tenant("unpublished")["state"] == "failed"
    admin.delete_tenant("unpublished")


def test_a_finished_job_whose_tenant_was_deleted_and_re_created_is_never_served(live):
    s = live["server"]
    from hmi.adapters.spec import AdapterSpec

    spec = AdapterSpec(labels=("neg", "pos"))
    weights = s.store.load("alpha")
    s.store.save("reborn", spec, weights, version="newjob")
    s.registry.create("tenants", "reborn", {"state": "ready", "spec": spec.to_dict(), "job": "newjob", "token_hash": "x"})
    s.store.save("reborn", spec, {k: v * 0 for k, v in weights.items()}, version="oldjob", publish=False)
    s._job_finished({"id": "oldjob", "kind": "create", "tenant": "reborn"}, "succeeded", {})
    assert s.store.current("reborn").name == "newjob"
    assert not (s.store.path("reborn") / "oldjob").exists()
    s.registry.delete("tenants", "reborn")
    s.store.delete("reborn")


@pytest.fixture
def small_server(live, tmp_path):
    """A server with room for 4 waiting batches, serving a copy of tenant alpha."""
    from hmi.adapters.store import AdapterStore
    from hmi.dispatcher.serve import run_in_thread
    from hmi.services.registry import Registry
    from tests.helpers.servers import tiny_server

    src = live["server"]
    AdapterStore(tmp_path / "tenants").save("alpha", src.store.spec("alpha"), src.store.load("alpha"))
    reg = Registry(tmp_path / "registry")
    reg.create("tenants", "alpha", {**src.registry.get("tenants", "alpha"), "state": "ready"})
    reg.close()
    server = tiny_server(tmp_path, max_pending=4, max_batch=8)
    url, stop = run_in_thread(server)
    yield {"url": url, "server": server}
    stop()


def test_a_thousand_concurrent_clients_get_answers_or_429_and_health_keeps_answering(small_server):
    import aiohttp

    live = small_server

    async def burst():
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def one(i):
                async with session.post(f"{live['url']}/v1/tenants/alpha/infer", json={"inputs": [f"a great film {i}"]},
                                        headers=headers) as r:
                    return r.status, r.headers.get("Retry-After"), (await r.json())

            health = []

            async def probe():
                while len(health) < 20:
                    async with session.get(f"{live['url']}/healthz") as r:
                        health.append(r.status)
                    await asyncio.sleep(0.05)

            results, _ = await asyncio.gather(asyncio.gather(*(one(i) for i in range(1000))), probe())
            return results, health

    results, health = asyncio.run(burst())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert statuses.count(200) > 0 and statuses.count(429) > 0
    assert all(ra == "1" for s, ra, _ in results if s == 429)
    assert all(p["error"]["code"] in ("overloaded", "over_share") for s, _, p in results if s == 429)
    assert health == [200] * 20


SERVE_TINY = """
import os, sys
from pathlib import Path
from aiohttp import web
from hmi.dispatcher.app import make_app
from tests.helpers.servers import tiny_server
server = tiny_server(Path(sys.argv[1]))
web.run_app(make_app(server), host="127.0.0.1", port=int(sys.argv[2]), print=lambda *a: print("READY", flush=True))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_workers_die_with_a_killed_server_and_write_nothing(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HMI_ADMIN_TOKEN": ADMIN, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen([sys.executable, "-c", SERVE_TINY, str(tmp_path), str(port)], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "READY" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        status, out = raw(url, "POST", "/v1/tenants", {"name": "orphan", "task": LABELS, **LONG_JOB})
        assert status == 202
        deadline, pid = time.time() + 120, None
        while time.time() < deadline and pid is None:
            job = raw(url, "GET", f"/v1/jobs/{out['job']}")[1]
            pid = job.get("worker_pid") if job.get("progress", 0) > 0 else None
            time.sleep(0.2)
        assert pid and _alive(pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.time() + 30
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the worker outlived the killed server"
    time.sleep(1.0)
    tenant_dir = tmp_path / "tenants" / "orphan"
    assert not tenant_dir.exists() or not any(tenant_dir.iterdir())


def test_the_document_and_the_validator_agree_on_blank_texts(live):
    """U+0085 and U+00A0 are white space to some regex engines and not to others: both sides read
    "blank" as ASCII white space only."""
    import re

    from hmi.dispatcher.schemas import NON_BLANK

    model = models_of(live["server"])["InferBody"]
    for text, ok in (("\u0085", True), ("\u00a0x", True), (" \t\n", False), ("", False)):
        assert bool(re.search(NON_BLANK, text)) == ok
        status, payload = raw(live["url"], "POST", "/v1/tenants/alpha/infer", {"inputs": [text]})
        assert (status == 200) == ok, payload
    assert model.model_json_schema()["properties"]["inputs"]["items"]["pattern"] == NON_BLANK


def test_a_registry_that_cannot_be_reached_answers_503_with_retry_after(live, monkeypatch):
    """A registry kept by another process (the registry actor of ``hmi serve --ray``) that is
    restarting: the request gets a 503 that says so and when to try again, not a 500."""
    import urllib.request

    from hmi.services.registry import RegistryUnavailable

    def down(*args, **kwargs):
        raise RegistryUnavailable("the registry actor is unavailable (get): restarting")

    monkeypatch.setattr(live["server"].registry, "get", down)
    req = urllib.request.Request(live["url"] + "/v1/tenants/anyone", headers={"Authorization": f"Bearer {ADMIN}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    body = json.loads(e.value.read())
    assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
    assert body["error"]["code"] == "registry_unavailable" and "try again" in body["error"]["message"], body


def _infer(url: str, tenant: str, texts: list[str]) -> tuple[int, dict, dict]:
    return send_raw(url, "POST", f"/v1/tenants/{tenant}/infer",
                    {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"},
                    json.dumps({"inputs": texts}).encode())


def _refused_by_gate(headers: dict) -> bool:
    from hmi.dispatcher.gate import REFUSED_BY

    return {k.lower(): v for k, v in headers.items()}.get(REFUSED_BY.lower()) == "gate"


def test_a_tenant_refused_over_its_share_again_and_again_is_then_held_to_its_fair_rate_by_the_gate_until_it_stops(live):
    from hmi.dispatcher.gate import MARK_AFTER, Gate, haproxy_binary

    if haproxy_binary() is None:
        pytest.skip("no haproxy here (the ray extra ships one)")
    server, hold, rate = live["server"], 3.0, 2
    gate = Gate.start("127.0.0.1", free_port(), live["url"].rsplit("//", 1)[1], hold_s=hold)
    server.gate, queue = gate, server.batcher.tenant_queue
    server.batcher.fair_rate = lambda tenant: float(rate)  # its share of the answered rate (tests/scheduler/test_batcher.py)
    try:
        assert _infer(gate.url, "alpha", ["through the gate"])[0] == 200
        server.batcher.tenant_queue = 1  # two texts at once are more than alpha's queue holds
        for _ in range(MARK_AFTER - 1):  # a few refusals are the server's alone
            status, headers, body = _infer(gate.url, "alpha", ["one", "two"])
            assert status == 429 and body["error"]["code"] == "over_share" and not _refused_by_gate(headers)
        assert _infer(gate.url, "alpha", ["one"])[0] == 200  # not gated yet
        assert _infer(gate.url, "alpha", ["one", "two"])[0] == 429  # the MARK_AFTER-th within the hold
        marked, deadline, refused = time.monotonic(), time.monotonic() + 2.0, None
        while time.monotonic() < deadline:  # the mark reaches HAProxy over its admin socket
            status, headers, body = _infer(gate.url, "alpha", ["one"])
            if _refused_by_gate(headers):
                refused = time.monotonic()
                break
        assert refused is not None and status == 429 and body["error"]["code"] == "over_share"
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        assert _infer(gate.url, "beta", ["the others pass"])[0] == 200
        # Sent on past its rate for longer than a hold: still held, at its rate, not shut out.
        codes, last_refusal, until = [], None, time.monotonic() + hold + 1.5
        while time.monotonic() < until:
            status, headers, _ = _infer(gate.url, "alpha", ["one"])
            codes.append(200 if status == 200 else "gate" if _refused_by_gate(headers) else status)
            last_refusal = time.monotonic() if codes[-1] == "gate" else last_refusal
        assert set(codes) == {200, "gate"}, codes
        assert last_refusal - marked > hold + 0.5  # each refusal renewed the mark
        assert rate * (hold + 1.5 - 1) <= codes.count(200) <= rate * (hold + 1.5 + 2), codes
        time.sleep(hold + 0.2)  # it stops: the mark ends one hold later
        assert _infer(gate.url, "alpha", ["the hold is over"])[0] == 200
    finally:
        del server.batcher.fair_rate
        server.batcher.tenant_queue, server.gate = queue, None
        gate.close()
    assert not gate.workdir.exists() and gate.proc.poll() is not None


def test_a_gate_that_cannot_bind_its_port_says_why():
    import socket

    from hmi.dispatcher.gate import Gate, GateError, haproxy_binary

    if haproxy_binary() is None:
        pytest.skip("no haproxy here (the ray extra ships one)")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(GateError, match="did not start"):
            Gate.start("127.0.0.1", port, "127.0.0.1:9", timeout_s=5)



GATE_UNDER_LIMIT = """
import json, sys, urllib.request
from hmi.dispatcher.gate import Gate, max_connections
gate = Gate.start("127.0.0.1", int(sys.argv[2]), sys.argv[1])
try:
    req = urllib.request.Request(gate.url + "/v1/tenants/alpha/infer", json.dumps({"inputs": ["through"]}).encode(),
                                 {"Content-Type": "application/json", "Authorization": "Bearer " + sys.argv[3]})
    print(max_connections(), urllib.request.urlopen(req, timeout=60).status)
finally:
    gate.close()
"""


def test_a_gate_under_a_low_open_files_limit_still_starts_and_forwards(live):
    import resource

    from hmi.dispatcher.gate import haproxy_binary

    if haproxy_binary() is None:
        pytest.skip("no haproxy here (the ray extra ships one)")

    def low_limit():  # 1,024 open files, as many hosts have by default: HAProxy inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    out = subprocess.run([sys.executable, "-c", GATE_UNDER_LIMIT, live["url"].rsplit("//", 1)[1], str(free_port()), ADMIN],
                         preexec_fn=low_limit, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["462", "200"]  # (1,024 - 100) / 2 connections at most, and it forwards
