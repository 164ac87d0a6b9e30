"""Nothing accepted is lost: a tenant job whose server stopped (killed, or shut down while it ran)
is run again from its kept inputs by the next server on the home, and its tenant is served; a
domain job continues from its distillation's last checkpoint; a job out of attempts, or whose
inputs were not kept, is failed with the reason."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from hmi.services.registry import Registry
from tests.helpers.jobs import wait_state  # noqa: F401
from tests.helpers.servers import ADMIN, TRAIN, domain_corpus, tiny_server

CHILD = """
import sys, time
from pathlib import Path
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import tiny_server
url, stop = run_in_thread(tiny_server(Path(sys.argv[1])))
print(url, flush=True)
time.sleep(3600)
"""


def test_a_job_whose_server_was_killed_runs_again_at_the_next_start_and_its_tenant_is_served(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        url = child.stdout.readline().strip()
        admin = Client(url, ADMIN)
        # no dev set, so no early stop: twelve epochs, seconds of running however fast the machine
        out = admin.create_tenant("survivor", ["neg", "pos"], training_data={"train": TRAIN * 100}, epochs=12)
        assert (tmp_path / "jobs" / f"{out['job']}.json").is_file()  # kept before the job was accepted
        wait_state(admin, out["job"], ("running",))
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
    server = tiny_server(tmp_path)
    assert server.resumed == [out["job"]] and server.recovered == []
    url, stop = run_in_thread(server)
    try:
        admin = Client(url, ADMIN)
        done = admin.wait_job(out["job"], 300)
        assert done["state"] == "succeeded" and done["attempt"] == 2, done
        assert Client(url, out["token"]).infer("survivor", ["a great film"])[0]["label"] in ("neg", "pos")
        assert admin.tenant("survivor")["state"] == "ready"
        assert not (tmp_path / "jobs" / f"{out['job']}.json").exists()
    finally:
        stop()


@pytest.mark.slow
def test_a_domain_job_whose_server_was_killed_continues_from_its_last_checkpoint_at_the_next_start(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    steps = 160
    try:
        url = child.stdout.readline().strip()
        admin = Client(url, ADMIN)
        job = admin.create_domain("legal", corpus=domain_corpus(), alpha=0.5, steps=steps)["job"]
        deadline = time.time() + 300
        while time.time() < deadline:  # past the first checkpoint (every 25 steps), well before the end
            got = admin.job(job)
            if got["state"] == "running" and got.get("progress", 0) >= 0.75 * 40 / steps:
                break
            time.sleep(0.1)
        assert got["state"] == "running" and got["progress"] < 0.75 * 0.5, got
        assert (tmp_path / "jobs" / f"{job}.ckpt").is_file()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
    server = tiny_server(tmp_path)
    assert server.resumed == [job] and server.recovered == []
    url, stop = run_in_thread(server)
    try:
        admin = Client(url, ADMIN)
        done = admin.wait_job(job, 600)
        assert done["state"] == "succeeded" and done["attempt"] == 2, done
        fpt = done["metrics"]["fpt"]
        assert fpt["steps"] == steps and fpt["resumed_at_step"] >= 25 and fpt["resumed_at_step"] % 25 == 0, fpt
        assert "legal" in [d["name"] for d in admin.domains()]
        assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == []  # inputs and checkpoint gone
    finally:
        stop()


def test_jobs_stopped_by_shutdowns_run_again_without_using_up_their_attempts(tmp_path, monkeypatch):
    """More shutdowns than ``max_attempts`` while a tenant trains (and another waits in the queue)
    fail neither: attempts count crashes, not an operator stopping the server."""
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path))
    admin = Client(url, ADMIN)
    out = admin.create_tenant("patient", ["neg", "pos"], training_data={"train": TRAIN * 100}, epochs=12)
    waiting = admin.create_tenant("queued", ["neg", "pos"], training_data={"train": TRAIN})
    wait_state(admin, out["job"], ("running",))
    stop()
    for restart in range(3):  # max_attempts is 3: each stop used to count one
        reg = Registry(tmp_path / "registry")
        for job in (out["job"], waiting["job"]):
            rec = reg.get("jobs", job)
            assert rec["attempt"] == 1, rec
            if rec["state"] != "succeeded" or job == out["job"]:  # the small job may have run in a restart
                assert rec["state"] in ("running", "queued"), rec  # not cancelled
        assert reg.get("tenants", "patient")["state"] == "training"
        reg.close()
        server = tiny_server(tmp_path)
        assert out["job"] in server.resumed and server.recovered == []
        url, stop = run_in_thread(server)
        if restart < 2:
            wait_state(Client(url, ADMIN), out["job"], ("running",))
            stop()
    try:
        admin = Client(url, ADMIN)
        for job, tenant in ((out, "patient"), (waiting, "queued")):
            done = admin.wait_job(job["job"], 300)
            assert done["state"] == "succeeded" and done["attempt"] == 1, done
            assert Client(url, job["token"]).infer(tenant, ["boring mess"])[0]["label"] in ("neg", "pos")
    finally:
        stop()


def test_a_job_out_of_attempts_or_without_kept_inputs_fails_and_its_tenant_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    reg = Registry(tmp_path / "registry")
    spec = {"kind": "bottleneck", "labels": ["neg", "pos"]}
    for name, attempt, kept in (("tired", 3, True), ("lost", 1, False), ("fresh", 1, True)):
        reg.create("tenants", name, {"state": "training", "spec": spec, "token_hash": name, "job": f"j-{name}"})
        reg.create("jobs", f"j-{name}", {"id": f"j-{name}", "kind": "create", "tenant": name, "spec": spec,
                                         "state": "running", "attempt": attempt, "inputs_kept": kept,
                                         "owner": "gone-host:1", "epochs": 1})
        if kept:
            (tmp_path / "jobs").mkdir(exist_ok=True)
            (tmp_path / "jobs" / f"j-{name}.json").write_text(json.dumps({"train": TRAIN}))
    (tmp_path / "jobs" / "j-finished-long-ago.json").write_text("{}")  # a job that ended: its inputs go,
    (tmp_path / "jobs" / "j-finished-long-ago.ckpt.plot").mkdir()  # and the PLOT its branch build left
    (tmp_path / "jobs" / "j-finished-long-ago.ckpt.plot" / "data.mdb").write_bytes(b"\0" * 4096)
    reg.close()
    server = tiny_server(tmp_path)
    url, stop = run_in_thread(server)
    try:
        assert sorted(server.recovered) == ["j-lost", "j-tired"] and server.resumed == ["j-fresh"]
        admin = Client(url, ADMIN)
        for name in ("tired", "lost"):
            assert admin.job(f"j-{name}")["state"] == "failed"
            assert admin.tenant(name)["state"] == "failed"
        assert admin.wait_job("j-fresh", 300)["state"] == "succeeded"
        assert admin.tenant("fresh")["state"] == "ready"
        assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == []
    finally:
        stop()


def test_a_dead_servers_job_is_claimed_by_exactly_one_of_two_recovering_servers(tmp_path):
    """Two processes see the same dead owner; the claim checks the owner is unchanged, so the second
    one's claim (made on the same stale read) is refused and it neither runs nor fails the job."""
    reg = Registry(tmp_path / "registry")
    reg.create("jobs", "j", {"state": "running", "owner": "gone:1", "attempt": 1, "kind": "create"})
    seen = {"state": "running", "owner": "gone:1"}
    first = reg.claim("jobs", "j", seen, state="queued", owner="a:1", attempt=2)
    second = reg.claim("jobs", "j", seen, state="queued", owner="b:2", attempt=2)
    assert first is not None and first["owner"] == "a:1" and second is None
    assert reg.recover(alive=lambda job: job["owner"] == "a:1", resume=lambda job: True) == ([], [])
    assert reg.get("jobs", "j")["owner"] == "a:1" and reg.get("jobs", "j")["attempt"] == 2
    assert reg.claim("jobs", "nope", {}, state="queued") is None
    reg.close()


