"""Fine-tunes distilled from a full-context teacher, asked for through HTTP: the server's default
(``hmi serve --distil``, on unless ``--no-distil``) or a request's own ``distil``; the job says what the teacher scored and how
many unlabeled texts it answered, and the tenant serves as any other."""

import pytest

from hmi.cli import main
from hmi.client import ApiError, Client
from hmi.dispatcher.serve import run_in_thread
from hmi.training.serving import choose_serving
from tests.helpers.servers import ADMIN, TRAIN, tiny_server

UNLABELED = ["a great evening", "an awful evening", "a superb meal", "a terrible meal", "great acting again"]


def test_by_default_a_fine_tune_trains_a_teacher_unless_the_request_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path))
    try:
        admin = Client(url, ADMIN)
        taught = admin.create_tenant("taught", ["neg", "pos"], training_data={"train": TRAIN, "dev": TRAIN[::2], "unlabeled": UNLABELED},
                                     epochs=2)
        plain = admin.create_tenant("plain", ["neg", "pos"], training_data={"train": TRAIN}, epochs=2, distil=False)
        taught_job, plain_job = admin.wait_job(taught["job"], 300), admin.wait_job(plain["job"], 300)
        assert taught_job["state"] == plain_job["state"] == "succeeded"
        distilled = taught_job["metrics"]["distilled"]
        assert distilled["unlabeled_texts"] == len(UNLABELED) and 0 <= distilled["teacher_dev"] <= 1
        assert taught_job["metrics"]["train"]["n"] == len(TRAIN)  # scored on the labelled texts alone
        assert "distilled" not in plain_job["metrics"]
        assert taught_job["info"]["stage"] == "distilling the served adapter", taught_job  # what the console shows
        answers = admin.infer("taught", UNLABELED)
        assert len(answers) == len(UNLABELED) and {a["label"] for a in answers} <= {"neg", "pos"}
    finally:
        stop()


def test_a_request_distils_on_a_server_that_does_not_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path, distil=False))
    try:
        admin = Client(url, ADMIN)
        out = admin.create_tenant("t", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1, distil=True)
        job = admin.wait_job(out["job"], 300)
        distilled = job["metrics"]["distilled"]
        assert job["state"] == "succeeded" and (distilled["teacher_dev"], distilled["unlabeled_texts"]) == (None, 0)
        # without a dev split nothing chooses: one teacher, the tenant's pooling at the first rate
        assert distilled["teacher_tried"] == [["cls", 3e-3, None]]
    finally:
        stop()


def test_a_tenant_served_whole_answers_with_its_teacher_on_the_full_root_and_says_so(tmp_path, monkeypatch, capsys):
    """``serving: whole`` stores the distilled fine-tune's teacher (the adapter in every layer,
    spec ``whole``): the record and the job say so, the scores it measured are the teacher's (the
    windows' kept beside them), its answers come from the full root, and a retrain that asks for
    windows serves the adapter of the upper layers again.  Without the teacher it is refused."""
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path))
    try:
        admin = Client(url, ADMIN)
        data = {"train": TRAIN, "dev": TRAIN[::2], "test": TRAIN[1::2]}
        out = admin.create_tenant("w", ["neg", "pos"], training_data=data, epochs=2, serving="whole")
        job = admin.wait_job(out["job"], 300)
        assert job["state"] == "succeeded", job
        m = job["metrics"]
        assert m["serving"]["mode"] == m["serving"]["asked"] == "whole"
        assert m["dev"]["accuracy"] == m["distilled"]["teacher_dev"] == m["serving"]["teacher_dev"]
        assert m["windows"]["dev"]["accuracy"] == m["serving"]["windows_dev"]
        rec = admin.tenant("w")
        assert rec["spec"]["whole"] is True and rec["state"] == "ready"
        answers = admin.infer("w", [r["text"] for r in TRAIN[1::2]])
        right = sum(a["label"] == r["label"] for a, r in zip(answers, TRAIN[1::2])) / len(answers)
        assert abs(right - m["test"]["accuracy"]) <= 1 / len(answers)  # as scored (fp16 storage may flip one)
        assert admin.request("GET", "/healthz")["tenants_whole"] == 1
        assert main(["tenant", "list", "--url", url, "--token", ADMIN]) in (0, None)
        assert "served=whole" in capsys.readouterr().out

        up = admin.update_tenant("w", training_data=data, epochs=1, serving="windows")
        assert admin.wait_job(up["job"], 300)["state"] == "succeeded"
        assert "whole" not in admin.tenant("w")["spec"]
        assert len(admin.infer("w", ["great fun"])) == 1

        with pytest.raises(ApiError) as refused:
            admin.create_tenant("x", ["neg", "pos"], training_data=data, epochs=1, serving="whole", distil=False)
        assert refused.value.status == 400 and refused.value.code == "serving_needs_teacher"
    finally:
        stop()


@pytest.mark.parametrize("teacher_dev,windows_dev,mode", [(0.80, 0.75, "whole"), (0.80, 0.78, "windows"),
                                                          (None, 0.78, "windows"), (0.80, None, "windows")])
def test_auto_serves_whole_only_where_the_teacher_leads_the_windows_on_dev_by_more_than_the_margin(
        teacher_dev, windows_dev, mode):
    assert choose_serving("auto", True, teacher_dev, windows_dev)["mode"] == mode
    assert choose_serving("windows", True, teacher_dev, windows_dev)["mode"] == "windows"
    assert choose_serving("whole", True, teacher_dev, windows_dev)["mode"] == "whole"
    with pytest.raises(ValueError, match="distilled"):
        choose_serving("whole", False, None, windows_dev)
