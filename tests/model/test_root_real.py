"""Integration tests on the real packaged MiniLM-L6, loaded offline."""

import os

import torch

from hmi.model.hplm import HPLM
from hmi.model.root import full_forward, load_bert, packaged_root_dir


def test_packaged_root_loads_offline():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    d = packaged_root_dir()
    assert (d / "model.safetensors").exists() and (d / "tokenizer.json").exists()


def test_real_root_split_is_exact_and_upper_layers_bit_identical(real_root):
    fresh = load_bert(real_root.spec.model_dir)
    hplm = HPLM(real_root.bert, real_root.windowed)
    for a, b in zip(hplm.upper.parameters(), fresh.encoder.layer[3:].parameters()):
        assert torch.equal(a, b)
    enc = real_root.tokenizer(["HMI serves thousands of tenants on one machine."], return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert ids[0, 0].item() == real_root.tokenizer.cls_token_id
    with torch.no_grad():
        hs = full_forward(real_root.bert, ids, mask)
        torch.testing.assert_close(hplm.upper(hs[3], mask), hs[-1], atol=1e-5, rtol=1e-5)
        merged, out = hplm(ids, mask)
    assert merged.shape == out.shape == (1, ids.shape[1], 384)
