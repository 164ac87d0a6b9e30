"""Both ways of starting a server do the same around it: ``hmi serve`` creates the demo tenants
through the route's own code before it listens, ``hmi serve --ray`` over HTTP once its replicas
are up, from the same bodies; the tenants and jobs they leave are the same.  Both print the same
startup report."""

import json

import pytest

from hmi.client import Client
from hmi.dispatcher.launch import DEMO_TENANTS, create_demo_tenants, over_http, startup_report
from hmi.dispatcher.serve import in_process, run_in_thread
from tests.helpers.servers import ADMIN, tiny_server


@pytest.fixture(scope="module")
def data():
    from hmi.bootstrap import ensure_data

    ensure_data()


def left_behind(server) -> dict:
    """Each demo tenant's record and its job's record and kept inputs, without what differs by
    instant or identity (tokens, job ids, times, owners)."""
    out = {}
    for name, rec in server.registry.items("tenants"):
        job = server.registry.get("jobs", rec["job"])
        inputs = json.loads((server.home / "jobs" / f"{rec['job']}.json").read_text())
        keep = ("kind", "tenant", "spec", "epochs", "domain", "truncate", "max_len", "model")
        out[name] = {"record": {k: rec.get(k) for k in ("spec", "domain", "truncate", "state", "model", "root")},
                     "job": {k: job.get(k) for k in keep}, "inputs": inputs}
    return out


def test_demo_tenants_are_the_same_created_in_process_or_over_http(tmp_path, monkeypatch, data):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    here = tiny_server(tmp_path / "here", job_concurrency=0)  # the jobs are queued, not run
    try:
        tokens = create_demo_tenants(here.home, *in_process(here))
        local = left_behind(here)
        assert create_demo_tenants(here.home, *in_process(here)) == {}  # a restart creates none again
    finally:
        here.shutdown()
    there = tiny_server(tmp_path / "there", job_concurrency=0)
    url, stop = run_in_thread(there)
    try:
        remote_tokens = create_demo_tenants(there.home, *over_http(Client(url, ADMIN)))
        remote = left_behind(there)
    finally:
        stop()
    assert set(tokens) == set(remote_tokens) == {d["name"] for d in DEMO_TENANTS}
    assert local == remote
    assert {n: t["inputs"]["max_eval"] for n, t in local.items()} == {d["name"]: d["max_eval"] for d in DEMO_TENANTS}
    assert all(t["record"]["truncate"] and t["job"]["truncate"] for t in local.values())
    kept = json.loads((tmp_path / "here" / "demo_tokens.json").read_text())
    assert kept == tokens


def test_the_startup_report_warns_of_a_calibration_cut_short_and_says_where_the_admin_token_is(tmp_path, capsys):
    meta = {"calibration": {"steps": 800, "steps_done": 325, "steps_planned": 325, "max_minutes": 90.0,
                            "train_seconds": 5400.0}, "root_source": "mpnet-base", "l_low": 6}
    lines = startup_report(tmp_path, meta, "mpnet-l6-x", "tok", True, recovered=["j1"], resumed=["j2"])
    assert lines[0].startswith("warning: root artifact mpnet-l6-x: the time budget (90.0 min) held 325 of the 800")
    assert "`hmi calibrate --root mpnet-base --l-low 6`" in lines[0]
    assert lines[1:3] == ["marked 1 interrupted job(s) as failed", "running 1 interrupted job(s) again from their start: j2"]
    assert lines[3].endswith(": tok") and capsys.readouterr().out.splitlines() == lines
    assert startup_report(tmp_path, {}, "a", "tok", False)[0].startswith("admin token: ")


