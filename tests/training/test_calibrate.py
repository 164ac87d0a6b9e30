import pytest
import torch

from hmi.model.artifact import Root, artifact_config, current_artifact_id, load_root, save_artifact
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import RootSpec
from hmi.training.calibrate import CalibrationConfig, calibrate, quality
from tests.conftest import tiny_bert
from tests.helpers.slow import slow_steps
from tests.helpers.tokenizers import CharTokenizer  # noqa: F401

# The tiny root splits at 2: its pointer is the default root's for that split, not ``current``.
POINTER = RootSpec("tiny", 2).pointer


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
    assert current_artifact_id(tmp_path, POINTER) == aid
    assert artifact_config(aid, tmp_path)["quality"]["after"] == after


def with_dropout(root: Root, p: float = 0.1) -> Root:
    """``root`` with its dropouts on, as the packaged roots' (0.1): calibration then draws masks."""
    for m in [*root.bert.modules(), *root.windowed.modules()]:
        if isinstance(m, torch.nn.Dropout):
            m.p = p
    return root


def test_calibration_stopped_and_resumed_reaches_the_uninterrupted_weights_bit_for_bit(tmp_path, monkeypatch):
    """A stopped calibration continued from its checkpoint gives the artifact an uninterrupted run
    gives (so the same recipe run again after a lost home names the same artifact), dropout
    masks included: the checkpoint keeps torch's random state."""
    import pytest

    import hmi.training.calibrate as cal

    cfg = CalibrationConfig(steps=6, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2, checkpoint_every=3)
    a = with_dropout(tiny_root())
    calibrate(a, TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / "a", home=tmp_path / "ha", log=lambda *_: None)

    # Interrupted run: stop during step 4, after the step-3 checkpoint, then resume with a fresh
    # process state.
    b = with_dropout(tiny_root())
    short = cfg
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
    c = with_dropout(tiny_root())
    calibrate(c, TEXTS, TEXTS[:2], short, work_dir=tmp_path / "b", home=tmp_path / "hb", log=lambda *_: None)
    assert resumed["n"] == 3  # steps 4-6 only: the first three came from the checkpoint
    for (k, x), (_, y) in zip(a.windowed.state_dict().items(), c.windowed.state_dict().items()):
        assert torch.equal(x, y), k
    assert current_artifact_id(tmp_path / "ha", POINTER) == current_artifact_id(tmp_path / "hb", POINTER)


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


def test_an_artifact_written_again_with_the_same_weights_stays_in_place_and_becomes_current(tmp_path):
    root = tiny_root()
    first = save_artifact(root.windowed, root.bert, root.spec, {"run": 1}, home=tmp_path)
    folder = tmp_path / "roots" / first
    inode = folder.stat().st_ino
    weight = root.windowed.lower.layers[0].output.dense.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.add_(0.5)
    other = save_artifact(root.windowed, root.bert, root.spec, {"run": 2}, home=tmp_path)
    assert other != first and current_artifact_id(tmp_path, POINTER) == other
    with torch.no_grad():
        weight.copy_(kept)
    again = save_artifact(root.windowed, root.bert, root.spec, {"run": 3}, home=tmp_path)
    assert again == first and current_artifact_id(tmp_path, POINTER) == first
    assert folder.stat().st_ino == inode  # never removed: a loader cannot find it missing
    assert artifact_config(first, tmp_path)["run"] == 1
    assert not list((tmp_path / "roots").glob(".new-*"))


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
    assert current_artifact_id(tmp_path / "a", POINTER) is None
    assert install_shipped(root.bert, 2, tmp_path / "b", shipped) == aid
    assert current_artifact_id(tmp_path / "b", POINTER) == aid
    (shipped / aid / "windowed.safetensors").write_bytes(b"damaged")
    with pytest.raises(ArtifactMismatchError, match="damaged"):
        install_shipped(root.bert, 2, tmp_path / "c", shipped)


def test_load_root_without_artifact_says_to_prepare_the_default_and_to_calibrate_another(tmp_path):
    import pytest

    from hmi.model.artifact import ArtifactMissingError
    from hmi.model.root import RootSpec

    # The default root's artifact ships with hmi: `hmi prepare` installs it in seconds.
    with pytest.raises(ArtifactMissingError, match="run `hmi prepare` first"):
        load_root(home=tmp_path)
    # Another split or another root has none to install: it must be calibrated.
    with pytest.raises(ArtifactMissingError, match="run `hmi calibrate --l-low 2` first"):
        load_root(home=tmp_path, spec=RootSpec(model_dir=str(tmp_path), l_low=2))
    with pytest.raises(ArtifactMissingError, match="run `hmi calibrate --root mpnet-base --l-low 6` first"):
        load_root(home=tmp_path, spec=RootSpec(model_dir=str(tmp_path), l_low=6, source="mpnet-base"))


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


