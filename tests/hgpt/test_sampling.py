import torch

from hmi.adapters.heads import decode
from hmi.adapters.spec import AdapterSpec
from hmi.hgpt.sampling import next_token, streamable


def test_next_token_is_the_argmax_without_a_generator_or_below_the_greedy_temperature():
    lg = torch.tensor([0.1, 2.0, -1.0])
    assert next_token(lg, 1.0, 1.0, None) == 1
    assert next_token(lg, 1e-4, 1.0, torch.Generator().manual_seed(0)) == 1


def test_a_seeded_draw_repeats_and_a_tiny_top_p_keeps_only_the_most_likely_token():
    lg = torch.randn(50, generator=torch.Generator().manual_seed(1))
    draws = [next_token(lg, 1.5, 0.9, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    assert all(next_token(lg, 2.0, 1e-30, torch.Generator().manual_seed(s)) == int(lg.argmax()) for s in range(5))


def test_streamable_holds_back_what_could_still_become_a_stop_string_or_half_a_character():
    assert streamable("hello wor", 0, ["world!"], final=False) == 4
    assert streamable("hello wor", 0, ["world!"], final=True) == 9
    assert streamable("abc\ufffd", 1, [], final=False) == 3
    assert streamable("ab", 2, ["xyz"], final=False) == 2  # never behind what was sent


def test_heads_decode_classification_scores_and_tags_at_word_starts():
    cls = AdapterSpec(labels=("neg", "pos"))
    got = decode(cls, torch.tensor([[0.0, 2.0, 9.0]]), [])  # a third pool column is not this tenant's
    assert got["label"] == "pos" and abs(sum(got["scores"].values()) - 1) < 1e-6
    tag = AdapterSpec(head="tagging", labels=("N", "V"))
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]])
    assert decode(tag, logits, [(0, "dogs"), (2, "bark")]) == {"tokens": [{"token": "dogs", "tag": "N"},
                                                                        {"token": "bark", "tag": "N"}]}
