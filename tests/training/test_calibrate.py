import pytest
import torch

from hmi.model.artifact import Root, artifact_config, current_artifact_id, load_root, save_artifact
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import RootSpec
from hmi.training.calibrate import CalibrationConfig, calibrate, quality
from tests.conftest import tiny_bert


class CharTokenizer:
    """A tiny real tokenizer for a tiny model: characters to ids, with [CLS]=1 and [SEP]=2."""

    def __call__(self, texts, truncation=True, max_length=32, padding=True, return_tensors="pt"):
        rows = [[1] + [3 + (ord(c) % 100) for c in t][: max_length - 2] + [2] for t in texts]
        T = max(map(len, rows))
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}


def tiny_root() -> Root:
    bert = tiny_bert(layers=4, hidden=32, vocab=110)
    return Root(RootSpec("tiny", 2), bert, CharTokenizer(), WindowedEncoder(bert, 2), "uncalibrated", {})


TEXTS = ["the cat sat on the mat", "a dog ran in the park", "stocks fell sharply today",
         "the film was a delight", "licenses permit copying", "python functions return values"] * 4


def test_calibration_reduces_loss_and_improves_cosine_on_tiny_config(tmp_path):
    root = tiny_root()
    before = quality(root, TEXTS[:6], max_len=32)
    cfg = CalibrationConfig(steps=40, batch_size=8, max_len=32, lr=3e-3, warmup=2, eval_texts=6)
    aid, meta = calibrate(root, TEXTS, TEXTS[:6], cfg, work_dir=tmp_path / "cal", home=tmp_path, log=lambda *_: None)
    after = meta["quality"]["after"]
    assert after["lower_cosine"] > before["lower_cosine"] + 0.05
    assert after["pooled_cosine"] >= before["pooled_cosine"]
    assert current_artifact_id(tmp_path) == aid
    assert artifact_config(aid, tmp_path)["quality"]["after"] == after


