"""The baselines the benchmarks compare HMI with (hBERT-adapter's full-context lower layers, the
frozen root with a head per tenant) run a batch of long and short texts in the groups of similar
length that the served upper layers run it in, and give what one padded forward pass gives."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_tenants import FullContextLower, SharedRoot, length_groups  # noqa: E402
from hmi.model.root import full_forward  # noqa: E402

# tweets beside a long news text: one padded pass would compute 4 x 128 token rows
TEXTS = ["good morning", "the match was cancelled again",
         " ".join(["the markets fell sharply after the announcement of new tariffs"] * 20), "ok"]


def encoded(root):
    return root.tokenizer(TEXTS, truncation=True, max_length=128, padding=True, return_tensors="np")


def token_rows_run(bert, fn) -> int:
    """What ``fn()`` computes in the root's first layer, in token rows (batch x width)."""
    seen = []
    hook = bert.encoder.layer[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0] * args[0].shape[1]))
    try:
        fn()
    finally:
        hook.remove()
    return sum(seen)


def close_to(a: torch.Tensor, b: torch.Tensor) -> None:
    # fp32 states of a few layers computed at two GEMM widths: rounding of the largest entries
    scale = float(b.abs().max())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)


def test_the_full_context_lower_layers_run_a_mixed_batch_in_length_groups_and_match_one_padded_pass(real_root):
    enc = encoded(real_root)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    lengths = mask.sum(1)
    grouped = FullContextLower(real_root.bert, 3, "cpu")
    padded = FullContextLower(real_root.bert, 3, "cpu", grouped=False)

    rows_grouped = token_rows_run(real_root.bert, lambda: grouped.merged(ids, mask))
    rows_padded = token_rows_run(real_root.bert, lambda: padded.merged(ids, mask))
    assert rows_padded == ids.shape[0] * ids.shape[1]
    assert rows_grouped < rows_padded / 2  # the long text alone at full width, the short ones together

    a, b = grouped.merged(ids, mask), padded.merged(ids, mask)
    assert a.shape == b.shape == (*ids.shape, real_root.bert.config.hidden_size)
    for r, n in enumerate(lengths.tolist()):
        close_to(a[r, :n], b[r, :n])  # padding positions are masked wherever they are read


def test_the_frozen_root_baseline_groups_by_length_and_scores_as_one_padded_forward(real_root):
    shared = SharedRoot(real_root.bert, 4)
    enc = real_root.tokenizer(TEXTS, truncation=True, max_length=128, padding=True, return_tensors="pt")
    rows = token_rows_run(real_root.bert, lambda: shared.run(real_root.tokenizer, TEXTS, [0, 1, 2, 3]))
    assert rows < enc["input_ids"].numel() / 2

    cls = full_forward(real_root.bert, enc["input_ids"], enc["attention_mask"])[-1][:, :1]
    idx = torch.tensor([0, 1, 2, 3])
    reference = torch.baddbmm(shared.heads_b[idx], cls, shared.heads_w[idx])[:, 0]
    close_to(shared.run(real_root.tokenizer, TEXTS, [0, 1, 2, 3]), reference)


def test_length_groups_cover_every_row_once_at_its_group_width():
    mask = torch.zeros(6, 100, dtype=torch.long)
    for r, n in enumerate([100, 3, 4, 98, 5, 2]):
        mask[r, :n] = 1
    groups = length_groups(mask)
    assert sorted(r for g, _ in groups for r in g.tolist()) == list(range(6))
    assert all(T == int(mask[g].sum(1).max()) for g, T in groups)
    assert len(groups) == 2
    [(every, width)] = length_groups(mask, grouped=False)
    assert every.tolist() == list(range(6)) and width == 100
