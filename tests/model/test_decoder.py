import numpy as np
import pytest
import torch

from hmi.model.decoder import DecoderRoot, full_hidden, perplexity, upper_logits, window_states, windowed_hidden
from tests.helpers.decoders import tiny_decoder  # noqa: F401


def reference_window(root: DecoderRoot, window: list[int]) -> torch.Tensor:
    """The library model run on the window's present tokens alone (leading 0 = no token)."""
    toks = [t for i, t in enumerate(window) if t != 0 or i == 2]
    while toks[0] == 0 and len(toks) > 1:
        toks = toks[1:]
    out = root.model.model(input_ids=torch.tensor([toks]), output_hidden_states=True)
    return out.hidden_states[root.l_low][0, -1]


def test_window_states_equal_the_library_model_run_on_each_window_alone():
    root = tiny_decoder()
    windows = torch.tensor([[5, 6, 7], [0, 6, 7], [0, 0, 7], [9, 9, 9], [3, 1, 4]])
    got = window_states(root, windows)
    for i, w in enumerate(windows.tolist()):
        assert torch.allclose(got[i], reference_window(root, w), atol=1e-5), w


def test_window_states_do_not_depend_on_where_the_window_occurs():
    root = tiny_decoder()
    ids = np.array([[11, 12, 13, 14, 12, 13, 14, 20]])
    h = windowed_hidden(root, ids, np.ones_like(ids))
    assert torch.allclose(h[0, 3], h[0, 6], atol=1e-6)  # window (12, 13, 14) twice
    assert not torch.allclose(h[0, 3], h[0, 7], atol=1e-3)