def test_calibration_resumes_from_checkpoint_to_the_same_weights(tmp_path, monkeypatch):
    import pytest

    import hmi.training.calibrate as cal

    cfg = CalibrationConfig(steps=6, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2, checkpoint_every=3)
    a = tiny_root()
    calibrate(a, TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / "a", home=tmp_path / "ha", log=lambda *_: None)

    # Interrupted run: stop during step 4, after the step-3 checkpoint, then resume with a fresh
    # process state.
    b = tiny_root()
    short = CalibrationConfig(**{**cfg.__dict__, "max_minutes": None})
    calls = {"n": 0}
    orig = cal.calibration_loss

    def crash_after_three(*args, **kw):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return orig(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(cal, "calibration_loss", crash_after_three)
        with pytest.raises(KeyboardInterrupt):
            calibrate(b, TEXTS, TEXTS[:2], short, work_dir=tmp_path / "b", home=tmp_path / "hb", log=lambda *_: None)
    assert calls["n"] == 4  # the interrupt came during step 4, not before the checkpoint
    resumed = {"n": 0}

    def counted(*args, **kw):
        resumed["n"] += 1
        return orig(*args, **kw)

    monkeypatch.setattr(cal, "calibration_loss", counted)
    c = tiny_root()
    calibrate(c, TEXTS, TEXTS[:2], short, work_dir=tmp_path / "b", home=tmp_path / "hb", log=lambda *_: None)
    assert resumed["n"] == 3  # steps 4-6 only: the first three came from the checkpoint
    for (k, x), (_, y) in zip(a.windowed.state_dict().items(), c.windowed.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=k)


def test_saved_artifact_round_trips_weights_and_takes_untouched_tensors_from_the_root(tmp_path):
    from safetensors.torch import load_file

    from hmi.model.artifact import load_windowed

    root = tiny_root()
    with torch.no_grad():
        root.windowed.lower.layers[0].output.dense.weight.add_(0.5)  # as if calibrated
    aid = save_artifact(root.windowed, root.bert, root.spec, {"note": "x"}, home=tmp_path)
    assert aid.startswith("minilm-l2-")
    config = artifact_config(aid, tmp_path)
    stored = load_file(str(tmp_path / "roots" / aid / "windowed.safetensors"))
    assert "lower.embeddings.word_embeddings.weight" in config["from_root"]
    assert "lower.embeddings.word_embeddings.weight" not in stored
    assert "lower.layers.0.output.dense.weight" in stored
    loaded = load_windowed(tmp_path / "roots" / aid, config, root.bert, 2)
    for k, v in root.windowed.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_artifact_of_another_root_is_refused_with_a_clear_error(tmp_path):
    import pytest

    from hmi.model.artifact import ArtifactMismatchError, load_windowed

    root = tiny_root()
    aid = save_artifact(root.windowed, root.bert, root.spec, {}, home=tmp_path)
    other = tiny_bert(layers=4, hidden=32, vocab=110)
    with torch.no_grad():
        other.encoder.layer[3].output.dense.weight.add_(1.0)
    with pytest.raises(ArtifactMismatchError, match="calibrated from another root"):
        load_windowed(tmp_path / "roots" / aid, artifact_config(aid, tmp_path), other, 2)


def test_calibration_repeats_bit_for_bit(tmp_path):
    cfg = CalibrationConfig(steps=5, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2)
    ids = [calibrate(tiny_root(), TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / f"w{i}", home=tmp_path / f"h{i}",
                     log=lambda *_: None)[0] for i in range(2)]
    assert ids[0] == ids[1]  # the id is the weights file's sha256


def test_shipped_artifact_is_installed_only_for_its_root_and_only_when_intact(tmp_path):
    import shutil

    import pytest

    from hmi.model.artifact import ArtifactMismatchError, install_shipped

    root = tiny_root()
    with torch.no_grad():
        root.windowed.lower.gate.bias.add_(1.0)
    aid = save_artifact(root.windowed, root.bert, root.spec, {}, home=tmp_path / "build")
    shipped = tmp_path / "shipped"
    shutil.copytree(tmp_path / "build" / "roots" / aid, shipped / aid)
    other = tiny_bert(layers=4, hidden=32, vocab=110)
    with torch.no_grad():
        other.embeddings.word_embeddings.weight.add_(1.0)
    assert install_shipped(other, 2, tmp_path / "a", shipped) is None  # another root: nothing fits
    assert install_shipped(root.bert, 3, tmp_path / "a", shipped) is None  # another split
    assert current_artifact_id(tmp_path / "a") is None
    assert install_shipped(root.bert, 2, tmp_path / "b", shipped) == aid
    assert current_artifact_id(tmp_path / "b") == aid
    (shipped / aid / "windowed.safetensors").write_bytes(b"damaged")
    with pytest.raises(ArtifactMismatchError, match="damaged"):
        install_shipped(root.bert, 2, tmp_path / "c", shipped)


def test_load_root_without_artifact_says_to_calibrate(tmp_path):
    import pytest

    from hmi.model.artifact import ArtifactMissingError

    with pytest.raises(ArtifactMissingError, match="hmi calibrate"):
        load_root(home=tmp_path)


def test_each_half_of_the_corpus_is_read_with_the_other_halfs_ngrams():
    import numpy as np

    from hmi.training.calibrate import HeldOutBackoff

    # Texts 0 and 2 form half 0, texts 1 and 3 half 1.
    lists = [[1, 5, 6, 7, 2], [1, 5, 6, 8, 2], [1, 9, 9, 2], [1, 3, 6, 7, 2]]
    b = HeldOutBackoff(lists)
    windows = np.array([[5, 6, 7], [5, 6, 8], [9, 9, 2], [4, 6, 7]])
    # Half 0 reads half 1's PLOT: (5, 6, 8) is held there, (5, 6, 7) backs off to the bi-gram
    # (0, 6, 7) of (3, 6, 7), (9, 9, 2) to the uni-gram, (4, 6, 7) to the bi-gram.  Half 1 reads
    # half 0's: no (x, 6, 8) there, so (5, 6, 8) backs off to the uni-gram.
    assert b.serve(0)(windows).tolist() == [[0, 6, 7], [5, 6, 8], [0, 9, 0], [0, 6, 7]]
    assert b.serve(1)(windows).tolist() == [[5, 6, 7], [0, 6, 0], [9, 9, 2], [0, 6, 7]]
    # The whole corpus holds all three of its windows; the unseen one backs off.
    assert b.serve(None)(windows).tolist() == [[5, 6, 7], [5, 6, 8], [9, 9, 2], [0, 6, 7]]


def test_calibration_backoff_merges_what_a_plot_of_the_corpus_serves(tmp_path):
    import numpy as np

    from hmi.plot.build import Selection, build, count_ngrams, plan_keys
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.store import PlotMeta, PlotStore
    from hmi.training.calibrate import HeldOutBackoff

    encoder = WindowedEncoder(tiny_bert(hidden=32, vocab=60), 2).eval()
    rng = np.random.default_rng(1)
    corpus = [[1, *rng.integers(3, 12, size=8).tolist(), 2] for _ in range(6)]
    keys, counts = count_ngrams(corpus)
    store = PlotStore(tmp_path / "p", meta=PlotMeta("tiny", 2, 32), readonly=False)
    build(store, encoder, plan_keys(keys, counts, Selection("all"), 60), progress=False)
    lookup = PlotLookup([PlotVersion("root", store, encoder)])

    ids = np.array([corpus[0], [1, *rng.integers(3, 12, size=6).tolist(), 2, 0, 0]])
    mask = (ids > 0).astype(np.int64)
    served = lookup.merged(ids, mask)
    assert lookup.hits["bigram:root"] + lookup.hits["unigram:root"] > 0  # the new text backs off
    with torch.no_grad():
        got = encoder(torch.from_numpy(ids), torch.from_numpy(mask), HeldOutBackoff(corpus).serve(None))
    m = mask.astype(bool)
    torch.testing.assert_close(got[m], served[m], atol=2e-2, rtol=0)  # the PLOT stores fp16


def test_calibration_reports_and_improves_quality_as_the_plot_serves_held_out_text(tmp_path):
    held_out = ["the park was a delight", "a cat fell in the film", "stocks sat on the mat"]
    q = {}
    for backoff in (False, True):
        cfg = CalibrationConfig(steps=30, batch_size=8, max_len=32, lr=3e-3, warmup=2, eval_texts=3, backoff=backoff)
        _, meta = calibrate(tiny_root(), TEXTS, held_out, cfg, work_dir=tmp_path / f"cal{backoff}",
                            home=tmp_path / f"h{backoff}", log=lambda *_: None)
        q[backoff] = meta["quality"]
    # Held-out text misses windows: what the PLOT serves differs from computing every window.
    assert q[False]["after"]["lower_cosine_served"] < q[False]["after"]["lower_cosine"]
    assert q[True]["after"]["lower_cosine_served"] > q[True]["before"]["lower_cosine_served"] + 0.05


def test_step_plan_keeps_the_steps_that_fit_the_budget_at_the_pace_so_far():
    from hmi.training.calibrate import StepPlan

    plan = StepPlan(800, budget_s=100.0)
    assert plan.replan(25, spent_s=2.0) == 800  # 0.08 s a step: 64 s for all of them
    assert plan.replan(25, spent_s=10.0) == 250  # 0.4 s a step: 25 done + 225 in the 90 s left
    assert plan.replan(50, spent_s=12.0) == 416  # faster since: 50 + 88 s at 0.24 s a step
    assert plan.replan(100, spent_s=10.0) == 800  # all of them fit again, and never more
    assert plan.replan(200, spent_s=101.0) == 200  # the budget is spent: stop here
    assert StepPlan(800).replan(25, spent_s=1e9) == 800  # no budget


def test_schedule_decays_to_its_end_at_the_planned_total_not_the_configured_steps():
    from hmi.training.calibrate import StepPlan, schedule

    cfg = CalibrationConfig(steps=800, warmup=20)
    plan = StepPlan(800, budget_s=100.0)
    factor = schedule(cfg, plan)
    assert factor(199) == schedule(cfg)(199)  # identical while the plan holds
    plan.replan(25, spent_s=10.0)  # 250 steps planned
    assert factor(249) == 0.05
    assert schedule(cfg)(249) > 0.6  # a run cut there without a plan stops at a high learning rate


# 40 steps within 12 seconds of the budget's clock: on ``slow_machine`` the budget holds 12 of them.
BUDGETED = CalibrationConfig(steps=40, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2, checkpoint_every=2,
                             max_minutes=0.2)


@pytest.fixture
def slow_machine(monkeypatch) -> dict:
    """A slow machine: each calibration step takes 1 s of the budget's clock.  Returns the count of
    steps run (``["n"]``)."""
    import hmi.training.calibrate as cal

    clock, steps = {"now": 0.0}, {"n": 0}
    orig = cal.calibration_loss

    def slow_step(*args, **kw):
        clock["now"] += 1.0
        steps["n"] += 1
        return orig(*args, **kw)

    monkeypatch.setattr(cal, "_now", lambda: clock["now"])
    monkeypatch.setattr(cal, "calibration_loss", slow_step)
    return steps


def test_calibration_over_budget_ends_early_with_its_learning_rate_decayed(tmp_path, slow_machine):
    cfg = BUDGETED
    _, meta = calibrate(tiny_root(), TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / "cal", home=tmp_path,
                        log=lambda *_: None)
    c = meta["calibration"]
    assert (c["steps_done"], c["steps_planned"], c["train_seconds"]) == (12, 12, 12.0)  # 12 s hold 12 steps
    lr_end = torch.load(tmp_path / "cal" / "checkpoint.pt", weights_only=True)["optimizer"]["param_groups"][0]["lr"]
    assert lr_end == pytest.approx(0.05 * cfg.lr)  # at its 5% floor after step 12, not cut at 70% of the peak


def test_a_calibration_cut_short_by_its_budget_resumes_under_a_larger_one_and_finishes_the_recipe(tmp_path,
                                                                                                    slow_machine):
    """A budget limits how long the recipe may take, not what it is: re-run with a larger budget,
    a calibration continues from its checkpoint (it does not start again) and runs to the
    recipe's end."""
    import dataclasses

    run = {"work_dir": tmp_path / "cal", "home": tmp_path, "log": lambda *_: None}
    _, meta = calibrate(tiny_root(), TEXTS, TEXTS[:2], BUDGETED, **run)
    assert meta["calibration"]["steps_done"] == 12  # 12 s hold 12 of the 40 steps
    slow_machine["n"] = 0
    _, meta = calibrate(tiny_root(), TEXTS, TEXTS[:2], dataclasses.replace(BUDGETED, max_minutes=1.0), **run)
    assert meta["calibration"]["steps_done"] == meta["calibration"]["steps_planned"] == 40
    assert slow_machine["n"] == 28  # it went on from step 12
