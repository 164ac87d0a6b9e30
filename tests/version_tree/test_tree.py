import dataclasses

import numpy as np
import pytest
import torch

from hmi.model import kernels
from hmi.model.artifact import Root
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import RootSpec, default_spec, load_tokenizer
from hmi.plot.paths import ensure_root_plot
from hmi.training.further_pretrain import OBJECTIVES, FPTConfig, further_pretrain, mask_tokens, summary
from hmi.version_tree.tree import DomainError, VersionTree
from tests.conftest import tiny_bert
from tests.helpers.domains import FAST, corpus  # noqa: F401


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    home = tmp_path_factory.mktemp("roothome")
    spec = RootSpec(default_spec().model_dir, 2)
    bert = tiny_bert(layers=4, hidden=32, vocab=30522)
    r = Root(spec, bert, load_tokenizer(spec.model_dir), WindowedEncoder(bert, 2).eval(), "tinyroot", {})
    ensure_root_plot(r, lines=corpus(50, seed=9), home=home, progress=False)
    return r, home


@pytest.fixture
def root(shared_root, tmp_path):
    """The tiny root; each test's home links to the one root PLOT built for the module."""
    r, home = shared_root
    (tmp_path / "plots").symlink_to(home / "plots")
    return r


def test_masking_follows_80_10_10_on_real_tokens_only(root):
    tok = root.tokenizer
    enc = tok(corpus(200), truncation=True, max_length=64, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    out, labels = mask_tokens(ids, mask, tok, torch.Generator().manual_seed(0))
    chosen = labels != -100
    real = mask.bool() & (ids != tok.cls_token_id) & (ids != tok.sep_token_id)
    assert not (chosen & ~real).any()
    assert abs(chosen.sum().item() / real.sum().item() - 0.15) < 0.02
    masked = (out == tok.mask_token_id) & chosen
    kept = (out == ids) & chosen
    assert abs(masked.sum().item() / chosen.sum().item() - 0.8) < 0.05
    assert abs(kept.sum().item() / chosen.sum().item() - 0.1) < 0.05


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_fpt_changes_only_lower_side_parameters_and_improves_its_measure_on_held_out_lines(root, objective):
    """distill: the served representation of held-out domain lines moves towards the full root's
    (pooled cosine); mlm: the held-out MLM loss falls."""
    upper_before = {k: v.clone() for k, v in root.bert.encoder.layer[2:].state_dict().items()}
    enc = WindowedEncoder(root.bert, 2)
    lower_before = {k: v.clone() for k, v in enc.state_dict().items()}
    m = further_pretrain(root, enc, corpus(), dataclasses.replace(FAST, objective=objective), progress=False)
    for k, v in root.bert.encoder.layer[2:].state_dict().items():
        assert torch.equal(v, upper_before[k]), k
    changed = [k for k, v in enc.state_dict().items() if not torch.equal(v, lower_before[k])]
    assert any("lower.layers" in k for k in changed) and any("merge" in k for k in changed)
    assert not enc.lower.embeddings.word_embeddings.weight.requires_grad
    assert m["steps"] == 6 and m["objective"] == objective
    if objective == "mlm":
        assert m["mlm_loss_after"] < m["mlm_loss_before"]
    else:
        assert m["pooled_cosine_after"] > m["pooled_cosine_before"] and m["lower_cosine_after"] > m["lower_cosine_before"]
    assert ("->" in summary(m)) and (("MLM" in summary(m)) == (objective == "mlm"))


def test_fpt_defaults_follow_the_objective_and_an_unknown_one_is_refused():
    assert (FPTConfig().objective, FPTConfig().steps, FPTConfig().lr) == ("distill", 600, 3e-4)
    assert (FPTConfig(objective="mlm").steps, FPTConfig(objective="mlm").batch_size) == (150, 16)
    assert FPTConfig(steps=7, objective="mlm").steps == 7
    with pytest.raises(ValueError, match="unknown further-pretraining objective"):
        FPTConfig(objective="magic")


def test_create_branch_prunes_by_alpha_and_chains_to_root(root, tmp_path):
    tree = VersionTree(root, tmp_path)
    node = tree.create("legal", "root", corpus(), alpha=0.5, fpt=FAST, progress=False)
    # its pruned tri-grams and its own back-off entries: the bi-grams of its corpus, every uni-gram
    assert node.plot["trigrams"] > 0 and node.plot["unigrams"] == len(root.tokenizer) - 1 and node.plot["bigrams"] > 30
    assert 0.5 <= node.corpus["covered_occurrences"] < 0.6
    assert node.plot["trigrams"] < node.corpus["distinct_trigrams"]
    sub = tree.create("legal-eu", "legal", corpus(seed=1), alpha=0.3, fpt=FAST, progress=False)
    assert tree.chain("legal-eu") == ["legal-eu", "legal", "root"]
    lk = tree.lookup("legal-eu")
    assert [v.name for v in lk.chain] == ["legal-eu", "legal", "root"]
    ids = root.tokenizer(corpus(4, seed=1), truncation=True, max_length=64, padding=True, return_tensors="np")
    lk.merged(ids["input_ids"], ids["attention_mask"])
    assert lk.hits["trigram:legal-eu"] > 0
    # its corpus's windows it did not keep are served by its own bi-grams, never by an ancestor's
    assert lk.hits["bigram:legal-eu"] > 0 and not any(n for level, n in lk.hits.items()
                                                      if level.startswith(("bigram:legal", "bigram:root", "unigram:"))
                                                      and not level.endswith("legal-eu"))
    assert sub.parent == "legal" and [d["name"] for d in tree.listing()] == ["root", "legal", "legal-eu"]


def test_a_branch_reports_progress_through_pretraining_and_its_plot_build(root, tmp_path):
    heard = []
    VersionTree(root, tmp_path).create("progress", "root", corpus(), alpha=0.5, fpt=FAST, progress=False,
                                       on_progress=lambda f, info: heard.append((info["stage"], f)))
    stages = [s for s, _ in heard]
    assert stages[0] == "further pretraining" and stages[-1] == "building the branch's PLOT"
    assert stages == sorted(stages, key=lambda s: s != "further pretraining")  # one stage after the other
    for stage in set(stages):
        fractions = [f for s, f in heard if s == stage]
        assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_update_refreshes_entries_and_counts(root, tmp_path):
    tree = VersionTree(root, tmp_path)
    first = tree.create("news", "root", corpus(), alpha=0.5, fpt=FAST, progress=False)
    before = tree.version("news").store.keys()
    second = tree.update("news", corpus(600, seed=5), fpt=FAST, progress=False)
    assert second.corpus["lines"] > first.corpus["lines"] and second.created == first.created
    after = tree.version("news").store.keys()
    assert not np.array_equal(before, after) or second.plot["entries"] != first.plot["entries"]
    w_new = tree.encoder("news").state_dict()
    assert any(not torch.equal(w_new[k], v) for k, v in root.windowed.state_dict().items())


def test_delete_removes_files_and_is_refused_while_in_use(root, tmp_path):
    tree = VersionTree(root, tmp_path)
    tree.create("a", "root", corpus(), alpha=0.5, fpt=FAST, progress=False)
    with pytest.raises(DomainError, match="used by tenants"):
        tree.delete("a", in_use={"a"})
    tree.delete("a")
    assert not (tree.dir / "a").exists() and "a" not in tree.nodes()


def test_small_corpus_and_bad_names_are_refused(root, tmp_path):
    tree = VersionTree(root, tmp_path)
    with pytest.raises(DomainError, match="at least"):
        tree.create("tiny", "root", corpus(5), fpt=FAST, progress=False)
    with pytest.raises(DomainError, match="invalid domain name"):
        tree.create("Bad Name", "root", corpus(), fpt=FAST, progress=False)
    with pytest.raises(DomainError, match="unknown parent"):
        tree.create("x", "nowhere", corpus(), fpt=FAST, progress=False)
    assert list(p for p in tree.dir.iterdir() if p.is_dir()) == []


def test_crash_during_create_leaves_no_half_branch(root, tmp_path, monkeypatch):
    tree = VersionTree(root, tmp_path)
    import hmi.version_tree.tree as tree_mod

    def killed(*a, **kw):
        raise KeyboardInterrupt("killed during the PLOT build")

    monkeypatch.setattr(tree_mod, "build", killed)
    with pytest.raises(KeyboardInterrupt):
        tree.create("half", "root", corpus(), fpt=FAST, progress=False)
    assert "half" not in tree.nodes() and not (tree.dir / "half").exists()
    # a process killed outright leaves its .building folder; the next open removes it
    import os

    (tree.dir / ".building-half-999999999-dead").mkdir()
    (tree.dir / "orphan").mkdir()
    os.utime(tree.dir / "orphan", (1, 1))
    VersionTree(root, tmp_path)
    assert [p.name for p in tree.dir.iterdir() if p.is_dir()] == []


def test_an_updated_domains_old_store_stays_readable_for_lookups_that_hold_it(root, tmp_path):
    tree = VersionTree(root, tmp_path)
    tree.create("legal", "root", corpus(600), 0.5, FAST, progress=False)
    before = tree.lookup("legal")
    ids = np.array([root.tokenizer("the license grants permission to copy")["input_ids"]])
    want = before.merged(ids, np.ones_like(ids))
    tree.update("legal", corpus(200, seed=4), FAST, progress=False)
    tree.forget("legal")
    torch.testing.assert_close(before.merged(ids, np.ones_like(ids)), want)  # an in-flight batch still reads
    after = tree.lookup("legal")
    assert after.chain[0].store.path != before.chain[0].store.path  # new lookups read the new version


def test_a_delete_during_an_update_is_not_undone(root, tmp_path, monkeypatch):
    from hmi.version_tree import tree as tree_module

    tree = VersionTree(root, tmp_path)
    tree.create("legal", "root", corpus(600), 0.5, FAST, progress=False)
    build = tree_module.build_branch

    def build_then_concurrent_delete(*a, **kw):
        node = build(*a, **kw)
        VersionTree(root, tmp_path).delete("legal")  # another process (the server) deletes meanwhile
        return node

    monkeypatch.setattr(tree_module, "build_branch", build_then_concurrent_delete)
    with pytest.raises(DomainError, match="deleted while"):
        tree.update("legal", corpus(200, seed=4), FAST, progress=False)
    assert "legal" not in tree.nodes()
    assert not (tmp_path / "domains" / root.artifact_id / "legal").exists()


def test_a_branch_serves_held_out_text_as_its_further_pretraining_read_it(root, tmp_path):
    """Serving a branch's tenant (lookup along branch -> root) equals the branch's own windowed lower
    layers reading the text with the back-off of a PLOT of the branch's corpus, which is what
    distillation trained on: windows of the corpus are the branch's tri-grams, the others its bi-grams
    or uni-grams, never a root entry computed by another lower side."""
    from hmi.training.calibrate import HeldOutBackoff, token_lists

    lines = corpus()
    tree = VersionTree(root, tmp_path)
    tree.create("legal", "root", lines, alpha=1.0, fpt=FAST, progress=False)
    enc = tree.encoder("legal")
    text = [lines[3] + " zebra quantum " + lines[7], "quantum " + lines[11][:80]]
    batch = root.tokenizer(text, truncation=True, max_length=64, padding=True, return_tensors="np")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lk = tree.lookup("legal")
    got = lk.merged(ids, mask)
    with torch.no_grad():
        want = enc(torch.from_numpy(ids), torch.from_numpy(mask),
                   HeldOutBackoff(token_lists(root.tokenizer, lines, 64)).serve(None))
    m = mask.astype(bool)
    torch.testing.assert_close(got[m], want[m], atol=2e-2, rtol=0)
    assert lk.hits["trigram:legal"] > 0 and lk.hits["unigram:legal"] > 0
    assert not any(level.endswith(":root") for level, n in lk.hits.items() if n)


def test_a_stopped_distillation_continues_from_its_checkpoint_to_the_weights_of_an_uninterrupted_run(root, tmp_path):
    import copy

    from hmi.training.fit import Cancelled

    cfg = dataclasses.replace(FAST, steps=10, checkpoint_every=4)
    lines = corpus(200, seed=3)
    whole = copy.deepcopy(root.windowed)
    uninterrupted = further_pretrain(root, whole, lines, cfg, progress=False)

    ckpt = tmp_path / "job.ckpt"
    checks = []

    def stop_before_step_7() -> bool:
        checks.append(1)
        return len(checks) == 7

    with pytest.raises(Cancelled):
        further_pretrain(root, copy.deepcopy(root.windowed), lines, cfg, progress=False,
                         should_stop=stop_before_step_7, checkpoint=ckpt)
    assert ckpt.is_file()
    again = copy.deepcopy(root.windowed)  # a new worker starts again from the parent's weights
    resumed = further_pretrain(root, again, lines, cfg, progress=False, checkpoint=ckpt)
    assert resumed["resumed_at_step"] == 4 and resumed["steps"] == 10
    assert resumed["pooled_cosine_before"] == uninterrupted["pooled_cosine_before"]
    want = whole.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in again.state_dict().items())

    other = copy.deepcopy(root.windowed)  # another corpus: the checkpoint is not its own
    fresh = further_pretrain(root, other, corpus(200, seed=4), cfg, progress=False, checkpoint=ckpt)
    assert "resumed_at_step" not in fresh


