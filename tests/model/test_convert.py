"""Roots of other families in BERT's layout: a tiny random MPNet and RoBERTa (with a real WordPiece
tokenizer built by the ``tokenizers`` library, MPNet's special-token layout) against the
``transformers`` originals; the real all-mpnet-base-v2 where it is prepared."""

import json

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hmi.model.convert import CheckpointError, convert_checkpoint
from hmi.model.hplm import WindowedLower
from hmi.model.root import full_forward, load_bert, load_tokenizer
from tests.helpers.checkpoints import TEXTS, tiny_checkpoint  # noqa: F401


@pytest.mark.parametrize("family", ["mpnet", "roberta"])
def test_converted_root_computes_what_the_original_computes(tmp_path, family):
    src = tiny_checkpoint(tmp_path, family)
    convert_checkpoint(src, tmp_path / "bert")
    orig, otok = AutoModel.from_pretrained(src).eval(), AutoTokenizer.from_pretrained(src)
    bert, ntok = load_bert(str(tmp_path / "bert")), load_tokenizer(str(tmp_path / "bert"))
    o = otok(TEXTS, padding=True, return_tensors="pt")
    n = ntok(TEXTS, padding=True, return_tensors="pt")
    swapped = o["input_ids"].clone()
    swapped[o["input_ids"] == 0], swapped[o["input_ids"] == 1] = 1, 0
    assert torch.equal(n["input_ids"], swapped)  # id 0 is free for "no token", as windows need
    assert (ntok.pad_token_id, ntok.cls_token_id) == (0, 1)
    assert (bert.relative_bias is not None) == (family == "mpnet")
    with torch.no_grad():
        ref = orig(**o, output_hidden_states=True).hidden_states
        ours = full_forward(bert, n["input_ids"], n["attention_mask"])
    m = o["attention_mask"].bool()
    for layer in range(5):
        torch.testing.assert_close(ours[layer][m], ref[layer][m], atol=1e-5, rtol=1e-4, msg=f"layer {layer}")


def test_mpnet_windows_are_the_original_model_on_three_tokens_alone(tmp_path):
    """Local positions 0..2 of a window are MPNet's positions 2..4, and the relative position
    bias is the one of a 3-token sequence."""
    src = tiny_checkpoint(tmp_path, "mpnet")
    convert_checkpoint(src, tmp_path / "bert")
    orig = AutoModel.from_pretrained(src).eval()
    lower = WindowedLower(load_bert(str(tmp_path / "bert")), 2)
    windows = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])  # our ids (above 1: unchanged by the swap)
    with torch.no_grad():
        ref = orig(input_ids=windows, attention_mask=torch.ones_like(windows), output_hidden_states=True).hidden_states[2]
        torch.testing.assert_close(lower.states(windows), ref, atol=1e-5, rtol=1e-4)


def test_a_folder_of_another_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="gpt2"):
        convert_checkpoint(tmp_path, tmp_path / "out")


def test_a_converted_root_keeps_the_sentence_pooling_of_its_checkpoint(tmp_path):
    from hmi.model.root import SentencePooling, sentence_pooling
    from tests.helpers.checkpoints import st_folder

    src = tiny_checkpoint(tmp_path, "mpnet")
    st_folder(src, ("pooling_mode_cls_token",), normalize=False)
    convert_checkpoint(src, tmp_path / "out")
    assert sentence_pooling(tmp_path / "out") == SentencePooling("cls", False)
