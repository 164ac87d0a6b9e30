"""Fine-tunes distilled from a full-context teacher, asked for through HTTP: the server's default
(``hmi serve --distil``, on unless ``--no-distil``) or a request's own ``distil``; the job says what the teacher scored and how
many unlabeled texts it answered, and the tenant serves as any other."""

from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
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
        assert job["state"] == "succeeded" and job["metrics"]["distilled"] == {"teacher_dev": None, "unlabeled_texts": 0}
    finally:
        stop()
