import numpy as np
import pytest
import torch

from hmi.model.hplm import HPLM, Merge, WindowedEncoder, WindowedLower
from hmi.model.root import extended_mask
from tests.conftest import tiny_bert


def test_windowed_lower_runs_each_window_as_its_own_sequence(bert):
    """A window's representation equals the root's embeddings + lower layers on that 3-token
    sequence alone (local positions 0..2, mask id>0), gated."""
    lower = WindowedLower(bert, 2)
    win = torch.tensor([[0, 5, 9], [3, 5, 9], [4, 7, 0], [0, 8, 0]])
    rep = lower(win)
    for n in range(win.shape[0]):
        seq = win[n : n + 1]
        m = (seq > 0).long()
        m[0, 1] = 1
        h = bert.embeddings(input_ids=seq, position_ids=torch.arange(3)[None], token_type_ids=torch.zeros_like(seq))
        for layer in bert.encoder.layer[:2]:
            h = layer(h, attention_mask=extended_mask(m))[0]
        g = h * torch.sigmoid(lower.gate(h)) * m[..., None]
        torch.testing.assert_close(rep[n], g[0], atol=1e-5, rtol=1e-5)
    assert (rep[0, 0] == 0).all() and (rep[2, 2] == 0).all() and (rep[3, 0] == 0).all()


