"""Fine-tunes distilled from a full-context teacher, asked for through HTTP: the server's default
(``hmi serve --distil``, on unless ``--no-distil``) or a request's own ``distil``; the job says what the teacher scored and how
many unlabeled texts it answered, and the tenant serves as any other."""

import pytest

from hmi.cli import main
from hmi.client import ApiError, Client
from hmi.dispatcher.serve import run_in_thread
from hmi.training.finetune import GRID_LRS
from hmi.training.serving import choose_serving
from tests.helpers.servers import ADMIN, TRAIN, tiny_server

UNLABELED = ["a great evening", "an awful evening", "a superb meal", "a terrible meal", "great acting again"]


def test_by_default_a_fine_tune_trains_a_teacher_unless_the_request_says_otherwise(tmp_path, monkeypatch):
    """With dev examples the teacher is trained at each pooling and rate (``dev_options``) and the
    served adapter at each rate with the pooling the teacher kept; on the labels alone the served
    adapter is trained at each pooling and rate; the best on dev serves: the record takes its pooling and the answers are the ones
    scored.  A pooling asked for is kept, by the fine-tune, its teacher and an update."""
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path))
    try:
        admin = Client(url, ADMIN)
        data = {"train": TRAIN, "dev": TRAIN[::2], "unlabeled": UNLABELED}
        taught = admin.create_tenant("taught", ["neg", "pos"], training_data=data, epochs=2)
        plain = admin.create_tenant("plain", ["neg", "pos"], training_data=data, epochs=2, distil=False)
        mean = admin.create_tenant("mean", ["neg", "pos"], training_data=data, epochs=1, pooling="mean")
        taught_job, plain_job, mean_job = (admin.wait_job(t["job"], 300) for t in (taught, plain, mean))
        assert taught_job["state"] == plain_job["state"] == mean_job["state"] == "succeeded"
        m = taught_job["metrics"]
        distilled = m["distilled"]
        assert distilled["unlabeled_texts"] == len(UNLABELED) and 0 <= distilled["teacher_dev"] <= 1
        assert m["train"]["n"] == len(TRAIN)  # scored on the labelled texts alone
        assert [t[:2] for t in distilled["teacher_tried"]] == [[p, r] for p in ("cls", "mean") for r in GRID_LRS]
        assert [t[:2] for t in m["tried"]] == [[distilled["teacher_pooling"], r] for r in GRID_LRS]
        devs = [t[2] for t in m["tried"]]
        assert m["tried"][devs.index(max(devs))][1:] == [m["config"]["lr"], m["dev"]["accuracy"]]
        assert admin.tenant("taught")["spec"]["pooling"] == m["pooling"] == distilled["teacher_pooling"]
        assert taught_job["info"]["stage"] == "distilling the served adapter", taught_job  # what the console shows
        answers = admin.infer("taught", UNLABELED)
        assert len(answers) == len(UNLABELED) and {a["label"] for a in answers} <= {"neg", "pos"}

        p = plain_job["metrics"]
        assert "distilled" not in p
        assert [t[:2] for t in p["tried"]] == [[q, r] for q in ("cls", "mean") for r in GRID_LRS]
        devs = [t[2] for t in p["tried"]]
        assert p["tried"][devs.index(max(devs))][:2] == [p["pooling"], p["config"]["lr"]]
        assert admin.tenant("plain")["spec"]["pooling"] == p["pooling"]
        served = admin.infer("plain", [r["text"] for r in data["dev"]])
        right = sum(a["label"] == r["label"] for a, r in zip(served, data["dev"])) / len(served)
        assert abs(right - p["dev"]["accuracy"]) <= 1 / len(served)  # as scored (fp16 storage may flip one)

        assert {t[0] for t in mean_job["metrics"]["tried"]} == {"mean"} == {
            t[0] for t in mean_job["metrics"]["distilled"]["teacher_tried"]}
        up = admin.update_tenant("mean", training_data=data, epochs=1, serving="whole")
        up_job = admin.wait_job(up["job"], 300)
        assert up_job["state"] == "succeeded" and {t[0] for t in up_job["metrics"]["distilled"]["teacher_tried"]} == {"mean"}
        assert admin.tenant("mean")["spec"]["pooling"] == "mean"
    finally:
        stop()