def test_a_live_servers_check_for_orphans_takes_dead_processes_jobs_and_never_its_own(tmp_path, monkeypatch):
    """The periodic take-over on a shared home: a job of a process that is gone (same host, dead
    pid) is run again here; this server's own running job keeps its attempt and goes on."""
    from hmi.services.registry import owner_alive, process_owner

    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    server = tiny_server(tmp_path, shared_home=True, orphan_check_s=3600)
    url, stop = run_in_thread(server)
    try:
        admin = Client(url, ADMIN)
        # no dev set, so no early stop: six epochs of 2,400 texts, seconds of running however fast the machine
        mine = admin.create_tenant("mine", ["neg", "pos"], training_data={"train": TRAIN * 300}, epochs=6)
        wait_state(admin, mine["job"], ("running",))
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead_owner = f"{process_owner().rpartition(':')[0]}:{gone.stdout.strip()}"
        spec = {"kind": "bottleneck", "labels": ["neg", "pos"]}
        server.registry.create("tenants", "orphan", {"state": "training", "spec": spec, "token_hash": "x", "job": "j-orphan"})
        server.registry.create("jobs", "j-orphan", {"id": "j-orphan", "kind": "create", "tenant": "orphan", "spec": spec,
                                                    "state": "running", "attempt": 1, "inputs_kept": True,
                                                    "owner": dead_owner, "epochs": 1})
        (tmp_path / "jobs" / "j-orphan.json").write_text(json.dumps({"train": TRAIN}))
        assert server.jobs.take_over_orphans(owner_alive) == ([], ["j-orphan"])
        assert server.jobs.take_over_orphans(owner_alive) == ([], [])
        passed_over = admin.job(mine["job"])
        assert passed_over["state"] == "running" and passed_over["attempt"] == 1
        assert admin.wait_job("j-orphan", 300)["state"] == "succeeded"
        done = admin.wait_job(mine["job"], 300)
        assert done["state"] == "succeeded" and done["attempt"] == 1
    finally:
        stop()


def test_every_file_kept_for_a_job_is_traced_to_that_job_including_a_killed_writers_temporary(tmp_path):
    """Start-up recovery removes the files of jobs that ended by their job id: the kept inputs,
    the checkpoint, the PLOT a branch build keeps beside it and a temporary file a killed atomic
    write left (``hmi.io``'s naming)."""
    import tempfile
    from pathlib import Path

    from hmi.services.jobs import JobFiles, new_job_id

    jid = new_job_id()
    fd, tmp = tempfile.mkstemp(dir=tmp_path, prefix=f".{jid}.ckpt.", suffix=".tmp")
    os.close(fd)
    for f in (tmp_path / f"{jid}.json", tmp_path / f"{jid}.ckpt", tmp_path / f"{jid}.ckpt.plot", Path(tmp)):
        assert JobFiles.job_of(f) == jid, f.name