def test_served_windows_computed_once_on_their_present_tokens_give_the_reference_loss_and_gradients():
    """``served_once`` and ``present_tokens`` (mpnet-base's recipe): each distinct window the
    back-off serves computed once, on its present tokens: the loss and every gradient of the
    masked windows computed per distinct raw window, on fewer windows."""
    from hmi.model.hplm import HPLM
    from hmi.training.calibrate import HeldOutBackoff, calibration_loss, token_lists, tokenize

    root = tiny_root()
    torch.nn.init.normal_(root.windowed.lower.gate.weight, std=0.1)
    serve = HeldOutBackoff(token_lists(root.tokenizer, TEXTS[:6], 32)).serve(0)
    ids, mask = tokenize(root.tokenizer, ["the cat ran in the park today", "a film of stocks", "dogs sat"], 32)
    hplm = HPLM(root.bert, root.windowed)
    computed = []
    root.windowed.lower.register_forward_pre_hook(lambda _, args: computed.append(args[0].shape[0]))
    out = {}
    for once in (False, True):
        root.windowed.zero_grad()
        cfg = CalibrationConfig(served_once=once, present_tokens=once)
        loss, _ = calibration_loss(root, hplm, ids, mask, cfg, serve)
        loss.backward()
        out[once] = loss.detach(), {n: p.grad.clone() for n, p in root.windowed.named_parameters() if p.grad is not None}
    assert computed[1] < computed[0]  # back-off served some windows more than once
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-7)
    assert out[True][1].keys() == out[False][1].keys()
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


# 40 steps of a recipe; on ``slow_machine`` each takes 1 s of the time limit's clock.
RECIPE = CalibrationConfig(steps=40, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2, checkpoint_every=25)


def test_a_finished_calibration_run_again_returns_its_artifact_at_once_and_makes_it_current(tmp_path, monkeypatch):
    """The same call after a finished run trains nothing and measures nothing: it loads the
    artifact the ``done`` file names into the root and points the root's pointer at it again.
    A run of another recipe, or whose artifact is gone, calibrates."""
    import hmi.training.calibrate as cal

    cfg = CalibrationConfig(steps=4, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2)
    run = {"work_dir": tmp_path / "cal", "home": tmp_path, "log": lambda *_: None}
    first = tiny_root()
    aid, meta = calibrate(first, TEXTS, TEXTS[:2], cfg, **run)
    (tmp_path / "roots" / "minilm-l2-other").mkdir()
    (tmp_path / "roots" / "minilm-l2-other" / "config.json").write_text("{}")
    (tmp_path / "roots" / first.spec.pointer).write_text("minilm-l2-other")

    work = {"loss": 0, "quality": 0}
    for name, key in (("calibration_loss", "loss"), ("quality", "quality")):
        def counted(*args, _orig=getattr(cal, name), _key=key, **kw):
            work[_key] += 1
            return _orig(*args, **kw)
        monkeypatch.setattr(cal, name, counted)
    again = tiny_root()
    assert calibrate(again, TEXTS, TEXTS[:2], cfg, **run) == (aid, meta)
    assert work == {"loss": 0, "quality": 0}
    assert current_artifact_id(tmp_path, POINTER) == aid
    assert not (tmp_path / "roots" / "current").exists()  # the default split's pointer is not this split's
    for (k, x), (_, y) in zip(first.windowed.state_dict().items(), again.windowed.state_dict().items()):
        assert torch.equal(x, y), k

    longer = CalibrationConfig(steps=5, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2)
    assert calibrate(tiny_root(), TEXTS, TEXTS[:2], longer, **run)[0] != aid
    assert work["loss"] == 5  # another recipe: its own run from the start

    import shutil
    shutil.rmtree(tmp_path / "roots" / aid)
    work["loss"] = 0
    assert calibrate(tiny_root(), TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / "cal4", home=tmp_path,
                     log=lambda *_: None)[0] == aid
    assert work["loss"] == 4 and (tmp_path / "roots" / aid / "config.json").exists()


