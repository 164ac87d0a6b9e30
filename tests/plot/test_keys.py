import numpy as np
import pytest

from hmi.plot.keys import MAX_ID, bigram_backoff, from_bytes, ngram_order, pack, to_bytes, unigram_backoff, unpack


def test_pack_unpack_round_trip_including_max_id():
    rng = np.random.default_rng(0)
    win = rng.integers(0, MAX_ID + 1, size=(1000, 3))
    win[0] = (MAX_ID, MAX_ID, MAX_ID)
    np.testing.assert_array_equal(unpack(pack(win)), win)
    np.testing.assert_array_equal(from_bytes(to_bytes(pack(win))), pack(win))


def test_key_bytes_sort_like_windows_lexicographically():
    rng = np.random.default_rng(1)
    win = rng.integers(0, 40000, size=(500, 3))
    by_bytes = sorted(range(len(win)), key=lambda i: to_bytes(pack(win[i:i + 1]))[0])
    by_tuple = sorted(range(len(win)), key=lambda i: tuple(win[i]))
    assert [tuple(win[i]) for i in by_bytes] == [tuple(win[i]) for i in by_tuple]


def test_keys_are_eight_bytes_big_endian():
    assert to_bytes(pack(np.array([[0, 0, 1]])))[0] == b"\x00" * 7 + b"\x01"
    assert to_bytes(pack(np.array([[1, 0, 0]])))[0] == (1 << 42).to_bytes(8, "big")


def test_backoff_keys_drop_left_then_right_context():
    k = pack(np.array([[7, 8, 9]]))
    assert unpack(bigram_backoff(k)).tolist() == [[0, 8, 9]]
    assert unpack(unigram_backoff(k)).tolist() == [[0, 8, 0]]
    assert ngram_order(pack(np.array([[7, 8, 9], [0, 8, 9], [0, 8, 0], [7, 8, 0]]))).tolist() == [3, 2, 1, 3]


def test_ids_beyond_21_bits_are_refused():
    with pytest.raises(ValueError, match="21|2097151"):
        pack(np.array([[MAX_ID + 1, 0, 0]]))
