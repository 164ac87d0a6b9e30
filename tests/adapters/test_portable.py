"""Bring-your-own adapters: the adapters library's saved folder (and PEFT's LoRA folder) read into
canonical weights that the batched path serves exactly as the library (or PEFT) computes them;
written back in a form the library loads; and every malformed or foreign upload refused with a
reason."""

import json

import pytest
import torch
from adapters import BertAdapterModel, BnConfig, IA3Config, LoRAConfig

from hmi.adapters.batched import Group, batched_heads, upper_forward
from hmi.adapters.pool import SlotPool
from hmi.adapters.portable import PortableError, RootShape, read_decoder, read_encoder, write_decoder, write_encoder
from hmi.archive import ArchiveError, unzip, zip_files, zip_folder
from hmi.errors import Kind
from hmi.model.hplm import UpperLayers
from tests.conftest import tiny_bert
from tests.helpers.adapters import HEADS, L_LOW, LAYERS, H, library_folder, library_head

SHAPE = RootShape("bert", H, LAYERS, L_LOW, H, "tiny")


def served_logits(spec, weights, hidden, mask):
    """The batched path's logits: (B, C) for classification, (B, T, C) for tagging."""
    pool = SlotPool.for_spec(spec, 2, LAYERS - L_LOW, H, 2 * H, max_labels=8)
    pool.write(0, weights)
    b = hidden.shape[0]
    groups = [Group(torch.arange(b), torch.zeros(b, dtype=torch.long), pool, True)]
    out = upper_forward(torch.nn.ModuleList(BERT.encoder.layer[L_LOW:]), hidden, mask, groups)
    tagging = torch.tensor([spec.head == "tagging"] * b)
    mean = torch.tensor([spec.pooling == "mean"] * b)
    logits = batched_heads(out, groups, tagging, mask, mean)[..., :spec.num_labels]
    return logits if spec.head == "tagging" else logits[:, 0]


BERT = tiny_bert(layers=LAYERS, hidden=H)