def _entries(store_dir):
    from hmi.plot.store import PlotStore

    store = PlotStore(store_dir)
    try:
        keys = store.keys()
        return keys, store.get_many(keys)[0]
    finally:
        store.close()


def test_a_branch_job_killed_in_its_plot_build_goes_on_from_the_last_chunk_written(root, tmp_path, monkeypatch):
    """A job that keeps a checkpoint builds its branch's PLOT beside it: run again after a kill,
    it goes on from the last chunk written (not from nothing) and ends with the PLOT of an
    uninterrupted build, leaving nothing beside the checkpoint."""
    import hmi.version_tree.tree as tree_mod
    from hmi.plot.build import build as real_build

    chunk = 4096

    def small_chunks(*a, kill_after=None, **kw):
        def hear(fraction, info):
            if kill_after is not None and info["entries"] >= kill_after:
                raise KeyboardInterrupt("killed during the PLOT build")
        return real_build(*a, **{**kw, "batch_windows": chunk, "on_progress": hear})

    lines, tree = corpus(seed=5), VersionTree(root, tmp_path)
    ckpt = tmp_path / "jobs" / "job.ckpt"
    ckpt.parent.mkdir()
    monkeypatch.setattr(tree_mod, "build", lambda *a, **kw: small_chunks(*a, kill_after=3 * chunk, **kw))
    with pytest.raises(KeyboardInterrupt):
        tree.create("legal", "root", lines, fpt=FAST, progress=False, checkpoint=ckpt)
    assert tree_mod.kept_plot_dir(ckpt).is_dir()
    monkeypatch.setattr(tree_mod, "build", small_chunks)
    again = tree.create("legal", "root", lines, fpt=FAST, progress=False, checkpoint=ckpt)
    assert again.plot["resumed_from"] == 3 * chunk and not tree_mod.kept_plot_dir(ckpt).exists()

    whole = tree.create("legal-whole", "root", lines, fpt=FAST, progress=False)
    assert whole.plot["resumed_from"] == 0 and whole.plot["entries"] == again.plot["entries"]
    (k1, v1), (k2, v2) = (_entries(tree.node_dir(node) / "plot") for node in (again, whole))
    assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


