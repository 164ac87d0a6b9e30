"""The encoder's upper layers as written once in ``hmi.model.encoder_layers``: with no adapter at
their sites they are the ``transformers`` layers themselves, and a caller's stand-ins for the
frozen projections are what runs."""

import torch

from hmi.model.encoder_layers import Sites, upper_forward
from hmi.model.root import extended_mask
from tests.conftest import tiny_bert


def reference_upper(bert, hidden, mask, first):
    """The library's own BertLayer stack from layer ``first`` on."""
    ext = extended_mask(mask, hidden.dtype)
    for layer in bert.encoder.layer[first:]:
        hidden = layer(hidden, attention_mask=ext)[0]
    return hidden


def test_the_upper_layers_without_adapters_are_the_libraries_bert_layers():
    bert = tiny_bert(layers=4)
    torch.manual_seed(1)
    hidden = torch.randn(3, 7, 32)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 2:] = 0
    with torch.no_grad():
        ours = upper_forward(bert.encoder.layer[2:], hidden, mask, Sites())
        ref = reference_upper(bert, hidden, mask, 2)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=1e-5)


class Counted(Sites):
    """Runs every projection through ``linear`` stand-ins that count their calls."""

    def __init__(self):
        self.calls = []

    def projections(self, li, sites, x, linears):
        self.calls += [(li, s) for s in sites]
        return super().projections(li, sites, x, linears)


def test_every_frozen_projection_of_every_layer_passes_through_the_sites():
    bert = tiny_bert(layers=4)
    sites = Counted()
    with torch.no_grad():
        upper_forward(bert.encoder.layer[2:], torch.randn(1, 4, 32), torch.ones(1, 4, dtype=torch.long), sites)
    assert sites.calls == [(li, s) for li in (0, 1) for s in ("q", "k", "v", "attn_out", "ffn_in", "ffn_out")]


def test_query_key_and_value_run_as_one_gemm_that_follows_a_changed_weight_and_the_attention_is_the_libraries():
    """Frozen q, k, v are fused into one GEMM (their weights concatenated once) and the attention
    runs fused (scaled_dot_product_attention); a weight changed in place is seen at the next call,
    and weights that train are never fused (their gradients stay the library's)."""
    bert = tiny_bert(layers=4)
    hidden, mask = torch.randn(2, 6, 32), torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    layers = bert.encoder.layer[2:]
    with torch.no_grad():
        upper_forward(layers, hidden, mask, Sites())  # the fused weights are made here
        layers[0].attention.self.key.weight.mul_(-2.0)
        layers[1].attention.self.value.bias.add_(0.5)
        ours = upper_forward(layers, hidden, mask, Sites())
        ref = reference_upper(bert, hidden, mask, 2)
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
    q = layers[0].attention.self.query
    q.weight.requires_grad_(True)
    upper_forward(layers, hidden, mask, Sites()).sum().backward()
    want = q.weight.grad.clone()
    q.weight.grad = None
    reference_upper(bert, hidden, mask, 2).sum().backward()
    torch.testing.assert_close(want, q.weight.grad, atol=1e-5, rtol=1e-5)
