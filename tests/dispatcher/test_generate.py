"""Decoder tenants through real HTTP: created by a fine-tune job, generating for several tenants at
once, streaming, the OpenAI-style completions route, and the error rules of the rest of the API."""

import copy
import json
import threading
import time
import urllib.request

import pytest

from hmi.adapters.spec import AdapterSpec
from hmi.dispatcher.serve import run_in_thread
from hmi.hgpt.generation import EngineConfig
from hmi.hgpt.runtime import HgptRuntime
from hmi.plot.store import PlotMeta, PlotStore
from tests.helpers.decoders import TEXTS, tiny_decoder_root  # noqa: F401
from tests.helpers.servers import ADMIN, TRAIN, raw, tiny_server


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    import os

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    home = tmp_path_factory.mktemp("home")
    server = tiny_server(home)
    root = tiny_decoder_root()
    meta = PlotMeta(root.artifact_id, 2, 32, n=1, kind="causal")
    PlotStore(home / "gpt-plot", meta=meta, readonly=False).close()
    runtime = HgptRuntime(root, PlotStore(home / "gpt-plot", readonly=True, expect=meta), server.transfer.load_decoder_tenant,
                          miss_policy="compute", cfg=EngineConfig(rank=4, max_len=128, max_active=4))
    server.enable_hgpt(runtime)
    url, stop = run_in_thread(server)
    tokens = {}
    for name, texts in (("writer", TEXTS), ("poet", TEXTS[::-1])):
        got, out = raw(url, "POST", "/v1/tenants", {"name": name, "model": "decoder", "training_text": texts,
                                                    "adapter": {"rank": 4}, "epochs": 1})
        assert got == 202, out
        tokens[name] = out["token"]
        done = wait(url, out["job"])
        assert done["state"] == "succeeded", done
    got, out = raw(url, "POST", "/v1/tenants", {"name": "classic", "task": {"type": "classification", "labels": ["neg", "pos"]},
                                                "training_data": {"train": TRAIN}, "epochs": 1})
    assert wait(url, out["job"])["state"] == "succeeded"
    yield {"url": url, "tokens": tokens, "server": server}
    stop()


def wait(url, job, timeout=300):
    import time

    end = time.time() + timeout
    while time.time() < end:
        _, j = raw(url, "GET", f"/v1/jobs/{job}")
        if j["state"] not in ("queued", "running"):
            return j
        time.sleep(0.3)
    raise TimeoutError(job)


def stream_lines(url, path, body, token=ADMIN):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers["Content-Type"], [line.decode() for line in r.read().splitlines() if line.strip()]


def test_decoder_tenants_generate_through_http_for_several_tenants_at_once(gpt):
    url = gpt["url"]
    solo = {t: raw(url, "POST", f"/v1/tenants/{t}/generate", {"prompt": "the lazy", "max_new_tokens": 8})[1]
            for t in ("writer", "poet")}
    assert solo["writer"]["tokens"] == 8 and solo["writer"]["finish_reason"] == "length"
    results, threads = [], []
    for i in range(8):
        t = ("writer", "poet")[i % 2]
        threads.append(threading.Thread(target=lambda t=t: results.append(
            (t, raw(url, "POST", f"/v1/tenants/{t}/generate", {"prompt": "the lazy", "max_new_tokens": 8},
                    token=gpt["tokens"][t])))))
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(results) == 8
    for t, (status, out) in results:
        assert status == 200 and out["text"] == solo[t]["text"]


def test_streaming_generate_sends_ndjson_pieces_that_add_up_to_the_result(gpt):
    ctype, lines = stream_lines(gpt["url"], "/v1/tenants/writer/generate",
                                {"prompt": "a quick", "max_new_tokens": 10, "stream": True})
    assert ctype.startswith("application/x-ndjson")
    msgs = [json.loads(x) for x in lines]
    assert msgs[-1]["done"] and msgs[-1]["tokens"] == 10
    assert "".join(m["text"] for m in msgs[:-1]) == msgs[-1]["text"]