def test_another_recipe_keeps_its_own_state_and_the_first_recipe_run_again_returns_at_once(tmp_path, monkeypatch):
    """Two recipes calibrated in one home, each in its default work folder: the second does not
    overwrite the first's checkpoint and ``done`` file, so the first, run again, trains nothing."""
    import hmi.training.calibrate as cal

    first = CalibrationConfig(steps=4, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2)
    second = CalibrationConfig(**{**first.__dict__, "steps": 5})
    run = {"home": tmp_path, "log": lambda *_: None}
    aid, meta = calibrate(tiny_root(), TEXTS, TEXTS[:2], first, **run)
    other, _ = calibrate(tiny_root(), TEXTS, TEXTS[:2], second, **run)
    assert other != aid and current_artifact_id(tmp_path, POINTER) == other
    steps = {"n": 0}

    def counted(*args, _orig=cal.calibration_loss, **kw):
        steps["n"] += 1
        return _orig(*args, **kw)

    monkeypatch.setattr(cal, "calibration_loss", counted)
    assert calibrate(tiny_root(), TEXTS, TEXTS[:2], first, **run) == (aid, meta)
    assert steps["n"] == 0 and current_artifact_id(tmp_path, POINTER) == aid
    assert len(list((tmp_path / "calibration").iterdir())) == 2


def test_a_work_folder_of_the_earlier_layout_holding_this_recipe_is_taken_over_and_one_of_another_recipe_is_left(
        tmp_path, monkeypatch):
    """Before recipes had folders of their own, every recipe of a root and split used
    ``calibration/<run>-seed<N>``: a checkpoint there of this recipe is continued from (the folder
    renamed to the recipe's), one of another recipe is left where it is."""
    import hmi.training.calibrate as cal
    from hmi.training.calibrate import default_work_dir

    cfg = CalibrationConfig(steps=4, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2, checkpoint_every=2)
    root = tiny_root()
    earlier = tmp_path / "calibration" / "l2-seed0"
    keyed = default_work_dir(root, cfg, tmp_path)
    assert keyed.parent == earlier.parent and keyed.name.startswith("l2-seed0-")
    with pytest.raises(cal.CalibrationUnfinished):
        calibrate(root, TEXTS, TEXTS[:2], cfg, home=tmp_path, log=lambda *_: None, max_minutes=1e-9)
    keyed.rename(earlier)  # a run stopped at step 1 under the earlier layout
    other = CalibrationConfig(**{**cfg.__dict__, "lr": 3e-3})
    assert default_work_dir(root, other, tmp_path) != earlier and earlier.is_dir()  # not its state: left
    steps = {"n": 0}

    def counted(*args, _orig=cal.calibration_loss, **kw):
        steps["n"] += 1
        return _orig(*args, **kw)

    monkeypatch.setattr(cal, "calibration_loss", counted)
    calibrate(tiny_root(), TEXTS, TEXTS[:2], cfg, home=tmp_path, log=lambda *_: None)
    assert steps["n"] == 3 and keyed.is_dir() and not earlier.exists()  # continued at step 2 of 4


def test_a_recipe_key_names_only_the_settings_that_differ_from_the_default():
    from dataclasses import dataclass

    from hmi.training.recipe_folder import recipe_key

    @dataclass
    class Before:
        steps: int = 100
        lr: float = 1e-3

    @dataclass
    class After(Before):
        bf16: bool = False  # a setting added later; its default keeps the earlier behaviour

    assert recipe_key(Before(), Before()) == recipe_key(After(), After()) == ""
    assert recipe_key(Before(steps=800), Before()) == recipe_key(After(steps=800), After()) != ""
    assert recipe_key(After(steps=800, bf16=True), After()) != recipe_key(After(steps=800), After())


@pytest.fixture
def slow_machine(monkeypatch) -> dict:
    """A slow machine: each calibration step takes 1 s of the time limit's clock.  Returns the
    count of steps run (``["n"]``)."""
    import hmi.training.calibrate as cal

    return slow_steps(monkeypatch, cal, "calibration_loss")


