"""A server with the miss policy compute+insert: a tenant's training texts (and the unlabeled
ones it uploads with them) are kept by its fine-tune, misses by the requests; the answers are the same cold and warm, and what is kept is in
/metrics, survives a restart and is in a backup."""

import urllib.request

from hmi.backup import backup
from hmi.client import Client
from hmi.dispatcher.serve import run_in_thread
from hmi.plot.store import PlotStore
from tests.helpers.servers import ADMIN, TRAIN, tiny_server

UPLOADED = ["a lighthouse keeper writes letters", "snow fell on the quiet market square"]
UNSEEN = ["an unexpected twist in a quiet village", "the orchestra tuned its violins", "rain over the harbour"]


def metric(url: str, name: str, label: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith(name + "{") and label in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_compute_insert_keeps_training_windows_and_misses_answers_alike_and_keeps_them_across_restarts(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    home = tmp_path / "home"
    home.mkdir()
    server = tiny_server(home, miss_policy="compute+insert")
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    out = admin.create_tenant("alpha", ["neg", "pos"], training_data={"train": TRAIN, "unlabeled": UPLOADED}, epochs=1)
    done = admin.wait_job(out["job"], 300)
    assert done["state"] == "succeeded" and done["metrics"]["windows_kept"] > 0
    lookup = server.lookup
    computed = lookup.hits["computed"]
    admin.infer("alpha", [r["text"] for r in TRAIN])
    admin.infer("alpha", UPLOADED)
    assert lookup.hits["computed"] == computed  # the tenant's own texts hit from its first request

    cold = admin.infer("alpha", UNSEEN)
    assert lookup.hits["computed"] > computed
    assert lookup.keeper.flush(30)
    computed = lookup.hits["computed"]
    assert admin.infer("alpha", UNSEEN) == cold and lookup.hits["computed"] == computed
    assert metric(url, "hmi_plot_kept_entries", 'domain="root"') >= done["metrics"]["windows_kept"]
    assert metric(url, "hmi_plot_keeper_windows_total", 'event="added"') > 0
    stop()

    store = PlotStore(home / "plot")
    kept = store.kept()
    store.close()  # one open environment per file and process: the server below opens it again
    assert kept
    copy = tmp_path / "backup"
    backup(home, copy)
    assert PlotStore(copy / "plot").kept() == kept

    again = tiny_server(home, miss_policy="compute+insert")
    url, stop = run_in_thread(again)
    try:
        assert Client(url, ADMIN).infer("alpha", UNSEEN) == cold
        assert again.lookup.hits["computed"] == 0
    finally:
        stop()
