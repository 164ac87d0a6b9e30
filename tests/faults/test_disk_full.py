"""A full disk, for real: the server's home on a small tmpfs filled to the last byte. A fine-tune,
a domain job, a PLOT build and a registry write each meet it: the request or the job gets a clear
error, nothing is published half-written, the server keeps serving the tenants it has, and the
same work succeeds once space is freed."""

import os
import subprocess
import uuid

import numpy as np
import pytest

from hmi.adapters.store import TMP
from hmi.client import ApiError, Client
from hmi.dispatcher.serve import run_in_thread
from tests.helpers.servers import ADMIN, TRAIN, domain_corpus, tiny_server


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (root only: skipped elsewhere), unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk) -> "os.PathLike":
    """Fills the filesystem to the last byte with one file; returns it (delete it to free the space)."""
    filler = disk / f"filler-{uuid.uuid4().hex}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


@pytest.mark.slow
def test_a_full_disk_fails_the_work_that_writes_clearly_and_the_same_work_succeeds_once_space_is_freed(small_disk):
    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    home = small_disk / "home"
    server = tiny_server(home)
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    try:
        first = admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN * 2}, epochs=1)
        assert admin.wait_job(first["job"], 300)["state"] == "succeeded"
        before = admin.infer("alpha", ["a great film", "an awful film"])

        # Requests that write meet a full disk: 507 at once and nothing of them kept, or (where the
        # registry's free pages still hold the job's record) a job that fails saying why.
        filler = fill(small_disk)
        for call in (lambda: admin.create_tenant("beta", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1),
                     lambda: admin.update_tenant("alpha", training_data={"train": TRAIN}, epochs=1),
                     lambda: admin.create_domain("legal", corpus=domain_corpus(), steps=2)):
            try:
                job = admin.wait_job(call()["job"], 300)
                assert job["state"] == "failed" and "No space left on device" in job["error"], job
            except ApiError as e:
                assert e.status == 507 and e.code == "insufficient_storage" and "disk is full" in e.message, e
        assert [t["name"] for t in admin.tenants()] == ["alpha"] and admin.tenant("alpha")["state"] == "ready"
        assert [d["name"] for d in admin.domains()] == ["root"]
        assert admin.infer("alpha", ["a great film", "an awful film"]) == before  # serving goes on
        os.unlink(filler)

        # Jobs accepted with space left that meet a full disk on the way: failed, saying why; the
        # tenant that was served still is, with its version; no new tenant or domain is served.
        for name, submit in (
                ("beta", lambda: admin.create_tenant("beta", ["neg", "pos"], training_data={"train": TRAIN * 30}, epochs=3)),
                ("alpha", lambda: admin.update_tenant("alpha", training_data={"train": TRAIN * 30}, epochs=3)),
                ("legal", lambda: admin.create_domain("legal", corpus=domain_corpus(), steps=20))):
            job = submit()["job"]
            filler = fill(small_disk)
            done = admin.wait_job(job, 300)
            assert done["state"] == "failed" and "No space left on device" in done["error"], (name, done)
            os.unlink(filler)
        filler = fill(small_disk)
        assert admin.tenant("beta")["state"] == "failed" and admin.tenant("alpha")["state"] == "ready"
        assert admin.tenant("alpha")["version"] == 1 and [d["name"] for d in admin.domains()] == ["root"]
        with pytest.raises(ApiError) as e:
            admin.infer("beta", ["a great film"])
        assert e.value.status == 409
        assert admin.infer("alpha", ["a great film", "an awful film"]) == before
        assert admin.request("GET", "/healthz")["status"] == "ok"
        assert not list((home / "tenants").glob(f"*/{TMP}*"))  # no half-written version left behind

        # Once space is freed, the same work succeeds.
        os.unlink(filler)
        admin.delete_tenant("beta")
        again = admin.create_tenant("beta", ["neg", "pos"], training_data={"train": TRAIN * 2}, epochs=1)
        assert admin.wait_job(again["job"], 300)["state"] == "succeeded"
        assert admin.wait_job(admin.update_tenant("alpha", training_data={"train": TRAIN}, epochs=1)["job"],
                              300)["state"] == "succeeded"
        assert admin.wait_job(admin.create_domain("legal", corpus=domain_corpus(), steps=2)["job"],
                              300)["state"] == "succeeded"
        assert len(admin.infer("beta", ["a great film"])) == 1 and admin.tenant("alpha")["version"] == 2
    finally:
        stop()


def test_a_plot_build_that_meets_a_full_disk_stops_with_the_reason_and_resumes_to_the_same_bytes(small_disk, tmp_path):
    from hmi.model.hplm import WindowedEncoder
    from hmi.plot.build import build
    from hmi.plot.keys import pack
    from hmi.plot.store import PlotMeta, PlotStore
    from tests.conftest import tiny_bert

    encoder = WindowedEncoder(tiny_bert(hidden=32, vocab=400), 2).eval()
    rng = np.random.default_rng(0)
    keys = np.unique(pack(rng.integers(1, 400, size=(30000, 3))))
    meta = PlotMeta(root_artifact="tiny", l_low=2, hidden_size=32, dtype="int8", chunks=1)
    reference = PlotStore(tmp_path / "reference", meta=meta, readonly=False)
    build(reference, encoder, keys, progress=False)
    store = PlotStore(small_disk / "plot", meta=meta, readonly=False)
    filler = small_disk / "filler"  # all but 1 MiB: the build writes some chunks, then meets the full disk
    filler.write_bytes(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - (1 << 20)))
    with pytest.raises(OSError, match="No space left on device"):
        build(store, encoder, keys, batch_windows=2048, progress=False)
    state = store.get_record("build")
    assert 0 < state["done"] < len(keys) and not state["complete"]
    os.unlink(filler)
    build(store, encoder, keys, batch_windows=2048, progress=False)
    got, found = store.get_many(keys)
    want, _ = reference.get_many(keys)
    assert found.all() and np.array_equal(got, want)
