"""Bring your own adapter over HTTP: upload a folder the adapters library saved (a new tenant, or
a new version of one's own), be served batched with everyone else exactly as the library computes
it alone, download it again; malformed and mismatched uploads get a 4xx that says why."""

import io
import json
import urllib.request
import zipfile

import pytest
import torch
from adapters import BnConfig, LoRAConfig

from hmi.archive import zip_files, zip_folder
from hmi.client import ApiError, Client
from hmi.dispatcher.serve import run_in_thread
from hmi.model.hplm import UpperLayers
from tests.helpers.adapters import HEADS, library_folder, library_head
from tests.helpers.servers import ADMIN, TRAIN, tiny_server

BN = BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=4, non_linearity="relu", leave_out=[0, 1])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import os

    os.environ["HMI_ADMIN_TOKEN"] = ADMIN
    server = tiny_server(tmp_path_factory.mktemp("home"))
    url, stop = run_in_thread(server)
    admin = Client(url, ADMIN)
    out = admin.create_tenant("trained", ["neg", "pos"], training_data={"train": TRAIN}, epochs=1)
    assert admin.wait_job(out["job"], 300)["state"] == "succeeded"
    yield {"admin": admin, "url": url, "server": server, "tmp": tmp_path_factory.mktemp("adapters")}
    stop()


def reference_scores(server, model, texts):
    """The library model alone on the server's PLOT-merged lower side: its upper layers with the
    adapter, then its one-layer head on [CLS], softmaxed."""
    enc = server.root.tokenizer(texts, padding=True, return_tensors="np")
    hidden = server.lookup.merged(enc["input_ids"], enc["attention_mask"])
    with torch.no_grad():
        out = UpperLayers(model.bert, 2)(hidden, torch.from_numpy(enc["attention_mask"]))
        return torch.softmax(model.heads["mine"][1](out[:, 0]), -1)


def test_an_uploaded_adapter_is_a_ready_tenant_served_as_the_library_serves_it(live):
    server, admin = live["server"], live["admin"]
    model, folder = library_folder(live["tmp"] / "a", LoRAConfig(r=4, alpha=8, attn_matrices=["q", "v"], leave_out=[0, 1]),
                                   bert=server.root.bert)
    out = admin.import_adapter("byo", zip_folder(folder))
    assert out["state"] == "ready" and out["token"].startswith("hmi_t") and out["spec"]["kind"] == "lora"
    texts = ["a wonderful film", "a dull and boring story that goes on"]
    got = Client(live["url"], out["token"]).infer("byo", texts)
    ref = reference_scores(server, model, texts)
    for g, r in zip(got, ref):
        assert g["label"] == ("neg", "pos", "meh")[int(r.argmax())]
        torch.testing.assert_close(torch.tensor([g["scores"][k] for k in ("neg", "pos", "meh")]), r, atol=1e-4, rtol=0)
    # One batch with another tenant's requests: the same answers.
    mixed = server.scheduler.infer([("trained", texts[0]), ("byo", texts[0]), ("trained", texts[1]), ("byo", texts[1])])
    assert [mixed[1]["scores"], mixed[3]["scores"]] == [got[0]["scores"], got[1]["scores"]]


