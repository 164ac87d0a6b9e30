"""``POST /v1/embeddings`` and ``GET /v1/models`` through the official ``openai`` client and raw
HTTP, against a live server (tiny root, real tokenizer, real LMDB, tenants trained by real jobs)."""

import base64

import numpy as np
import openai
import pytest
import torch

from hmi.model.hplm import as_numpy_ids
from hmi.model.root import SentencePooling, extended_mask
from tests.helpers.servers import ADMIN, TRAIN, raw  # noqa: F401 - live is a fixture

TEXTS = ["a great film with wonderful acting", "the bank raised its rates", "boring"]


def client(live, token=ADMIN):
    return openai.OpenAI(base_url=live["url"] + "/v1", api_key=token, max_retries=0)


def reference(server, texts, tenant=None):
    """The slow, obvious embedding: the merged PLOT output through the root's own Hugging Face
    upper layers (or the tenant's fine-tune model), mean over the real tokens, L2-normalized."""
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.tenant_model import TenantModel

    bert, l_low = server.root.bert, server.root.spec.l_low
    ids, mask = as_numpy_ids(server.root.tokenizer(texts)["input_ids"])
    mask_t = torch.from_numpy(mask)
    with torch.no_grad():
        h = server.lookup.merged(ids, mask)
        if tenant is None:
            for layer in bert.encoder.layer[l_low:]:
                h = layer(h, extended_mask(mask_t))[0]
        else:
            spec = AdapterSpec.from_dict(server.registry.get("tenants", tenant)["spec"])
            layers = torch.nn.ModuleList(bert.encoder.layer[l_low:])
            model = TenantModel(layers, spec, server.store.load(tenant), bert.config.hidden_size,
                                bert.config.intermediate_size)
            h = model.upper(h, mask_t)
    return SentencePooling("mean", True)(h, mask_t).numpy(), mask.sum(1).tolist()


def test_the_openai_client_embeds_with_the_root_as_the_pooled_upper_layers_compute(live):
    want, tokens = reference(live["server"], TEXTS)
    out = client(live).embeddings.create(model="root", input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == "root"
    assert np.array([d.embedding for d in out.data]) == pytest.approx(want, abs=2e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(tokens)
    floats = client(live).embeddings.create(model="root", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in out.data]


def test_base64_embeddings_are_the_float32_values_little_endian(live):
    _, body = raw(live["url"], "POST", "/v1/embeddings", {"model": "root", "input": TEXTS[0], "encoding_format": "base64"})
    _, floats = raw(live["url"], "POST", "/v1/embeddings", {"model": "root", "input": TEXTS[0]})
    got = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert got.tolist() == pytest.approx(floats["data"][0]["embedding"], abs=0)
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_a_tenants_embeddings_carry_its_adapter_and_any_token_embeds_with_the_root(live):
    alpha = live["alpha"].token
    want, _ = reference(live["server"], TEXTS, tenant="alpha")
    out = client(live, alpha).embeddings.create(model="alpha", input=TEXTS)
    assert np.array([d.embedding for d in out.data]) == pytest.approx(want, abs=2e-5)
    root = client(live, alpha).embeddings.create(model="root", input=TEXTS)
    assert np.array([d.embedding for d in root.data]) == pytest.approx(reference(live["server"], TEXTS)[0], abs=2e-5)
    tagger = client(live, live["beta"].token).embeddings.create(model="beta", input="the dog runs")
    assert len(tagger.data[0].embedding) == live["server"].root.bert.config.hidden_size


def test_the_width_is_honoured_when_asked_for_and_refused_otherwise(live):
    width = live["server"].root.bert.config.hidden_size
    assert len(client(live).embeddings.create(model="root", input="hi", dimensions=width).data[0].embedding) == width
    with pytest.raises(openai.UnprocessableEntityError, match="dimensions"):
        client(live).embeddings.create(model="root", input="hi", dimensions=8)


@pytest.mark.parametrize("body,token,status,code", [
    ({"model": "beta", "input": "hi"}, "alpha", 403, "forbidden"),
    ({"model": "nobody", "input": "hi"}, ADMIN, 404, "unknown_tenant"),
    ({"model": "root", "input": []}, ADMIN, 400, "empty_input"),
    ({"model": "root", "input": ["hi"] * 2049}, ADMIN, 413, "too_many_inputs"),
    ({"model": "root", "input": [1, 2, 3]}, ADMIN, 400, "invalid_type"),
    ({"model": "root", "input": ["hi", " "]}, ADMIN, 400, "empty_input"),
    ({"model": "root", "input": "hi", "encoding_format": "int8"}, ADMIN, 400, "invalid_value"),
    ({"model": "root"}, ADMIN, 400, "missing_field"),
    ({"model": "root", "input": "word " * 300}, ADMIN, 413, "input_too_long"),
    ({"model": "Root", "input": "hi"}, ADMIN, 400, "invalid_name"),
])
def test_bad_embedding_requests_get_a_4xx_naming_the_problem(live, body, token, status, code):
    token = live[token].token if token in ("alpha", "beta") else token
    got, out = raw(live["url"], "POST", "/v1/embeddings", body, token=token)
    assert (got, out["error"]["code"]) == (status, code), out


def test_long_inputs_are_cut_when_asked_and_embeddings_need_a_token(live):
    got, out = raw(live["url"], "POST", "/v1/embeddings", {"model": "root", "input": "word " * 300, "truncate": True})
    assert got == 200 and out["usage"]["prompt_tokens"] == live["server"].cfg.max_len
    got, out = raw(live["url"], "POST", "/v1/embeddings", {"model": "root", "input": "hi"}, token=None)
    assert got == 401


def test_the_model_list_shows_the_root_and_the_tenants_a_token_may_use(live):
    assert {m.id for m in client(live, live["alpha"].token).models.list()} == {"root", "alpha"}
    assert {"root", "alpha", "beta"} <= {m.id for m in client(live).models.list()}


def test_no_tenant_may_be_named_root(live):
    got, out = raw(live["url"], "POST", "/v1/tenants", {"name": "root", "task": {"labels": ["neg", "pos"]},
                                                          "training_data": {"train": TRAIN}})
    assert got == 400 and "root" in out["error"]["message"]
    got, out = raw(live["url"], "POST", "/v1/tenants", {"name": "root", "model": "private"})
    assert got == 400