def test_openai_style_completions_answer_and_stream_server_sent_events(gpt):
    url = gpt["url"]
    got, out = raw(url, "POST", "/v1/completions", {"model": "poet", "prompt": "the sun", "max_tokens": 6},
                   token=gpt["tokens"]["poet"])
    assert got == 200 and out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 6
    ctype, lines = stream_lines(url, "/v1/completions", {"model": "poet", "prompt": "the sun", "max_tokens": 6, "stream": True})
    assert ctype.startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,token,status,code", [
    ("/v1/tenants/writer/generate", {"prompt": ""}, ADMIN, 400, "bad_prompt"),
    ("/v1/tenants/writer/generate", {"prompt": "hi", "max_new_tokens": 0}, ADMIN, 400, "bad_max_new_tokens"),
    ("/v1/tenants/writer/generate", {"prompt": "hi", "top_p": 2}, ADMIN, 400, "bad_top_p"),
    ("/v1/tenants/writer/generate", {"prompt": "hi", "bogus": 1}, ADMIN, 400, "unknown_field"),
    ("/v1/tenants/writer/generate", {"prompt": "hi", "stop": "x" * 0}, ADMIN, 400, "bad_stop"),
    ("/v1/tenants/writer/generate", {"prompt": "y" * 300}, ADMIN, 413, "input_too_long"),
    ("/v1/tenants/classic/generate", {"prompt": "hi"}, ADMIN, 422, "not_a_decoder_tenant"),
    ("/v1/tenants/nobody/generate", {"prompt": "hi"}, ADMIN, 404, "unknown_tenant"),
    ("/v1/completions", {"prompt": "hi"}, ADMIN, 400, "missing_field"),
    ("/v1/completions", {"model": "writer", "prompt": "hi", "n": 2}, ADMIN, 400, "invalid_value"),
    ("/v1/tenants", {"name": "x1", "model": "decoder", "corpus": "nope"}, ADMIN, 400, "unknown_corpus"),
    ("/v1/tenants", {"name": "x2", "model": "decoder", "training_text": []}, ADMIN, 400, "empty_training_data"),
    ("/v1/tenants", {"name": "x4", "model": "decoder"}, ADMIN, 400, "missing_field"),
    ("/v1/tenants", {"name": "x3", "model": "decoder", "training_text": ["a"], "adapter": {"rank": 16}}, ADMIN, 422,
     "invalid_spec"),
])
def test_bad_generation_requests_get_a_clear_4xx(gpt, path, body, token, status, code):
    got, out = raw(gpt["url"], "POST", path, body, token=token)
    assert (got, out["error"]["code"]) == (status, code), out


def test_a_tenant_token_cannot_generate_for_another_tenant(gpt):
    got, out = raw(gpt["url"], "POST", "/v1/tenants/poet/generate", {"prompt": "hi"}, token=gpt["tokens"]["writer"])
    assert got == 403
    got, out = raw(gpt["url"], "POST", "/v1/completions", {"model": "poet", "prompt": "hi"}, token=gpt["tokens"]["writer"])
    assert got == 403


def test_update_and_delete_of_a_decoder_tenant(gpt):
    url = gpt["url"]
    got, out = raw(url, "POST", "/v1/tenants/poet/update", {"training_text": TEXTS, "epochs": 1})
    assert got == 202 and wait(url, out["job"])["state"] == "succeeded"
    got, _ = raw(url, "POST", "/v1/tenants/poet/generate", {"prompt": "the", "max_new_tokens": 3})
    assert got == 200
    got, _ = raw(url, "DELETE", "/v1/tenants/poet")
    assert got == 200
    got, out = raw(url, "POST", "/v1/tenants/poet/generate", {"prompt": "the"})
    assert got == 404


def test_cli_generate_streams_the_completion(gpt, capsys):
    from hmi.cli import main

    want = raw(gpt["url"], "POST", "/v1/tenants/writer/generate", {"prompt": "the quick", "max_new_tokens": 5})[1]
    assert main(["generate", "writer", "the quick", "--max-new-tokens", "5", "--url", gpt["url"], "--token", ADMIN]) in (0, None)
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n") == want["text"].rstrip("\n")
    assert "5 tokens" in captured.err