def test_an_adapter_with_the_librarys_default_head_uploads_and_answers_like_the_library(live):
    """``add_classification_head(name, num_labels)`` (2 layers, tanh) saved with use_safetensors."""
    server, admin = live["server"], live["admin"]
    model, folder = library_folder(live["tmp"] / "default-head", BN, bert=server.root.bert, seed=4,
                                   head=HEADS["classification-default"])
    out = admin.import_adapter("deep-head", zip_folder(folder))
    assert out["spec"]["head_layers"] == 2 and out["spec"]["head_activation"] == "tanh"
    texts = ["a wonderful film", "a dull and boring story that goes on"]
    got = Client(live["url"], out["token"]).infer("deep-head", texts)
    enc = server.root.tokenizer(texts, padding=True, return_tensors="np")
    hidden = server.lookup.merged(enc["input_ids"], enc["attention_mask"])
    scores = torch.tensor([[g["scores"][k] for k in ("neg", "pos", "meh")] for g in got])
    with torch.no_grad():
        upper = UpperLayers(model.bert, 2)(hidden, torch.from_numpy(enc["attention_mask"]))
        torch.testing.assert_close(scores, torch.softmax(library_head(model)(upper[:, 0]), -1), atol=1e-3, rtol=0)
        for name, p in model.named_parameters():  # the library on the weights as the store keeps them (fp16)
            if ".mine." in name:
                p.copy_(p.half().float())
        upper = UpperLayers(model.bert, 2)(hidden, torch.from_numpy(enc["attention_mask"]))
        torch.testing.assert_close(scores, torch.softmax(library_head(model)(upper[:, 0]), -1), atol=1e-4, rtol=0)
    mixed = server.scheduler.infer([("trained", texts[0]), ("deep-head", texts[0]), ("deep-head", texts[1])])
    assert [mixed[1]["scores"], mixed[2]["scores"]] == [got[0]["scores"], got[1]["scores"]]
    job = admin.update_tenant("deep-head", training_data={"train": TRAIN}, epochs=1)["job"]  # it trains on, too
    assert admin.wait_job(job, 300)["state"] == "succeeded"
    assert admin.tenant("deep-head")["spec"]["head_layers"] == 2 and admin.infer("deep-head", texts) != got


def test_the_owner_downloads_the_adapter_in_the_library_format_and_it_reads_back(live):
    server, admin = live["server"], live["admin"]
    _, folder = library_folder(live["tmp"] / "b", BN, bert=server.root.bert, seed=2)
    token = admin.import_adapter("roundtrip", zip_folder(folder))["token"]
    data = Client(live["url"], token).export_adapter("roundtrip")
    names = {n.split("/")[-1] for n in zipfile.ZipFile(io.BytesIO(data)).namelist()}
    assert {"adapter_config.json", "adapter.safetensors", "head_config.json", "model_head.safetensors"} <= names
    with pytest.raises(ApiError) as err:
        Client(live["url"], token).export_adapter("trained")  # not its own
    assert err.value.status == 403
    before = admin.infer("roundtrip", ["great fun"])
    admin.delete_tenant("roundtrip")
    assert admin.import_adapter("roundtrip", data)["state"] == "ready"
    assert admin.infer("roundtrip", ["great fun"]) == before


def test_the_owner_replaces_its_adapter_and_the_new_one_serves_at_once(live):
    server, admin = live["server"], live["admin"]
    _, first = library_folder(live["tmp"] / "c1", BN, bert=server.root.bert, seed=3)
    model, second = library_folder(live["tmp"] / "c2", BN, bert=server.root.bert, seed=4)
    token = admin.import_adapter("swap", zip_folder(first))["token"]
    me = Client(live["url"], token)
    old = me.infer("swap", ["great fun"])[0]
    out = me.import_adapter("swap", zip_folder(second))
    assert "token" not in out and admin.tenant("swap")["version"] == 2
    new = me.infer("swap", ["great fun"])[0]
    assert new != old
    torch.testing.assert_close(torch.tensor(list(new["scores"].values())), reference_scores(server, model, ["great fun"])[0],
                               atol=1e-4, rtol=0)
    with pytest.raises(ApiError) as err:
        Client(live["url"], token).import_adapter("someone-else", zip_folder(second))  # creating needs the admin
    assert err.value.status == 403


