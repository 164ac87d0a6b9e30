import numpy as np
import pytest

from hmi.model.windows import causal_windows, encoder_windows, present_groups, unique_windows


def ref_encoder_windows(ids, mask):
    """Obvious per-token loop: (x[i-1], x[i], x[i+1]), 0 outside the real tokens."""
    B, T = ids.shape
    out = np.zeros((B, T, 3), dtype=np.int64)
    for b in range(B):
        n = int(mask[b].sum())
        for i in range(n):
            out[b, i] = (ids[b, i - 1] if i > 0 else 0, ids[b, i], ids[b, i + 1] if i + 1 < n else 0)
    return out


def test_encoder_windows_match_per_token_loop_with_padding():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 1000, size=(5, 9))
    mask = np.zeros((5, 9), dtype=np.int64)
    for b, n in enumerate([9, 1, 4, 2, 7]):
        mask[b, :n] = 1
    ids = ids * mask + 7 * (1 - mask)  # garbage at padding must not leak into windows
    np.testing.assert_array_equal(encoder_windows(ids, mask), ref_encoder_windows(ids, mask))


def test_encoder_windows_edges_cls_sep_are_ordinary_tokens():
    ids = np.array([[101, 5, 6, 102]])
    win = encoder_windows(ids, np.ones_like(ids))
    assert win[0, 0].tolist() == [0, 101, 5]
    assert win[0, 3].tolist() == [6, 102, 0]


def test_padding_positions_get_no_window():
    ids = np.array([[101, 5, 102, 0, 0]])
    mask = np.array([[1, 1, 1, 0, 0]])
    win = encoder_windows(ids, mask)
    assert (win[0, 3:] == 0).all()
    assert win[0, 2].tolist() == [5, 102, 0]


def test_causal_windows_look_back_two_tokens():
    ids = np.array([[11, 12, 13, 14, 0]])
    mask = np.array([[1, 1, 1, 1, 0]])
    win = causal_windows(ids, mask)
    assert win[0].tolist() == [[0, 0, 11], [0, 11, 12], [11, 12, 13], [12, 13, 14], [0, 0, 0]]


def test_unique_windows_inverse_reconstructs_batch():
    ids = np.array([[1, 2, 1, 2, 1, 2], [1, 2, 1, 0, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    win = encoder_windows(ids, mask)
    uniq, inv = unique_windows(win, mask)
    assert len(uniq) < mask.sum()
    np.testing.assert_array_equal(uniq[inv[mask.astype(bool)]], win[mask.astype(bool)])
    assert (inv[~mask.astype(bool)] == -1).all()


@pytest.mark.parametrize("high", [60, 30_522, 1 << 21, 1 << 40])
def test_unique_windows_equal_numpys_unique_rows_for_small_and_huge_ids(high):
    rng = np.random.default_rng(high % 97)
    for _ in range(20):
        win = rng.integers(0, high, size=(4, 9, 3))
        win[rng.random((4, 9)) < 0.3] = rng.integers(0, high, size=3)  # repeats
        mask = (rng.random((4, 9)) < 0.8).astype(np.int64)
        uniq, inv = unique_windows(win, mask)
        want_uniq, want_inv = np.unique(win[mask.astype(bool)], axis=0, return_inverse=True)
        np.testing.assert_array_equal(uniq, want_uniq)
        np.testing.assert_array_equal(inv[mask.astype(bool)], want_inv.reshape(-1))
        assert (inv[~mask.astype(bool)] == -1).all()


def test_present_groups_partition_the_windows_by_their_present_tokens():
    present = np.array([[1, 1, 1], [0, 1, 1], [1, 1, 0], [0, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=bool)
    groups = present_groups(present)
    assert sorted(np.concatenate([rows for rows, _ in groups]).tolist()) == list(range(len(present)))
    for rows, cols in groups:
        for r in rows:
            assert np.flatnonzero(present[r]).tolist() == cols.tolist()
    assert [(rows.tolist(), cols.tolist()) for rows, cols in groups] == [
        ([3], [1]), ([1, 4], [1, 2]), ([2], [0, 1]), ([0, 5], [0, 1, 2])]