@pytest.mark.parametrize("config", [
    BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=4, non_linearity="relu", leave_out=[0, 1]),
    LoRAConfig(r=4, alpha=8, attn_matrices=["q", "v"], leave_out=[0, 1]),
    LoRAConfig(r=4, alpha=8, attn_matrices=["q", "k", "v"], intermediate_lora=True, output_lora=True, leave_out=[0, 1]),
    LoRAConfig(r=2, alpha=4, selfattn_lora=False, output_lora=True, leave_out=[0, 1]),
    IA3Config(leave_out=[0, 1]),
], ids=["bottleneck", "lora", "lora-every-linear-layer", "lora-ffn-out-only", "ia3"])
def test_a_library_saved_adapter_is_served_as_the_library_computes_it(tmp_path, config):
    model, folder = library_folder(tmp_path, config)
    spec, weights = read_encoder(unzip(zip_folder(folder), 2**24), SHAPE)
    assert spec.labels == ("neg", "pos", "meh") and spec.head == "classification"
    torch.manual_seed(3)
    hidden, mask = torch.randn(2, 7, H), torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        ref_out = UpperLayers(model.bert, L_LOW)(hidden, mask)
        ref = model.heads["mine"][1](ref_out[:, 0])  # the library's one-layer head reads [CLS]
        got = served_logits(spec, weights, hidden, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def loaded_in_the_library(files: dict[str, bytes], folder):
    """A library model on the tiny root with a written adapter folder loaded (adapter and head); its name."""
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    again = BertAdapterModel(BERT.config)
    again.bert.load_state_dict(BERT.state_dict(), strict=False)
    name = again.load_adapter(str(folder), set_active=True, use_safetensors=True)
    again.load_head(str(folder), use_safetensors=True)
    return again.eval(), name


@pytest.mark.parametrize("config", [
    LoRAConfig(r=4, alpha=8, attn_matrices=["q", "v"], leave_out=[0, 1]),
    LoRAConfig(r=4, alpha=8, attn_matrices=["q", "k", "v"], intermediate_lora=True, output_lora=True, leave_out=[0, 1]),
], ids=["lora-q-v", "lora-every-linear-layer"])
def test_written_adapters_load_in_the_library_and_compute_the_same(tmp_path, config):
    model, folder = library_folder(tmp_path, config)
    spec, weights = read_encoder(unzip(zip_folder(folder), 2**24), SHAPE)
    files = write_encoder(spec, weights, SHAPE, "roundtrip")
    again, name = loaded_in_the_library(files, tmp_path / "exported")
    torch.manual_seed(4)
    hidden, mask = torch.randn(1, 5, H), torch.ones(1, 5, dtype=torch.long)
    with torch.no_grad():
        ref = again.heads[name][1](UpperLayers(again.bert, L_LOW)(hidden, mask)[:, 0])
        torch.testing.assert_close(served_logits(spec, weights, hidden, mask), ref, atol=1e-4, rtol=1e-4)
    spec2, weights2 = read_encoder(files, SHAPE)
    assert spec2 == spec and all(torch.equal(weights[k], weights2[k]) for k in weights)


@pytest.mark.parametrize("head", list(HEADS))
def test_the_librarys_default_and_deeper_heads_are_served_as_the_library_computes_them(tmp_path, head):
    model, folder = library_folder(tmp_path, LoRAConfig(r=4, alpha=8, leave_out=[0, 1]), head=HEADS[head])
    spec, weights = read_encoder(unzip(zip_folder(folder), 2**24), SHAPE)
    layers = {"classification-default": 2, "classification-3-relu": 3}.get(head, 2)
    assert (spec.head, spec.head_layers) == (head.split("-")[0], layers)
    torch.manual_seed(3)
    hidden, mask = torch.randn(2, 7, H), torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        out = UpperLayers(model.bert, L_LOW)(hidden, mask)
        ref = library_head(model)(out if spec.head == "tagging" else out[:, 0])
        got = served_logits(spec, weights, hidden, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    files = write_encoder(spec, weights, SHAPE, "again")  # and back: the library loads the same head
    again, _ = loaded_in_the_library(files, tmp_path / "exported")
    with torch.no_grad():
        torch.testing.assert_close(library_head(again, "again")(out if spec.head == "tagging" else out[:, 0]), ref)
    assert read_encoder(files, SHAPE)[0] == spec


def refused(files, code, match=""):
    with pytest.raises(PortableError) as err:
        read_encoder(files, SHAPE)
    assert err.value.code == code and match in err.value.message, err.value.message
    return err.value


def saved(tmp_path, config=None, **kw):
    config = config or BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=4, non_linearity="relu",
                                leave_out=[0, 1])
    return unzip(zip_folder(library_folder(tmp_path, config, **kw)[1]), 2**24)


def test_an_adapter_the_server_cannot_batch_is_refused_naming_the_difference(tmp_path):
    files = saved(tmp_path, BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=4, non_linearity="swish",
                                     leave_out=[0, 1]))
    refused(files, "unsupported_adapter", "non_linearity='swish'")