def post(url, path, data, ctype="application/zip"):
    req = urllib.request.Request(url + path, data=data, method="POST")
    req.add_header("Content-Type", ctype)
    req.add_header("Authorization", f"Bearer {ADMIN}")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_malformed_and_mismatched_uploads_get_a_4xx_that_says_why_and_create_nothing(live):
    server, url = live["server"], live["url"]
    _, folder = library_folder(live["tmp"] / "d", BN, bert=server.root.bert)
    good = {p.name: p.read_bytes() for p in folder.iterdir()}
    cfg = json.loads(good["adapter_config.json"])
    swish = {**cfg, "config": {**cfg["config"], "non_linearity": "swish"}}
    cases = [
        (b"plainly not a zip", "application/zip", 422, "not_a_zip"),
        (zip_files(good, "f"), "application/json", 415, "unsupported_media_type"),
        (zip_files({**good, "pytorch_adapter.bin": b"pickle"}, "f"), "application/zip", 422, "pickle_refused"),
        (zip_files({**good, "adapter_config.json": json.dumps(swish).encode()}, "f"), "application/zip", 422,
         "unsupported_adapter"),
        (zip_files({**good, "adapter_config.json": json.dumps({**cfg, "hidden_size": 384}).encode()}, "f"),
         "application/zip", 422, "wrong_root"),
        (zip_files({k: v for k, v in good.items() if "head" not in k}, "f"), "application/zip", 422, "missing_head"),
    ]
    for data, ctype, status, code in cases:
        got, body = post(url, "/v1/tenants/bad-upload/adapter", data, ctype)
        assert (got, body["error"]["code"]) == (status, code), body
        assert server.registry.get("tenants", "bad-upload") is None
    got, body = post(url, "/v1/tenants/bad-upload/adapter?model=robot", zip_files(good, "f"))
    assert got == 400
    got, body = post(url, "/v1/tenants/trained/adapter?model=decoder", zip_files(good, "f"))
    assert (got, body["error"]["code"]) == (422, "wrong_tenant_kind")
    got, body = post(url, "/v1/tenants/new-gpt/adapter?model=decoder", zip_files(good, "f"))
    assert (got, body["error"]["code"]) == (404, "hgpt_disabled")


def test_the_openapi_document_describes_the_adapter_routes(live):
    with urllib.request.urlopen(live["url"] + "/openapi.json") as r:
        doc = json.loads(r.read())
    op = doc["paths"]["/v1/tenants/{tenant}/adapter"]
    assert "application/octet-stream" in op["post"]["requestBody"]["content"]
    assert "application/zip" in op["get"]["responses"]["200"]["content"]


def test_the_command_line_imports_a_saved_folder_and_exports_a_zip(live, tmp_path, capsys):
    from hmi.cli import main

    server = live["server"]
    _, folder = library_folder(live["tmp"] / "cli", BN, bert=server.root.bert, seed=5)
    common = ["--url", live["url"], "--token", ADMIN]
    assert main(["tenant", "import", "from-cli", str(folder), *common]) == 0
    assert '"token"' in capsys.readouterr().out
    out = tmp_path / "exported.zip"
    assert main(["tenant", "export", "from-cli", "-o", str(out), *common]) == 0
    assert zipfile.is_zipfile(out)
    assert main(["tenant", "import", "from-cli", str(out), *common]) == 0  # the owner's new version
    assert live["admin"].tenant("from-cli")["version"] == 2


def test_an_upload_may_ask_that_long_texts_be_cut_and_a_wrong_value_is_refused(live):
    server, admin = live["server"], live["admin"]
    _, folder = library_folder(live["tmp"] / "cut", BN, bert=server.root.bert, seed=5)
    out = admin.import_adapter("cuts", zip_folder(folder), truncate=True)
    assert admin.tenant("cuts")["truncate"] is True
    (answer,) = Client(live["url"], out["token"]).infer("cuts", ["word " * 300])
    assert answer["truncated"] is True
    req = urllib.request.Request(live["url"] + "/v1/tenants/cuts2/adapter?truncate=yes", data=zip_folder(folder),
                                 method="POST", headers={"Content-Type": "application/zip",
                                                         "Authorization": f"Bearer {ADMIN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["code"] == "invalid_truncate"