@pytest.mark.skipif(not kernels.NATIVE_BF16, reason="the CPU has no native bf16: bf16 GEMMs change nothing here")
def test_a_domain_branch_of_mpnet_base_distils_its_steps_as_the_roots_calibration_does(root):
    """mpnet-base's recipe computes a step with bf16 GEMMs and windows on their present tokens; a
    domain branch's distillation on it does too (said in its result), the default root's not."""
    import copy

    from hmi.training.further_pretrain import step_kernels

    assert step_kernels(root) == {}
    cfg = dataclasses.replace(FAST, steps=3)
    lines = corpus(120, seed=5)
    onednn = dataclasses.replace(root, bert=kernels.use_onednn_linear(copy.deepcopy(root.bert)))
    mpnet = dataclasses.replace(onednn, spec=dataclasses.replace(root.spec, source="mpnet-base"))
    assert step_kernels(mpnet) == {"bf16": True, "present_tokens": True}
    plain, branch = copy.deepcopy(root.windowed), copy.deepcopy(root.windowed)
    ref = further_pretrain(onednn, plain, lines, cfg, progress=False)
    got = further_pretrain(mpnet, branch, lines, cfg, progress=False)
    assert got["step_kernels"] == {"bf16": True, "present_tokens": True} and "step_kernels" not in ref
    want = plain.state_dict()
    diffs = [float((v - want[k]).abs().max()) for k, v in branch.state_dict().items() if v.is_floating_point()]
    # bf16 products: near the fp32 run's weights, not at them (the present tokens alone, in fp32,
    # differ from it by about 1e-7)
    assert 1e-5 < max(diffs) < 0.05