@pytest.mark.parametrize("config", [
    BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=4, non_linearity="relu"),
    LoRAConfig(r=4, alpha=8, attn_matrices=["q", "v"]),
    IA3Config(),
], ids=["bottleneck", "lora", "ia3"])
def test_an_adapter_in_every_layer_is_read_whole_and_served_on_the_full_root_as_the_library_computes_it(tmp_path, config):
    """Weights in the lower layers make a ``whole`` tenant: every layer runs on the text with the
    adapter (the root's embeddings in, no PLOT), as the library's model computes; written back,
    the library loads the same adapter."""
    model, folder = library_folder(tmp_path, config)
    spec, weights = read_encoder(unzip(zip_folder(folder), 2**24), SHAPE)
    assert spec.whole and "layers.0." + next(iter(weights)).split(".", 2)[2] in weights
    pool = SlotPool.for_spec(spec, 2, LAYERS, H, 2 * H, max_labels=8)
    pool.write(0, weights)
    ids, mask = torch.tensor([[1, 17, 42, 99, 5, 2]]), torch.ones(1, 6, dtype=torch.long)
    groups = [Group(torch.arange(1), torch.zeros(1, dtype=torch.long), pool, True)]
    with torch.no_grad():
        hidden = BERT.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))
        out = upper_forward(BERT.encoder.layer, hidden, mask, groups)
        got = batched_heads(out, groups, torch.tensor([False]), mask, torch.tensor([False]))[:, 0, :spec.num_labels]
        ref = model.heads["mine"][1](model.bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    files = write_encoder(spec, weights, SHAPE, "again")
    spec2, weights2 = read_encoder(files, SHAPE)
    assert spec2 == spec and all(torch.equal(weights[k], weights2[k]) for k in weights)


def test_weights_in_some_of_the_lower_layers_are_refused(tmp_path):
    files = saved(tmp_path, BnConfig(mh_adapter=True, output_adapter=False, reduction_factor=4, non_linearity="relu",
                                     leave_out=[0]))
    refused(files, "lower_layer_weights", "leave_out=[0, 1]")


def test_an_adapter_of_another_root_is_refused(tmp_path):
    files = saved(tmp_path)
    cfg = json.loads(files["adapter_config.json"])
    refused({**files, "adapter_config.json": json.dumps({**cfg, "hidden_size": 768}).encode()}, "wrong_root", "768")


def test_missing_or_unsupported_heads_are_refused(tmp_path):
    files = saved(tmp_path)
    refused({k: v for k, v in files.items() if not k.startswith(("head", "model_head"))}, "missing_head")
    files = saved(tmp_path / "two", head_layers=2)
    cfg = json.loads(files["head_config.json"])
    for change in ({"activation_function": "softsign"}, {"layers": 9}, {"use_pooler": True},
                   {"head_type": "multilabel_classification"}):
        head_cfg = json.dumps({**cfg, "config": {**cfg["config"], **change}}).encode()
        refused({**files, "head_config.json": head_cfg}, "unsupported_head")
    refused({**files, "head_config.json": json.dumps({**cfg, "config": {**cfg["config"], "layers": 3}}).encode()},
            "unsupported_head", "3 linear layer(s)")


def test_damaged_files_are_refused(tmp_path):
    files = saved(tmp_path)
    refused({**files, "adapter.safetensors": b"not safetensors"}, "bad_file", "adapter.safetensors")
    refused({**files, "adapter_config.json": b"{"}, "bad_file", "adapter_config.json")
    refused({k: v for k, v in files.items() if k != "adapter_config.json"}, "missing_file", "adapter_config.json")


def test_archives_refuse_pickle_bombs_and_non_zips():
    with pytest.raises(ArchiveError, match="pickle") as err:
        unzip(zip_files({"adapter_config.json": b"{}", "pytorch_adapter.bin": b"x"}, "f"), 2**20)
    assert err.value.code == "pickle_refused"
    with pytest.raises(ArchiveError) as err:
        unzip(b"PK no zip", 2**20)
    assert err.value.code == "not_a_zip"
    with pytest.raises(ArchiveError) as err:
        unzip(zip_files({"adapter.safetensors": b"\0" * 4096}, "f"), 1000)
    assert err.value.kind == Kind.TOO_LARGE
    with pytest.raises(ArchiveError) as err:
        unzip(zip_files({"a/b/c.json": b"{}"}, "f"), 1000)
    assert err.value.code == "bad_archive"


# -- decoder tenants: PEFT ---------------------------------------------------------------------------
def test_a_peft_lora_reads_into_the_canonical_update_peft_computes(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    base = LlamaForCausalLM(cfg).eval()
    plain = {i: (base.model.layers[i].self_attn.q_proj.weight.clone(), base.model.layers[i].self_attn.v_proj.weight.clone())
             for i in range(5)}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            layers_to_transform=[2, 3, 4], lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape))
    model.save_pretrained(str(tmp_path / "peft"))
    shape = RootShape("llama", 32, 5, 2, 16, "tiny")
    spec, w = read_decoder(unzip(zip_folder(tmp_path / "peft"), 2**24), shape, rank=4)
    assert spec.is_decoder and spec.rank == 4 and spec.alpha == 8
    x = torch.randn(3, 32)
    for li in range(3):
        layer = model.base_model.model.model.layers[li + 2].self_attn
        for proj, pw in (("q", plain[li + 2][0]), ("v", plain[li + 2][1])):
            want = getattr(layer, f"{proj}_proj")(x)
            a, b = w[f"layers.{li}.lora.{proj}_A"], w[f"layers.{li}.lora.{proj}_B"]
            torch.testing.assert_close(x @ pw.t() + spec.scaling * x @ a.t() @ b.t(), want, atol=1e-5, rtol=1e-5)
    again = read_decoder(write_decoder(spec, w, shape), shape, rank=4)
    assert again[0] == spec and all(torch.equal(again[1][k], w[k]) for k in w)
    with pytest.raises(PortableError, match="this server batches rank 8"):
        read_decoder(unzip(zip_folder(tmp_path / "peft"), 2**24), shape, rank=8)
