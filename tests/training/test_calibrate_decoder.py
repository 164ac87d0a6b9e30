"""A decoder calibration survives interruption: ``max_minutes`` limits one invocation, which
stops at a checkpoint of its own, and the same call continues to the weights of an uninterrupted
run; deeper splits take the logit-distillation recipe."""

import pytest
import torch

import hmi.timelimit
import hmi.training.calibrate_decoder as cd
from hmi.training.calibrate import CalibrationUnfinished
from hmi.training.calibrate_decoder import DecoderCalibrationConfig, calibrate_decoder, decoder_recipe
from tests.helpers.decoders import tiny_decoder
from tests.helpers.generation import CharTokenizer
from tests.helpers.slow import slow_steps

LINES = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps in the sun all day",
         "stocks fell sharply today", "licenses permit copying"] * 4
# 30 steps with the logit distillation; on ``slow_machine`` each takes 1 s of the time limit's clock.
RECIPE = DecoderCalibrationConfig(steps=30, batch_size=3, lr=3e-3, weight_logits=1.0)


def tiny_root(dropout: float = 0.0):
    """The tiny decoder; with ``dropout`` its attention drops probabilities in training, so a
    calibration draws masks (SmolLM2's is 0)."""
    root = tiny_decoder()
    root.tokenizer = CharTokenizer()
    for layer in root.layers:
        layer.self_attn.attention_dropout = dropout
    return root


@pytest.fixture
def slow_machine(monkeypatch) -> dict:
    """Each calibration step takes 1 s of the time limit's clock; returns the count of steps run."""
    return slow_steps(monkeypatch, cd, "full_hidden")


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_a_time_limit_stops_a_decoder_calibration_at_a_checkpoint_and_the_same_call_ends_bit_for_bit(
        tmp_path, slow_machine, dropout):
    whole, info = calibrate_decoder(tiny_root(dropout), LINES, RECIPE, progress=False, checkpoint=tmp_path / "whole.pt")
    assert info["train_seconds"] == 30.0
    slow_machine["n"] = 0
    run = {"progress": False, "checkpoint": tmp_path / "sliced.pt", "limit": None}
    for stop_at in (12, 24):
        run["limit"] = hmi.timelimit.TimeLimit(0.2)
        with pytest.raises(CalibrationUnfinished, match=f"stopped at step {stop_at} of 30"):
            calibrate_decoder(tiny_root(dropout), LINES, RECIPE, **run)
        assert torch.load(tmp_path / "sliced.pt", weights_only=True)["step"] == stop_at
    run["limit"] = hmi.timelimit.TimeLimit(0.2)
    sliced, info = calibrate_decoder(tiny_root(dropout), LINES, RECIPE, **run)
    assert slow_machine["n"] == 30  # every step once: each call went on from the last
    assert info["train_seconds"] == 30.0
    for (name, a), b in zip(whole.state_dict().items(), sliced.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_decoder_checkpoint_of_another_recipe_is_not_continued(tmp_path, slow_machine):
    run = {"progress": False, "checkpoint": tmp_path / "c.pt"}
    with pytest.raises(CalibrationUnfinished):
        calibrate_decoder(tiny_root(), LINES, RECIPE, limit=hmi.timelimit.TimeLimit(0.2), **run)
    slow_machine["n"] = 0
    other = DecoderCalibrationConfig(**{**RECIPE.__dict__, "lr": 1e-3})
    calibrate_decoder(tiny_root(), LINES, other, **run)
    assert slow_machine["n"] == 30  # started over


def test_deeper_decoder_splits_take_the_logit_distillation_recipe():
    assert decoder_recipe(2) == DecoderCalibrationConfig()
    assert (decoder_recipe(8).weight_logits, decoder_recipe(8).steps) == (1.0, 300)


@pytest.mark.slow
def test_a_finished_decoder_calibration_run_again_returns_its_artifact_at_once_and_makes_it_current(
        tmp_path, slow_machine, monkeypatch, decoder_copy_home):
    """``hmi calibrate --decoder`` after a finished run (on the packaged SmolLM2) trains and
    measures nothing: it serves the artifact its ``done`` file names and points the home at it
    again; another recipe calibrates."""
    import hmi.training.calibrate_decoder as cdec
    from hmi.home import hmi_home
    from tests.helpers.shared import link_home

    link_home(decoder_copy_home, hmi_home())  # the fp32 copy (kept in HMI_HOME) is another test's subject
    cfg = DecoderCalibrationConfig(steps=2, batch_size=2, max_len=32, eval_texts=2)
    first, meta = cdec.calibrate_and_save(tmp_path, 2, cfg, progress=False)
    folder = f"{first.name}-l2"
    (tmp_path / "roots" / "current_decoder").write_text("another-l2")
    measured = {"n": 0}

    def counted(*args, _orig=cdec.perplexity, **kw):
        measured["n"] += 1
        return _orig(*args, **kw)

    monkeypatch.setattr(cdec, "perplexity", counted)
    slow_machine["n"] = 0
    again, meta_again = cdec.calibrate_and_save(tmp_path, 2, cfg, progress=False)
    assert (slow_machine["n"], measured["n"]) == (0, 0)
    assert meta_again == meta and again.name == first.name
    assert (tmp_path / "roots" / "current_decoder").read_text() == folder
    for (name, a), b in zip(first.windowed.state_dict().items(), again.windowed.state_dict().values()):
        assert torch.equal(a, b), name

    cdec.calibrate_and_save(tmp_path, 2, DecoderCalibrationConfig(**{**cfg.__dict__, "steps": 3}), progress=False)
    assert slow_machine["n"] == 3  # another recipe: its own run, in a folder of its own
    assert cdec.calibrate_and_save(tmp_path, 2, cfg, progress=False)[1] == meta
    assert slow_machine["n"] == 3  # the first recipe's state was kept: it returned at once again
