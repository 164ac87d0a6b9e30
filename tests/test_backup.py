"""A backup taken while a server serves and a job runs restores to a server that answers every
tenant as the original did at the backup (a job left running runs again there); a damaged or
incomplete backup is refused before anything is written, and a home in use is not overwritten."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from hmi.backup import MANIFEST, BackupError, backup, restore, verify
from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import ADMIN, LONG_JOB, TAGS, TRAIN, domain_corpus, tiny_server

TEXTS = ["a great film", "an awful, boring mess", "the dog runs"]


def test_a_backup_of_a_live_server_restores_to_one_that_answers_every_tenant_as_it_did(tmp_path):
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path / "home")
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    try:
        jobs = [admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2}, epochs=2)["job"],
                admin.create_tenant("beta", ["D", "N", "V"], task_type="tagging", training_data={"train": TAGS * 3},
                                    adapter={"kind": "lora", "rank": 4}, epochs=1)["job"],
                admin.create_domain("legal", "root", corpus=domain_corpus(), alpha=0.5, steps=10)["job"]]
        assert all(admin.wait_job(j, 300)["state"] == "succeeded" for j in jobs)
        job = admin.create_tenant("gamma", ["neg", "pos"], domain="legal", training_data={"train": TRAIN * 2},
                                  epochs=2)["job"]
        assert admin.wait_job(job, 300)["state"] == "succeeded"
        before = {t: admin.infer(t, TEXTS) for t in ("alpha", "beta", "gamma")}
        running = admin.update_tenant("alpha", **LONG_JOB)["job"]  # still running while the copy is taken
        deadline = time.time() + 120
        while admin.job(running)["state"] != "running" and time.time() < deadline:
            time.sleep(0.1)
        busy = threading.Event()

        def traffic():
            while not busy.is_set():
                admin.infer("beta", TEXTS[:1])

        load = threading.Thread(target=traffic, daemon=True)
        load.start()
        # From another process, as an operator runs it (LMDB opens an environment once per process).
        done = subprocess.run([sys.executable, "-c", "from hmi.cli import main; raise SystemExit(main())", "backup",
                               "--home", str(tmp_path / "home"), str(tmp_path / "copy")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        manifest = json.loads((tmp_path / "copy" / MANIFEST).read_text())
        busy.set()
        load.join(30)
        assert admin.job(running)["state"] == "running"
        admin.cancel_job(running)
    finally:
        stop()
    files = manifest["files"]
    assert "registry/data.mdb" in files and any(f.startswith("domains/") and f.endswith("data.mdb") for f in files)
    assert not any("calibration" in f or f.endswith("lock.mdb") for f in files)

    restore(tmp_path / "copy", tmp_path / "restored")
    again = tiny_server(tmp_path / "restored", job_concurrency=0)  # the interrupted update waits, queued
    url, stop = run_in_thread(again)
    try:
        restored = Client(url, ADMIN)
        assert {t: restored.infer(t, TEXTS) for t in before} == before
        assert [d["name"] for d in restored.domains() if d["name"] != "root"] == ["legal"]
        assert restored.job(running)["state"] in ("queued", "running")  # run again from its kept inputs
    finally:
        stop()


def test_a_damaged_or_incomplete_backup_is_refused_before_anything_is_written(tmp_path):
    home = tmp_path / "home"
    (home / "tenants" / "t" / "v1").mkdir(parents=True)
    (home / "tenants" / "t" / "v1" / "adapter.safetensors").write_bytes(b"weights")
    (home / "tenants" / "t" / "CURRENT").write_text("v1")
    (home / "tenants" / "t" / "v0-unpublished").mkdir()
    (home / "calibration").mkdir()
    (home / "calibration" / "checkpoint.pt").write_bytes(b"x")
    (home / "admin_token").write_text("secret")
    manifest = backup(home, tmp_path / "copy")
    assert set(manifest["files"]) == {"tenants/t/v1/adapter.safetensors", "tenants/t/CURRENT", "admin_token"}
    with pytest.raises(BackupError, match="exists"):
        backup(home, tmp_path / "copy")
    assert verify(tmp_path / "copy")["files"] == manifest["files"]

    (tmp_path / "copy" / "tenants" / "t" / "v1" / "adapter.safetensors").write_bytes(b"weightz")
    with pytest.raises(BackupError, match="damaged"):
        restore(tmp_path / "copy", tmp_path / "new")
    (tmp_path / "copy" / "tenants" / "t" / "v1" / "adapter.safetensors").unlink()
    with pytest.raises(BackupError, match="missing"):
        restore(tmp_path / "copy", tmp_path / "new")
    (tmp_path / "copy" / MANIFEST).unlink()
    with pytest.raises(BackupError, match="not a backup"):
        restore(tmp_path / "copy", tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_restore_does_not_overwrite_a_home_in_use_unless_forced_and_then_keeps_it_aside(tmp_path, capsys):
    from hmi.cli import main

    home = tmp_path / "home"
    home.mkdir()
    (home / "admin_token").write_text("old")
    assert main(["backup", "--home", str(home), str(tmp_path / "copy")]) == 0
    (home / "admin_token").write_text("newer")
    assert main(["restore", "--home", str(home), str(tmp_path / "copy")]) == 2
    assert "not empty" in capsys.readouterr().err and (home / "admin_token").read_text() == "newer"
    assert main(["restore", "--home", str(home), str(tmp_path / "copy"), "--force"]) == 0
    assert (home / "admin_token").read_text() == "old"
    (aside,) = tmp_path.glob("home.before-restore-*")
    assert (aside / "admin_token").read_text() == "newer"