def mixed_windows(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` windows of every shape a PLOT holds, shuffled: tri-grams, bi-grams (0, c, r), text
    edges (l, c, 0) and uni-grams (0, c, 0). Shapes: -> (n, 3) int64."""
    g = np.random.default_rng(seed)
    win = g.integers(2, vocab, size=(n, 3))
    shape = g.integers(0, 4, size=n)
    win[(shape == 1) | (shape == 3), 0] = 0
    win[(shape == 2) | (shape == 3), 2] = 0
    return torch.from_numpy(win)


def masked_reference(lower: WindowedLower, windows: torch.Tensor) -> torch.Tensor:
    """Every window as a masked length-3 sequence, gated, +0.0 at absent tokens."""
    h = lower.masked_states(windows)
    return torch.where(lower.window_mask(windows).unsqueeze(-1), h * torch.sigmoid(lower.gate(h)), 0.0)


def family_model(family: str, tmp_path, real_root=None):
    """A tiny BERT, a tiny MPNet converted to the BERT layout (relative position bias), or the real MiniLM-L6."""
    if family == "mpnet":
        from hmi.model.convert import convert_checkpoint
        from hmi.model.root import load_bert
        from tests.helpers.checkpoints import tiny_checkpoint

        convert_checkpoint(tiny_checkpoint(tmp_path, "mpnet"), tmp_path / "bert")
        return load_bert(str(tmp_path / "bert"))
    return tiny_bert() if family == "bert" else real_root.bert


@pytest.mark.parametrize("family", ["bert", "mpnet", "minilm-l6"])
def test_windows_computed_on_their_present_tokens_alone_are_as_close_to_exact_as_the_masked_sequences(
        family, tmp_path, real_root):
    """Without gradients a window runs on its present tokens alone (the PLOT build's fast path).
    Dropping a masked token drops one term whose attention weight is exactly 0, so the two paths
    differ only in how the GEMM library orders and fuses the other terms (the same bits with some
    kernels, not with MKL's AVX2 ones on Intel): each is held to the fp64 run of the masked
    sequences, the fast path no further from it than twice the masked fp32 run's own rounding.
    BERT, MPNet's relative position bias and the real MiniLM-L6, at a build's chunk size and at
    an odd one."""
    import copy

    model = family_model(family, tmp_path, real_root)
    lower = WindowedLower(model, 3 if family == "minilm-l6" else 2).eval()
    torch.nn.init.normal_(lower.gate.weight, std=0.1)  # a gate that varies by row
    exact = copy.deepcopy(lower).double()
    for n in (2048, 333):
        windows = mixed_windows(model.config.vocab_size, n, seed=n)
        with torch.no_grad():
            fast = lower(windows).double()
            masked = masked_reference(lower, windows).double()
            truth = masked_reference(exact, windows)
        rounding = (masked - truth).abs().max().item()
        assert rounding > 0  # fp32 is not exact: the bound below is not vacuous
        assert (fast - truth).abs().max().item() <= 2 * rounding
        assert torch.equal(fast == 0, truth == 0)  # absent tokens +0.0 on both paths


def test_windows_computed_with_gradients_run_masked_as_calibration_trained_them(bert):
    lower = WindowedLower(bert, 2)
    windows = mixed_windows(bert.config.vocab_size, 64)
    rep = lower(windows)
    assert rep.requires_grad
    assert torch.equal(rep.detach().view(torch.int32), masked_reference(lower, windows).detach().view(torch.int32))


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_windows_trained_on_their_present_tokens_alone_give_the_masked_values_and_gradients(family, tmp_path):
    """``masked=False`` with gradients (the cheaper calibration recipes): the values and every
    parameter's gradient of the masked windows, for BERT and MPNet's relative position bias."""
    model = family_model(family, tmp_path)
    lower = WindowedLower(model, 2).double()
    torch.nn.init.normal_(lower.gate.weight, std=0.1)
    windows = mixed_windows(model.config.vocab_size, 300, seed=3)
    weights = torch.randn(300, 3, model.config.hidden_size, dtype=torch.float64)
    grads = {}
    for masked in (True, False):
        lower.zero_grad()
        rep = lower(windows, masked=masked)
        (rep * weights).sum().backward()
        grads[masked] = (rep.detach(), {n: p.grad.clone() for n, p in lower.named_parameters() if p.grad is not None})
    torch.testing.assert_close(grads[False][0], grads[True][0], rtol=1e-10, atol=1e-12)
    assert grads[False][1].keys() == grads[True][1].keys()
    for name, g in grads[True][1].items():
        torch.testing.assert_close(grads[False][1][name], g, rtol=1e-8, atol=1e-10, msg=name)


def test_gate_scales_rows_by_sigmoid_of_linear(bert):
    lower = WindowedLower(bert, 1)
    torch.nn.init.constant_(lower.gate.bias, -50.0)
    assert lower(torch.tensor([[1, 2, 3]])).abs().max() < 1e-12


def ref_merge(reps, mask, merge):
    B, T = mask.shape
    out = torch.zeros(B, T, reps.shape[-1])
    for b in range(B):
        for j in range(T):
            s = reps[b, j, 1].clone()
            if j + 1 < T:
                s += reps[b, j + 1, 0]
            if j > 0:
                s += reps[b, j - 1, 2]
            s += merge.position_embeddings.weight[j] + merge.token_type_embeddings.weight[0]
            out[b, j] = merge.LayerNorm(s)
    return out


def test_merge_matches_explicit_per_token_loop(bert):
    merge = Merge(bert)
    torch.manual_seed(1)
    reps = torch.randn(2, 5, 3, bert.config.hidden_size)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    reps[1, 3:] = 0
    torch.testing.assert_close(merge(reps), ref_merge(reps, mask, merge), atol=1e-5, rtol=1e-5)


def test_represent_batch_computes_each_window_once_and_matches_direct(bert):
    enc = WindowedEncoder(bert, 2)
    ids = torch.tensor([[1, 5, 6, 5, 6, 2], [1, 5, 6, 2, 0, 0]])
    mask = (ids > 0).long()
    reps = enc.represent_batch(ids, mask)
    from hmi.model.windows import encoder_windows

    win = torch.from_numpy(encoder_windows(ids.numpy(), mask.numpy()))
    direct = enc.lower(win.reshape(-1, 3)).reshape(2, 6, 3, -1) * mask[..., None, None]
    torch.testing.assert_close(reps, direct, atol=1e-5, rtol=1e-5)


def test_split_upper_layers_are_the_roots_own_modules(bert):
    enc = WindowedEncoder(bert, 2)
    hplm = HPLM(bert, enc)
    assert all(a is b for a, b in zip(hplm.upper.layers, bert.encoder.layer[2:]))
    for a, b in zip(hplm.upper.layers.parameters(), bert.encoder.layer[2:].parameters()):
        assert torch.equal(a, b)
    # the windowed copy of the lower layers is independent of the root's
    next(enc.lower.layers.parameters()).data.add_(1.0)
    assert not torch.equal(next(enc.lower.layers.parameters()), next(bert.encoder.layer[0].parameters()))


def test_upper_layers_equal_full_model_from_layer_l_low(bert):
    """Feeding the full model's layer-L_low states through the split's upper layers reproduces
    the full model's output, so the split itself loses nothing."""
    enc = WindowedEncoder(bert, 2)
    hplm = HPLM(bert, enc)
    ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]])
    mask = (ids > 0).long()
    hs = bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    out = hplm.upper(hs[2], mask)
    m = mask.bool()
    torch.testing.assert_close(out[m], hs[-1][m], atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_token_outputs(bert):
    hplm = HPLM(bert, WindowedEncoder(bert, 2))
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    _, a = hplm(ids, torch.ones_like(ids))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    _, b = hplm(padded, (padded > 0).long())
    torch.testing.assert_close(a[0], b[0, :5], atol=1e-5, rtol=1e-5)


def test_as_numpy_ids_pads_and_masks():
    from hmi.model.hplm import as_numpy_ids

    ids, mask = as_numpy_ids([[1, 2, 3], [4]])
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert np.asarray(as_numpy_ids([[1, 2, 3]], max_len=2)[0]).shape == (1, 2)
