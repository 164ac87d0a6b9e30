"""The root's sentence pooling, read from its sentence-transformers folder."""


import pytest
import torch

from hmi.model.root import SentencePooling, default_spec, sentence_pooling
from tests.helpers.checkpoints import st_folder  # noqa: F401


def test_the_packaged_root_pools_by_the_mean_and_normalizes():
    assert sentence_pooling(default_spec().model_dir) == SentencePooling("mean", True)


def test_a_folder_without_a_sentence_pipeline_gets_the_packaged_roots_pooling(tmp_path):
    assert sentence_pooling(tmp_path) == SentencePooling("mean", True)


@pytest.mark.parametrize("modes,normalize,want", [
    (("pooling_mode_cls_token",), False, SentencePooling("cls", False)),
    (("pooling_mode_max_tokens",), True, SentencePooling("max", True)),
    (("pooling_mode_mean_tokens",), False, SentencePooling("mean", False)),
])
def test_the_pooling_module_and_normalize_of_a_folder_are_honoured(tmp_path, modes, normalize, want):
    assert sentence_pooling(st_folder(tmp_path, modes, normalize)) == want


@pytest.mark.parametrize("modes", [("pooling_mode_mean_sqrt_len_tokens",),
                                   ("pooling_mode_mean_tokens", "pooling_mode_max_tokens")])
def test_a_pooling_the_server_does_not_compute_is_refused_by_name(tmp_path, modes):
    with pytest.raises(ValueError, match="pooling"):
        sentence_pooling(st_folder(tmp_path, modes, True))


@pytest.mark.parametrize("mode", ["mean", "max", "cls"])
def test_pooling_reads_only_the_real_tokens_and_normalizes_each_row(mode):
    torch.manual_seed(0)
    hidden, mask = torch.randn(3, 5, 4), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    got = SentencePooling(mode, normalize=True)(hidden, mask)
    for n in range(3):
        real = hidden[n, : int(mask[n].sum())]
        v = {"mean": real.mean(0), "max": real.max(0).values, "cls": real[0]}[mode]
        assert got[n] == pytest.approx(v / v.norm(), abs=1e-6)
    assert SentencePooling(mode, normalize=False)(hidden, mask)[1] == pytest.approx(
        {"mean": hidden[1, :2].mean(0), "max": hidden[1, :2].max(0).values, "cls": hidden[1, 0]}[mode], abs=1e-6)