def test_demo_tenants_whose_adapters_ship_for_this_root_serve_at_once_and_the_others_train(tmp_path, monkeypatch,
                                                                                           data, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    from hmi.adapters.shipped import ShippedAdapterError, as_shipped, read_shipped, shipped_for, write_shipped
    from hmi.training.demo import demo_spec
    from hmi.training.finetune import initial_weights

    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    monkeypatch.setattr("hmi.adapters.shipped.SHIPPED_DIR", tmp_path / "shipped")
    server = tiny_server(tmp_path / "home", job_concurrency=0)
    try:
        news, reviews = DEMO_TENANTS
        spec = demo_spec(news)
        weights = initial_weights(server.root.bert.config, 2, spec, seed=1)
        identity = {"root_artifact": server.root.artifact_id, "root_fingerprint": server.served.root_fingerprint,
                    "plot_fingerprint": None, "miss_policy": server.lookup.policy}  # the tiny server's PLOT has no build
        write_shipped(news["name"], spec, weights, {**identity, "metrics": {"test": {"accuracy": 0.9}}})
        write_shipped(reviews["name"], demo_spec(reviews), initial_weights(server.root.bert.config, 2, demo_spec(reviews)),
                      {**identity, "root_artifact": "another-artifact"})  # trained on another root: not served
        tokens = create_demo_tenants(server.home, *in_process(server))
        assert set(tokens) == {news["name"], reviews["name"]}
        ready, training = server.registry.get("tenants", news["name"]), server.registry.get("tenants", reviews["name"])
        assert (ready["state"], ready["job"], ready["truncate"], ready["metrics"]["shipped"]) == ("ready", None, True, True)
        assert ready["metrics"]["miss_policy"] == server.lookup.policy  # what it was trained on, as a fine-tune records
        assert training["state"] == "training" and training["job"]
        stored = server.store.load(news["name"])
        assert all(torch.equal(stored[k], v) for k, v in as_shipped(weights).items())
        (answer,) = server.scheduler.infer([(news["name"], "Shares rose after the bank beat forecasts.")])
        assert answer["label"] in spec.labels
        assert "ready (their adapters ship with hmi): demo-news" in capsys.readouterr().out
    finally:
        server.shutdown()
    # A damaged file is refused by its sha256; another root's adapter is not found for this one.
    path = tmp_path / "shipped" / news["name"] / "adapter.safetensors"
    w = load_file(str(path))
    w["head.b"] = w["head.b"] + 1
    save_file(w, str(path))
    with pytest.raises(ShippedAdapterError, match="damaged"):
        read_shipped(news["name"])
    assert shipped_for(reviews["name"], **identity) is None


def test_the_decoder_demo_tenant_whose_adapter_ships_for_this_decoder_and_its_plot_serves_at_once(tmp_path, monkeypatch,
                                                                                                  data, capsys):
    import torch

    from hmi.adapters.shipped import as_shipped, write_shipped
    from hmi.dispatcher.launch import shipped_identity
    from hmi.hgpt.generation import EngineConfig
    from hmi.hgpt.runtime import HgptRuntime
    from hmi.plot.store import PlotMeta, PlotStore
    from hmi.training.demo import DEMO_DECODER_TENANTS, train_demo_decoder
    from tests.helpers.decoders import tiny_decoder_root
    from tests.helpers.servers import raw

    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    monkeypatch.setattr("hmi.adapters.shipped.SHIPPED_DIR", tmp_path / "shipped")
    server = tiny_server(tmp_path / "home", job_concurrency=0)  # a job would stay queued
    root = tiny_decoder_root()
    meta = PlotMeta(root.artifact_id, 2, 32, n=1, kind="causal")
    PlotStore(tmp_path / "gpt-plot", meta=meta, readonly=False).close()
    runtime = HgptRuntime(root, PlotStore(tmp_path / "gpt-plot", readonly=True, expect=meta),
                          server.transfer.load_decoder_tenant, cfg=EngineConfig(rank=4, max_len=128, max_active=4))
    server.enable_hgpt(runtime)
    url, stop = run_in_thread(server)
    try:
        (d,) = DEMO_DECODER_TENANTS
        spec, weights, metrics = train_demo_decoder({**d, "max_train": 24}, root, runtime.lookup, 4, progress=False)
        assert metrics["dev_ppl_after"] <= metrics["dev_ppl_before"]
        write_shipped(d["name"], spec, weights, {**shipped_identity(server, "decoder"), "metrics": {"steps": 3}})
        tokens = create_demo_tenants(server.home, *in_process(server), hgpt=True)
        rec = server.registry.get("tenants", d["name"])
        assert d["name"] in tokens and (rec["state"], rec["job"], rec["model"], rec["metrics"]["shipped"]) == \
            ("ready", None, "decoder", True)
        stored = server.store.load(d["name"])
        assert all(torch.equal(stored[k], v) for k, v in as_shipped(weights).items())
        got, out = raw(url, "POST", f"/v1/tenants/{d['name']}/generate", {"prompt": "the lazy", "max_new_tokens": 4},
                       token=tokens[d["name"]])
        assert got == 200 and out["tokens"] == 4, out
        assert "demo-legal-gpt" in capsys.readouterr().out.split("ready (their adapters ship with hmi):")[1].split("\n")[0]
    finally:
        stop()


def test_a_decoder_demo_adapter_shipped_for_another_decoder_is_trained_by_its_job_instead(tmp_path, monkeypatch, data):
    from hmi.adapters.shipped import write_shipped
    from hmi.adapters.spec import AdapterSpec
    from hmi.dispatcher.launch import shipped_identity
    from hmi.hgpt.generation import EngineConfig
    from hmi.hgpt.runtime import HgptRuntime
    from hmi.plot.store import PlotMeta, PlotStore
    from hmi.training.demo import DEMO_DECODER_TENANTS
    from tests.helpers.decoders import tiny_decoder_root

    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    monkeypatch.setattr("hmi.adapters.shipped.SHIPPED_DIR", tmp_path / "shipped")
    server = tiny_server(tmp_path / "home", job_concurrency=0)
    root = tiny_decoder_root()
    meta = PlotMeta(root.artifact_id, 2, 32, n=1, kind="causal")
    PlotStore(tmp_path / "gpt-plot", meta=meta, readonly=False).close()
    server.enable_hgpt(HgptRuntime(root, PlotStore(tmp_path / "gpt-plot", readonly=True, expect=meta),
                                   server.transfer.load_decoder_tenant, cfg=EngineConfig(rank=4)))
    try:
        (d,) = DEMO_DECODER_TENANTS
        write_shipped(d["name"], AdapterSpec.decoder(rank=4), {},
                      {**shipped_identity(server, "decoder"), "root_artifact": "another-decoder"})
        create_demo_tenants(server.home, *in_process(server), hgpt=True)
        rec = server.registry.get("tenants", d["name"])
        assert rec["state"] == "training" and rec["job"]
    finally:
        server.shutdown()


@pytest.mark.parametrize("demo", [True, False])
def test_the_banner_names_only_tenants_the_server_has_and_its_commands_parse_for_its_address(demo):
    """With the demo tenants, requests to them; without (``--no-demo``), the command that creates a
    tenant first, then requests to it; every ``hmi`` line parses and names the server's address."""
    import shlex
    from pathlib import Path

    from hmi.cli import build_parser
    from hmi.dispatcher.launch import banner

    base = "http://127.0.0.1:8124"
    text = banner(base, Path("/home/x"), demo=demo)
    assert ("demo-news" in text) == demo and ("hmi tenant create" in text) == (not demo)
    commands = [shlex.split(line.split("  (")[0].strip())[1:] for line in text.splitlines()
                if line.strip().startswith("hmi ")]
    assert len(commands) == (1 if demo else 2)
    for argv in commands:
        assert build_parser().parse_args(argv).url == base