def test_hostile_sampling_parameters_fail_only_their_own_request_over_http(gpt):
    url = gpt["url"]
    results = {}

    def run(key, body):
        results[key] = raw(url, "POST", "/v1/tenants/writer/generate", body)

    bodies = {"seed": {"prompt": "the lazy", "seed": 2**64, "temperature": 0.7},
              "tiny": {"prompt": "the lazy", "temperature": 1e-300, "max_new_tokens": 6},
              "ok1": {"prompt": "the lazy", "max_new_tokens": 6}, "ok2": {"prompt": "a quick", "max_new_tokens": 6}}
    threads = [threading.Thread(target=run, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["seed"][0] == 400 and results["seed"][1]["error"]["code"] == "bad_seed"
    assert results["tiny"][0] == 200 and results["tiny"][1]["text"] == results["ok1"][1]["text"]  # greedy
    assert results["ok2"][0] == 200 and results["ok2"][1]["tokens"] == 6


def test_a_client_that_disconnects_mid_stream_frees_its_engine_slot(gpt, monkeypatch, caplog):
    import socket
    import urllib.parse

    engine = gpt["server"].decoders.runtime.engine
    real_decode = engine._decode

    def slow_decode(running):  # 120 tokens take seconds: the request cannot finish on its own meanwhile
        time.sleep(0.03)
        return real_decode(running)

    monkeypatch.setattr(engine, "_decode", slow_decode)
    dropped = engine.stats.get("dropped", 0)
    u = urllib.parse.urlparse(gpt["url"])
    body = json.dumps({"prompt": "the quick", "max_new_tokens": 120, "stream": True}).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(b"POST /v1/tenants/writer/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {ADMIN}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    assert b"200" in sock.recv(4096)
    deadline = time.time() + 30
    while not engine.active and time.time() < deadline:
        time.sleep(0.01)
    assert engine.active
    sock.close()
    deadline = time.time() + 30
    while engine.active and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.active and not engine.pool._pins
    assert engine.stats["dropped"] == dropped + 1  # it left because its client did, not because it finished
    assert not any("unhandled error" in r.getMessage() for r in caplog.records)
    got, out = raw(gpt["url"], "POST", "/v1/tenants/writer/generate", {"prompt": "the", "max_new_tokens": 3})
    assert got == 200 and out["tokens"] == 3


def test_a_full_generation_queue_answers_429_with_retry_after_and_a_tenant_over_its_share_is_told_so(gpt, monkeypatch):
    service = gpt["server"].decoders.runtime.service
    for setting, code in (("max_waiting", "overloaded"), ("tenant_queue", "over_share")):
        with monkeypatch.context() as m:
            m.setattr(service, setting, 0)
            req = urllib.request.Request(gpt["url"] + "/v1/tenants/writer/generate", data=json.dumps({"prompt": "x"}).encode(),
                                         method="POST", headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {ADMIN}"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
            assert json.loads(e.value.read())["error"]["code"] == code


def test_a_tenant_whose_stored_lora_does_not_fit_fails_alone_with_a_named_error(gpt, caplog):
    s = gpt["server"]
    spec = AdapterSpec.decoder(rank=2, alpha=4.0)  # the engine batches rank 4
    s.store.save("misfit", spec, {k: v[:2] if k.endswith("_A") else v[:, :2] for k, v in s.store.load("writer").items()})
    rec = {"state": "ready", "model": "decoder", "spec": spec.to_dict(), "token_hash": "x"}
    s.registry.create("tenants", "misfit", rec)
    s.tenants.serve_new_version("misfit", rec)
    try:
        for stream in (False, True):
            if stream:
                _, lines = stream_lines(gpt["url"], "/v1/tenants/misfit/generate", {"prompt": "the", "stream": True})
                assert json.loads(lines[-1])["error"]["code"] == "generation_failed"
            else:
                got, out = raw(gpt["url"], "POST", "/v1/tenants/misfit/generate", {"prompt": "the"})
                assert got == 500 and out["error"]["code"] == "generation_failed", out
        got, out = raw(gpt["url"], "POST", "/v1/tenants/writer/generate", {"prompt": "the", "max_new_tokens": 3})
        assert got == 200 and out["tokens"] == 3
        assert not any("unhandled error" in r.getMessage() for r in caplog.records)
    finally:
        s.tenants.delete("misfit", rec)


def test_a_peft_lora_uploads_as_a_decoder_tenant_generates_like_the_trained_one_and_downloads_for_peft(gpt, tmp_path):
    import io
    import zipfile

    from peft import PeftModel

    from hmi.client import ApiError as ClientError
    from hmi.client import Client

    admin = Client(gpt["url"], ADMIN)
    data = admin.export_adapter("writer")  # PEFT's folder, zipped
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    root = gpt["server"].decoders.runtime.root
    peft = PeftModel.from_pretrained(copy.deepcopy(root.model), str(folder))  # PEFT reads what we wrote
    assert sorted(peft.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    out = admin.import_adapter("writer-copy", data, model="decoder")
    assert out["token"] and out["spec"]["head"] == "lm"
    body = {"prompt": "the quick", "max_new_tokens": 6}
    assert admin.generate("writer-copy", **body)["text"] == admin.generate("writer", **body)["text"]
    bad = zipfile.ZipFile(io.BytesIO(data))
    files = {n.split("/")[-1]: bad.read(n) for n in bad.namelist()}
    cfg = json.loads(files["adapter_config.json"])
    from hmi.archive import zip_files

    with pytest.raises(ClientError) as err:
        admin.import_adapter("wrong-rank", zip_files({**files, "adapter_config.json": json.dumps({**cfg, "r": 8}).encode()},
                                                     "f"), model="decoder")
    assert "rank 4" in str(err.value)


def test_the_admin_sets_a_decoder_tenants_share_of_the_generation_rows(gpt):
    s = gpt["server"]
    try:
        got, out = raw(gpt["url"], "POST", "/v1/tenants/writer/share", {"weight": 3})
        assert got == 200 and out["weight"] == 3
        assert s.decoders.runtime.service._fair.weight("writer") == 3.0 == s.served.weight("writer")
    finally:
        raw(gpt["url"], "POST", "/v1/tenants/writer/share", {"weight": 1})