def test_eval_accuracy_serves_a_task_on_its_domains_branch_with_cells_of_its_own_and_names_a_missing_branchs_command(
        root, tmp_path):
    """``eval_accuracy.py --branches``: a task's PLOT columns read the chain a tenant of the task's domain
    is served on, keyed by the branch's PLOT so that no root-PLOT cell (nor an earlier build's) is read
    back as the branch's; without the branch the run stops before training, saying how to make it."""
    from benchmarks.eval_accuracy import HBERT_DISTILLED, cell_key, task_chain

    tree = VersionTree(root, tmp_path)
    on_root = tree.version("root")
    assert task_chain(None, on_root, "review-sentiment", "") == ([on_root], None)
    with pytest.raises(SystemExit, match="hmi domain create reviews --corpus reviews --root mpnet-base`"):
        task_chain(tree, on_root, "review-sentiment", " --root mpnet-base")
    tree.create("reviews", "root", corpus(), alpha=0.5, fpt=FAST, progress=False)
    chain, branch = task_chain(tree, on_root, "review-sentiment", "")
    assert [v.name for v in chain] == ["reviews", "root"] and chain[1] is on_root
    assert branch["name"] == "reviews" and branch["entries"] == tree.nodes()["reviews"].plot["entries"] > 0
    key = {"task": "review-sentiment", "train": 640, "scheme": HBERT_DISTILLED, "transfer": 2000, "distil": [2.0, 0.5]}
    assert cell_key("review-sentiment", 640, HBERT_DISTILLED, None, False, 2000, 0.5, None) == key
    assert cell_key("review-sentiment", 640, HBERT_DISTILLED, None, False, 2000, 0.5, None,
                    [branch["name"], branch["plot"]]) == {**key, "branch": ["reviews", branch["plot"]]}
    tree.update("reviews", corpus(seed=3), fpt=FAST, progress=False)  # another build of the branch: other cells
    assert task_chain(tree, on_root, "review-sentiment", "")[1]["plot"] != branch["plot"]