def test_a_time_limit_stops_one_invocation_at_a_checkpoint_and_the_same_call_finishes_the_recipe_bit_for_bit(
        tmp_path, slow_machine):
    """``max_minutes`` limits an invocation, not the recipe: each call with 12 s runs 12 steps and
    stops at a checkpoint of its own (25 is not a multiple of 12), the next continues, and the
    fourth ends the 40 steps with the weights and the learning rate of an uninterrupted run."""
    from hmi.training.calibrate import CalibrationUnfinished

    whole = tiny_root()
    aid, meta = calibrate(whole, TEXTS, TEXTS[:2], RECIPE, work_dir=tmp_path / "whole", home=tmp_path / "hw",
                          log=lambda *_: None)
    assert (meta["calibration"]["steps_done"], meta["calibration"]["train_seconds"]) == (40, 40.0)
    slow_machine["n"] = 0
    run = {"work_dir": tmp_path / "cal", "home": tmp_path / "hs", "log": lambda *_: None, "max_minutes": 0.2}
    for stop_at in (12, 24, 36):
        with pytest.raises(CalibrationUnfinished, match=f"stopped at step {stop_at} of 40"):
            calibrate(tiny_root(), TEXTS, TEXTS[:2], RECIPE, **run)
        assert torch.load(tmp_path / "cal" / "checkpoint.pt", weights_only=True)["step"] == stop_at
    assert current_artifact_id(tmp_path / "hs", POINTER) is None  # nothing half-calibrated is served
    sliced = tiny_root()
    aid_sliced, meta = calibrate(sliced, TEXTS, TEXTS[:2], RECIPE, **run)
    assert slow_machine["n"] == 40  # every step once: each call went on from the last
    assert (meta["calibration"]["steps_done"], meta["calibration"]["train_seconds"]) == (40, 40.0)
    assert aid_sliced == aid  # the artifact id is the weights' digest: equal bit for bit
    lr = [torch.load(d / "checkpoint.pt", weights_only=True)["optimizer"]["param_groups"][0]["lr"]
          for d in (tmp_path / "whole", tmp_path / "cal")]
    assert lr[0] == lr[1] == pytest.approx(0.05 * RECIPE.lr)  # the recipe's schedule ran to its end


def test_a_checkpoint_of_a_budget_that_shortened_the_schedule_continues_to_the_recipes_end(tmp_path, slow_machine):
    """A checkpoint written when a time budget was part of the recipe (``max_minutes``,
    ``planned_steps``) is this recipe's: the run goes on from it to the configured steps."""
    from hmi.training.calibrate import CalibrationUnfinished

    run = {"work_dir": tmp_path / "cal", "home": tmp_path, "log": lambda *_: None}
    with pytest.raises(CalibrationUnfinished):
        calibrate(tiny_root(), TEXTS, TEXTS[:2], RECIPE, max_minutes=0.2, **run)
    path = tmp_path / "cal" / "checkpoint.pt"
    ck = torch.load(path, weights_only=True)
    ck["config"]["max_minutes"], ck["planned_steps"] = 0.2, 12
    torch.save(ck, path)
    slow_machine["n"] = 0
    _, meta = calibrate(tiny_root(), TEXTS, TEXTS[:2], RECIPE, **run)
    assert (slow_machine["n"], meta["calibration"]["steps_done"]) == (28, 40)


def test_deterministic_training_skips_the_nan_fill_and_calibrates_the_same_bits_as_with_it(tmp_path, monkeypatch):
    """Deterministic mode's NaN fill of new tensors costs time and changes no result: inside
    ``deterministic()`` it is off (and restored after), and a calibration gives the same weights,
    bit for bit, as one run with the fill on."""
    from contextlib import contextmanager

    import torch.utils.deterministic

    import hmi.training.calibrate as cal
    from hmi.training.fit import deterministic

    before = torch.utils.deterministic.fill_uninitialized_memory
    with deterministic():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    assert torch.utils.deterministic.fill_uninitialized_memory == before
    cfg = CalibrationConfig(steps=6, batch_size=4, max_len=16, lr=1e-3, warmup=1, eval_texts=2)
    without = tiny_root()
    calibrate(without, TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / "a", home=tmp_path / "ha", log=lambda *_: None)

    @contextmanager
    def with_fill():
        with deterministic():
            torch.utils.deterministic.fill_uninitialized_memory = True
            yield

    monkeypatch.setattr(cal, "deterministic", with_fill)
    filled = tiny_root()
    calibrate(filled, TEXTS, TEXTS[:2], cfg, work_dir=tmp_path / "b", home=tmp_path / "hb", log=lambda *_: None)
    for (k, x), (_, y) in zip(without.windowed.state_dict().items(), filled.windowed.state_dict().items()):
        assert torch.equal(x, y), k
