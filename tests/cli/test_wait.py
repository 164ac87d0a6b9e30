"""``--wait`` on the client commands against a live server: the job's progress on stderr while it
runs, the job on stdout once it ends, the exit code its outcome; Ctrl+C stops the waiting and not
the job. ``hmi domain create|delete --url`` as well (they did not run at all through a server)."""

import json

import pytest

import hmi.cli.common as common
from hmi.cli import main
from hmi.client import Client
from tests.helpers.servers import ADMIN, TRAIN, domain_corpus, running_tiny_server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    (data / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN[::2]))
    (data / "short.txt").write_text("\n".join(domain_corpus(300)) + "\n")  # under a domain's least tokens
    (data / "licenses.txt").write_text("\n".join(domain_corpus()) + "\n")
    with running_tiny_server(tmp_path_factory.mktemp("home")) as url:
        yield {"url": url, "data": data}


def last_json(out: str) -> dict:
    return json.loads(out[out.rindex("\n{") + 1:] if "\n{" in out else out)


def test_waiting_for_a_fine_tune_shows_its_progress_and_ends_with_the_job_and_its_outcome(live, capsys):
    code = main(["tenant", "create", "waited", "--url", live["url"], "--token", ADMIN, "--labels", "neg,pos",
                 "--train", str(live["data"] / "train.jsonl"), "--dev", str(live["data"] / "dev.jsonl"),
                 "--epochs", "1", "--wait"])
    out, err = capsys.readouterr()
    job = last_json(out)
    assert code == 0 and job["state"] == "succeeded"
    lines = err.strip().splitlines()  # a job this small may run between two polls: its first and last state
    assert lines and all(line.startswith(f"job {job['id']}: ") and " waited" in line for line in lines), err
    assert lines[-1].startswith(f"job {job['id']}: succeeded")


def test_the_progress_of_a_job_says_its_stage_setting_and_what_is_left_once_per_change_or_every_30_s():
    """``JobProgress`` off a terminal: a line when the state, stage or setting changes, else every
    30 s; the time left from the pace since the job was first seen running."""
    import io

    from hmi.cli.common import JobProgress

    clock = iter([0.0, 0.0, 10.0, 20.0, 40.0, 50.0, 60.0])
    out = io.StringIO()
    progress = JobProgress(out, clock=lambda: next(clock))
    teacher = {"stage": "training the teacher", "setting": 1, "settings": 4}
    for job in ({"id": "j", "state": "queued"},
                {"id": "j", "state": "running", "progress": 0.0, "info": teacher},
                {"id": "j", "state": "running", "progress": 0.1, "info": teacher},  # 10 s later: no line
                {"id": "j", "state": "running", "progress": 0.25, "info": teacher},  # 30 s after the last line
                {"id": "j", "state": "running", "progress": 0.5, "info": {**teacher, "setting": 2}},
                {"id": "j", "state": "succeeded", "progress": 1.0, "info": {**teacher, "setting": 4}}):
        progress.update(job)
    assert out.getvalue().splitlines() == [
        "job j: queued, 0 s waited",
        "job j: running, 0%, training the teacher, setting 1 of 4, 10 s waited",
        "job j: running, 25%, training the teacher, setting 1 of 4, 40 s waited, about 1 min 30 s left",
        "job j: running, 50%, training the teacher, setting 2 of 4, 50 s waited, about 40 s left",
        "job j: succeeded, training the teacher, setting 4 of 4, 1 min 00 s waited"]


def test_ctrl_c_while_waiting_stops_the_waiting_and_the_job_goes_on(live, capsys, monkeypatch):
    def interrupted(self, job):
        raise KeyboardInterrupt  # what Ctrl+C raises in the main thread, here while it shows the job
    monkeypatch.setattr(common.JobProgress, "update", interrupted)
    code = main(["tenant", "create", "left", "--url", live["url"], "--token", ADMIN, "--labels", "neg,pos",
                 "--train", str(live["data"] / "train.jsonl"), "--epochs", "1", "--wait"])
    monkeypatch.undo()
    out, err = capsys.readouterr()
    job_id = json.loads(out)["job"]
    assert code == 130 and f"stopped waiting; job {job_id} goes on" in err
    assert Client(live["url"], ADMIN).wait_job(job_id, 300)["state"] == "succeeded"


def test_a_domain_created_and_deleted_through_a_server_from_the_command_line_and_a_failed_job_exits_1(live, capsys):
    def create(corpus):
        return main(["domain", "create", "licenses", "--url", live["url"], "--token", ADMIN,
                     "--corpus", str(live["data"] / corpus), "--steps", "2", "--wait"])
    assert create("short.txt") == 1
    job = last_json(capsys.readouterr().out)
    assert job["state"] == "failed" and "a domain needs at least" in job["error"]
    code = create("licenses.txt")
    out, err = capsys.readouterr()
    assert code == 0 and last_json(out)["state"] == "succeeded", err
    assert "licenses" in [d["name"] for d in Client(live["url"], ADMIN).domains()]
    assert main(["domain", "delete", "licenses", "--url", live["url"], "--token", ADMIN]) == 0
    assert "licenses" not in [d["name"] for d in Client(live["url"], ADMIN).domains()]