def test_windowed_hidden_scatters_each_position_its_causal_window():
    root = tiny_decoder()
    ids = np.array([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    h = windowed_hidden(root, ids, mask)
    assert torch.allclose(h[0, 4], reference_window(root, [13, 14, 15]), atol=1e-5)
    assert torch.allclose(h[1, 0], reference_window(root, [0, 0, 21]), atol=1e-5)
    assert torch.allclose(h[1, 1], reference_window(root, [0, 21, 22]), atol=1e-5)
    assert torch.count_nonzero(h[1, 3:]) == 0


def test_split_forward_equals_the_library_model_with_full_context():
    root = tiny_decoder()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [4, 3, 2, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    want = root.model(input_ids=ids, attention_mask=mask).logits
    got = upper_logits(root, full_hidden(root, ids, mask, root.l_low), mask)
    m = mask.bool()
    assert torch.allclose(got[m], want[m], atol=1e-4)


@pytest.fixture(scope="module")
def smollm(decoder_copy_home):
    from hmi.model.decoder import load_decoder

    return load_decoder(l_low=4, home=decoder_copy_home)  # from the run's fp32 copy


def test_real_decoder_split_forward_matches_the_library_and_windows_match_per_window_runs(smollm):

    text = "The committee approved the budget on Tuesday after a long debate."
    enc = smollm.tokenizer([text], return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    want = smollm.model(input_ids=ids, attention_mask=mask).logits
    got = upper_logits(smollm, full_hidden(smollm, ids, mask, smollm.l_low), mask)
    assert torch.allclose(got, want, atol=1e-3)
    h = windowed_hidden(smollm, ids.numpy(), mask.numpy())
    for i in (0, 1, 5):
        w = [int(ids[0, j]) if j >= 0 else 0 for j in (i - 2, i - 1, i)]
        assert torch.allclose(h[0, i], reference_window(smollm, w), atol=1e-3)
    texts = [text, "Shares of the bank rose sharply after it reported record profits for the third quarter, beating "
                   "forecasts. Analysts said the results showed that the new strategy was working.",
             "The film is a warm, funny and beautifully acted story about two brothers who meet again after years."]
    assert 1.0 < perplexity(smollm, texts, "full") < perplexity(smollm, texts, "windowed")


def test_a_split_outside_the_decoder_is_refused(decoder_copy_home):
    from hmi.model.decoder import load_decoder

    for bad in (0, 30):
        with pytest.raises(ValueError, match="l_low"):
            load_decoder(l_low=bad, home=decoder_copy_home)


def test_causal_plot_lookup_equals_computing_the_causal_windows(tmp_path):
    from hmi.model.decoder import CausalLower
    from hmi.plot.build import Selection, build, count_ngrams, plan_keys
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.store import PlotMeta, PlotStore

    root = tiny_decoder()
    lower = CausalLower(root)
    corpus = [[5, 6, 7, 8, 9], [7, 8, 9, 10, 11, 12], [40, 41, 42]]
    keys, counts = count_ngrams(corpus, causal=True)
    plan = plan_keys(keys, counts, Selection("all"), 100, causal=True)
    meta = PlotMeta(root.artifact_id, root.l_low, 32, n=1, kind="causal")
    store = PlotStore(tmp_path / "plot", meta=meta, readonly=False)
    build(store, lower, plan, progress=False)
    ids = np.array([[7, 8, 9, 10, 11], [40, 41, 42, 0, 0]])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    want = windowed_hidden(root, ids, mask)
    lookup = PlotLookup([PlotVersion("root", store, lower)], policy="backoff")
    got = lookup.merged(ids, mask)
    # (7, 8) at a text start is the window (0, 7, 8): stored as the bi-gram of (6, 7, 8)
    assert torch.allclose(got, want, atol=2e-3)
    assert lookup.hits["zeros"] == 0
    unseen = np.array([[50, 51, 52, 53]])
    exact = PlotLookup([PlotVersion("root", store, lower)], policy="compute").merged(unseen, np.ones_like(unseen))
    assert torch.allclose(exact, windowed_hidden(root, unseen, np.ones_like(unseen)), atol=2e-3)
    backoff = PlotLookup([PlotVersion("root", store, lower)], policy="backoff")
    backoff.merged(unseen, np.ones_like(unseen))
    assert backoff.hits["unigram:root"] > 0


def test_the_kept_fp32_copy_of_the_decoder_loads_the_same_weights_and_tokenizer_as_its_gguf(decoder_copy_home):
    from hmi.model.decoder import _from_gguf, dequantized_dir, load_decoder, packaged_decoder_file
    from hmi.model.kernels import use_onednn_linear

    path = packaged_decoder_file()
    assert (dequantized_dir(path, decoder_copy_home) / "config.json").exists()  # kept by the run's first load_decoder
    kept = load_decoder(2, home=decoder_copy_home)  # reads the copy
    reference, reference_tok = _from_gguf(path)  # dequantized from the GGUF here
    want, got = reference.state_dict(), kept.model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert kept.model.lm_head.weight.data_ptr() == kept.model.model.embed_tokens.weight.data_ptr()  # tied
    texts = ["The court held that the contract was void.", "<|im_start|>user\nhi<|im_end|>", "naïve café, 2024"]
    reference_tok.add_bos_token = False
    for t in texts:
        assert kept.tokenizer(t)["input_ids"] == reference_tok(t)["input_ids"]
    assert kept.tokenizer.eos_token == "<|im_end|>" and kept.tokenizer.pad_token == (reference_tok.pad_token or "<|endoftext|>")
    use_onednn_linear(reference.eval())  # as load_decoder runs both
    ids = kept.tokenizer(texts[0], return_tensors="pt")["input_ids"]
    assert torch.equal(kept.model(ids).logits, reference(ids).logits)


def test_the_logit_distillation_loss_is_the_kl_of_the_library_models_next_token_distributions():
    """``logit_kl`` against a slow reference: the library model run on the split states with and
    without the replaced ones, KL summed token by token; zero when the windows reproduce the
    states, and its gradient reaches only the windowed states."""
    from hmi.training.calibrate_decoder import logit_kl

    root = tiny_decoder()
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]])
    mask = (ids != 0).long()
    target = full_hidden(root, ids, mask, root.l_low)
    m = mask.bool()
    assert float(logit_kl(root, target[m].clone(), target, mask)) == pytest.approx(0.0, abs=1e-6)
    pred = (target[m] + 0.3 * torch.randn(int(m.sum()), 32, generator=torch.Generator().manual_seed(0)))
    pred.requires_grad_(True)
    got = logit_kl(root, pred, target, mask)
    h = target.clone()
    h[m] = pred.detach()
    kl = 0.0
    for b, t in m.nonzero().tolist():  # one real token at a time
        p = torch.log_softmax(upper_logits(root, target, mask)[b, t], -1)
        q = torch.log_softmax(upper_logits(root, h, mask)[b, t], -1)
        kl += float((p.exp() * (p - q)).sum())
    assert got.item() == pytest.approx(kl / int(m.sum()), rel=1e-4) and got.item() > 0
    got.backward()
    assert pred.grad is not None and pred.grad.abs().sum() > 0
    assert all(p.grad is None for p in root.model.parameters())  # the upper layers stay frozen


def test_perplexity_as_served_through_a_computing_lookup_equals_the_windowed_one_and_back_off_differs(smollm, tmp_path):
    from hmi.model.decoder import CausalLower
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.store import PlotMeta, PlotStore

    texts = ["The court held that the contract was void because one party had not signed it.",
             "Shares of the bank rose sharply after it reported record profits for the third quarter."]
    store = PlotStore(tmp_path / "causal", meta=PlotMeta("test", smollm.l_low, smollm.hidden_size, kind="causal"),
                      readonly=False)  # empty: every tri-gram is a miss
    windowed = perplexity(smollm, texts, "windowed")
    served = {policy: perplexity(smollm, texts, "served",
                                 served=PlotLookup([PlotVersion("root", store, CausalLower(smollm))], policy).merged)
              for policy in ("compute", "backoff")}
    assert served["compute"] == pytest.approx(windowed, rel=1e-4)
    assert abs(served["backoff"] - windowed) > 1e-2 * windowed