def test_a_request_distils_on_a_server_that_does_not_by_default_and_without_dev_every_fit_takes_the_first_rate(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path, distil=False))
    try:
        admin = Client(url, ADMIN)
        out = admin.create_tenant("t", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1, distil=True)
        plain = admin.create_tenant("p", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
        job, plain_job = admin.wait_job(out["job"], 300), admin.wait_job(plain["job"], 300)
        distilled = job["metrics"]["distilled"]
        assert job["state"] == "succeeded" and (distilled["teacher_dev"], distilled["unlabeled_texts"]) == (None, 0)
        # without a dev split nothing chooses: the tenant's pooling at the grid's first rate, for the teacher,
        # its student and a fine-tune on the labels alone alike
        assert distilled["teacher_tried"] == job["metrics"]["tried"] == plain_job["metrics"]["tried"] == [
            ["cls", GRID_LRS[0], None]]
    finally:
        stop()


def test_a_tenant_served_whole_answers_with_its_teacher_on_the_full_root_and_says_so_with_the_jobs_whole_time(
        tmp_path, monkeypatch, capsys):
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
        # the job's time is the teacher's, the student's and the scoring of what serves (rounded to 0.1 s each)
        assert m["seconds"] >= m["distilled"]["teacher_seconds"] + m["distilled"]["student_seconds"] - 0.1
        assert m["distilled"]["teacher_seconds"] > 0 and m["seconds"] <= job["finished"] - job["started"]
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


def test_training_rows_held_out_on_request_are_a_dev_split_that_chooses_and_by_default_every_row_trains_unscored(
        tmp_path, monkeypatch):
    """200 training rows, no dev rows and ``hold_out: 20``: 20 of them become the dev split (the job
    says so), which chooses among every setting as a dev split given does; without ``hold_out`` all
    200 train at the first setting and report no dev score (null, not a 0.0); a hold-out beside dev
    rows, or of every row, is refused with what was wrong."""
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    url, stop = run_in_thread(tiny_server(tmp_path, distil=False))
    try:
        admin = Client(url, ADMIN)
        rows = TRAIN * 25
        held = admin.create_tenant("held", ["neg", "pos"], training_data={"train": rows, "hold_out": 20}, epochs=1)
        every = admin.create_tenant("every", ["neg", "pos"], training_data={"train": rows}, epochs=1)
        held_job, every_job = admin.wait_job(held["job"], 300), admin.wait_job(every["job"], 300)
        assert held_job["state"] == every_job["state"] == "succeeded"
        m = held_job["metrics"]
        assert (m["dev_held_out"], m["train"]["n"], m["dev"]["n"]) == (20, 180, 20)
        assert [t[:2] for t in m["tried"]] == [[p, r] for p in ("cls", "mean") for r in GRID_LRS]
        assert all(t[2] is not None for t in m["tried"])
        e = every_job["metrics"]
        assert "dev_held_out" not in e and e["train"]["n"] == 200 and e["tried"] == [["cls", GRID_LRS[0], None]]
        assert e["dev"] is None and e["test"] is None
        assert e["serving"]["windows_dev"] is None and m["serving"]["windows_dev"] == m["dev"]["accuracy"]
        for data, code in (({"train": rows, "dev": TRAIN, "hold_out": 10}, "hold_out_with_dev"),
                           ({"train": TRAIN, "hold_out": 8}, "hold_out_too_large")):
            with pytest.raises(ApiError) as refused:
                admin.create_tenant("refused", ["neg", "pos"], training_data=data, epochs=1)
            assert (refused.value.status, refused.value.code) == (422, code)
            assert "training_data.hold_out" in str(refused.value)
        assert "refused" not in {t["name"] for t in admin.tenants()}
    finally:
        stop()
