"""The learned back-off (miss policies ``learned`` and ``learned+compute``): its lookup against a
window-by-window reference, what training gains on windows the PLOT misses, and a stopped
training resumed."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hmi.bootstrap import learn_served_backoff
from hmi.cli import main
from hmi.model import aliases
from hmi.model.aliases import MPNET
from hmi.model.hplm import WindowedEncoder
from hmi.model.kernels import NATIVE_BF16, bf16_matmuls
from hmi.plot import learned
from hmi.plot.build import Selection, build, count_ngrams, plan_keys
from hmi.plot.hot import HotTier
from hmi.plot.keys import bigram_backoff, encoder_windows, pack, unique_windows
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from hmi.training.backoff import TrainConfig, train
from tests.conftest import tiny_bert

H, VOCAB = 32, 120
META = PlotMeta(root_artifact="tiny-a", l_low=2, hidden_size=H)
SMALL = TrainConfig(steps=120, batch=64, lr=3e-3, width=64, samples=4000, held_out=200, checkpoint_every=20)


def texts(n: int, seed: int) -> list[list[int]]:
    """Token-id sequences whose tri-grams repeat: each next id depends on the one before."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = [int(rng.integers(1, VOCAB))]
        for _ in range(11):
            ids.append(int((ids[-1] * 7 + rng.integers(0, 6)) % (VOCAB - 1) + 1))
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def encoder():
    return WindowedEncoder(tiny_bert(hidden=H, vocab=VOCAB), 2).eval()


@pytest.fixture(scope="module")
def plot(tmp_path_factory, encoder):
    """A PLOT of every n-gram of 600 sequences (and every uni-gram of the vocabulary)."""
    path = tmp_path_factory.mktemp("plot") / "p"
    keys, counts = count_ngrams(texts(600, seed=0))
    store = PlotStore(path, meta=META, readonly=False)
    build(store, encoder, plan_keys(keys, counts, Selection("all"), VOCAB), progress=False)
    store.close()
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, plot):
    path = tmp_path_factory.mktemp("trained") / "p"
    shutil.copytree(plot, path)
    store = PlotStore(path, readonly=True)
    record = train(store, SMALL, progress=False)
    return store, record


def unseen_windows(store: PlotStore) -> np.ndarray:
    """Distinct windows of new sequences of real tokens that the PLOT does not hold. Shapes: (U, 3)."""
    ids = np.array(texts(80, seed=1))
    mask = np.ones_like(ids)
    uniq, _ = unique_windows(encoder_windows(ids, mask), mask)
    _, found = store.get_many(pack(uniq))
    uniq = uniq[~found]
    return uniq[(uniq[:, 0] > 0) & (uniq[:, 2] > 0)]


def reference(model, store: PlotStore, window: np.ndarray) -> np.ndarray:
    """One window as the miss policy ``learned`` serves it, computed on its own: the tri-gram when
    held, else the model's estimate from the back-off. Shapes: window (3,) -> (3, H) float32."""
    key = pack(window[None])
    value, found = store.get_many(key)
    if found[0]:
        return value[0].astype(np.float32)
    served, from_bigram = learned.served_backoff(store, key)
    z = np.zeros(1, dtype=np.int64)
    left, _ = store.get_many(pack(np.stack([z, window[None, 0], z], -1)))
    right, _ = store.get_many(pack(np.stack([z, window[None, 2], z], -1)))
    context = np.stack([left[:, 1], right[:, 1]], 1)
    with torch.no_grad():
        out = model(torch.from_numpy(served), torch.from_numpy(context), torch.from_numpy(from_bigram))
    return out[0].numpy()


def test_the_learned_policy_equals_a_window_by_window_reference(trained, encoder, monkeypatch):
    monkeypatch.setattr(learned, "SERVE_BF16", False)  # the fp32 products of the reference; bf16: the next test
    store, _ = trained
    model = learned.load(store.path)
    unseen = unseen_windows(store)
    _, held = store.get_many(pack(np.array(texts(1, seed=0))[:, :3]))
    windows = np.concatenate([unseen[:40], np.array(texts(1, seed=0))[:, :3]])  # misses and one held tri-gram
    assert held.all() and len(unseen) >= 40
    got, hits = PlotLookup([PlotVersion("root", store, encoder)], policy="learned").window_reps(windows)
    want = np.stack([reference(model, store, w) for w in windows])
    np.testing.assert_allclose(got.astype(np.float32), want, atol=2e-3, rtol=2e-3)
    assert hits["learned"] == 40 and hits["trigram:root"] == 1


def test_learned_compute_computes_the_misses_that_would_fall_to_the_unigram_and_estimates_the_rest(trained, encoder):
    store, _ = trained
    rng = np.random.default_rng(3)
    # unseen windows of the texts' kind (their bi-grams mostly held) and random ones (mostly not)
    windows = np.unique(np.concatenate([unseen_windows(store)[:40], rng.integers(1, VOCAB, size=(40, 3))]), axis=0)
    _, tri = store.get_many(pack(windows))
    _, bi = store.get_many(bigram_backoff(pack(windows)))
    far, near = ~tri & ~bi, ~tri & bi
    assert far.sum() >= 10 and near.sum() >= 10
    version = PlotVersion("root", store, encoder)
    got, hits = PlotLookup([version], policy="learned+compute").window_reps(windows)
    exact, _ = PlotLookup([version], policy="compute").window_reps(windows)
    estimated, _ = PlotLookup([version], policy="learned").window_reps(windows)
    # each row as the policy it borrows serves it; the products run over other batches of rows, so
    # a row may round to the next float16 value (2^-10 relative) where the summation order differs
    np.testing.assert_allclose(got[far].astype(np.float32), exact[far].astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got[~far].astype(np.float32), estimated[~far].astype(np.float32), rtol=2e-3, atol=2e-3)
    assert (hits["computed"], hits["learned"], hits["trigram:root"]) == (far.sum(), near.sum(), tri.sum())


def test_neighbour_states_gathered_from_the_centre_table_equal_those_read_from_the_plot(trained):
    """The table reads a token's uni-gram at its first use and keeps it: a second batch of
    windows, partly over the same tokens, gathers the same rows as reading the PLOT again."""
    store, _ = trained
    keys = pack(np.concatenate([unseen_windows(store), [[0, 5, 0], [VOCAB - 1, 3, 0]]]))  # 0: no uni-gram, zeros
    table = learned.CentreTable(store, VOCAB)
    half = len(keys) // 2
    for part in (keys[:half], keys, keys[half:]):
        assert np.array_equal(learned.neighbour_states(store, part, table), learned.neighbour_states(store, part))
    assert 0 < table.known.sum() < VOCAB  # only the tokens asked for were read


def test_the_lookups_of_chains_through_one_version_share_its_learned_backoff(trained, plot, encoder):
    store, _ = trained
    root = PlotVersion("root", store, encoder)
    branch = PlotVersion("branch", PlotStore(plot, readonly=True), encoder)  # a PLOT without a model
    first = PlotLookup([root], policy="learned").learned
    second = PlotLookup([branch, root], policy="learned").learned
    assert first[0] is second[0] is root and first[1] is second[1]


def test_the_learned_policy_serves_the_same_through_a_hot_tier_holding_the_whole_plot(trained, encoder):
    store, _ = trained
    windows = np.concatenate([unseen_windows(store)[:40], np.array(texts(3, seed=0))[:, :3]])
    plain, plain_hits = PlotLookup([PlotVersion("root", store, encoder)], policy="learned").window_reps(windows)
    hot = PlotVersion("root", store, encoder, hot=HotTier.whole(store))
    got, hits = PlotLookup([hot], policy="learned").window_reps(windows)
    assert np.array_equal(got, plain)
    assert hits["learned"] == plain_hits["learned"] == 40 and hits["hot"] > 0


@pytest.mark.skipif(not NATIVE_BF16, reason="the CPU does not multiply bf16 natively: serving stays in fp32")
def test_the_bf16_estimate_keeps_the_fp32_estimate_where_the_cpu_multiplies_bf16(trained):
    store, _ = trained
    model = learned.load(store.path)
    keys = pack(unseen_windows(store))
    served, from_bigram = learned.served_backoff(store, keys)
    fp32 = learned.estimate(model, store, keys, served, from_bigram, bf16=False).astype(np.float32)
    bf16 = learned.estimate(model, store, keys, served, from_bigram, bf16=True).astype(np.float32)
    assert not np.array_equal(fp32, bf16)  # the products did run in bf16
    cos = F.cosine_similarity(torch.from_numpy(fp32), torch.from_numpy(bf16), dim=-1)
    assert cos.min() > 0.999


def forward_bound(model, served, context, from_bigram, bf16: bool) -> torch.Tensor:
    """How far two computations of ``model.forward`` that sum its first layer's products in other
    orders (fp32 accumulation) can end apart, per output entry: each first-layer sum of K terms
    within 2 gamma_K of the sum of its terms' magnitudes (gamma_K = K u / (1 - K u), u = 2^-24),
    carried through GELU (slope at most 1.13) and the second layer's magnitudes; in bf16 a GELU
    output is rounded before the second product, so a moved input may move it by one bf16 step
    (2^-7 relative); the final fp32 sum with the served rows may round one step apart.
    Shapes: served (N, 3, H); context (N, 2, H); from_bigram (N,) -> (N, 3, H) float64."""
    rnd = (lambda t: t.to(torch.bfloat16).double()) if bf16 else (lambda t: t.double())
    x = rnd(torch.cat([served.flatten(1).float(), context.flatten(1).float(), from_bigram.float()[:, None]], 1))
    w1, b1 = rnd(model.inp.weight.detach()), model.inp.bias.detach().double()
    w2 = rnd(model.out.weight.detach())
    k, u = x.shape[1] + 1, 2.0 ** -24
    gamma = k * u / (1 - k * u)
    d_hidden = 2 * gamma * (x.abs() @ w1.abs().T + b1.abs())
    g = F.gelu(x @ w1.T + b1)
    d_gelu = 1.13 * d_hidden + (2.0 ** -7 * g.abs() if bf16 else 0)
    out = served.double() + (g @ w2.T + model.out.bias.detach().double()).view(served.shape)
    return (d_gelu @ w2.abs().T).view(served.shape) + 2 * u * out.abs()


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.skipif(
    not NATIVE_BF16, reason="the CPU does not multiply bf16 natively: serving stays in fp32"))])
def test_the_projected_estimate_equals_the_model_forward_up_to_the_order_of_its_sums(trained, encoder, bf16):
    """Serving's first layer from per-token terms and the non-zero served rows (ProjectedBackoff)
    against the model's one product over every input, on windows the bi-gram served, windows a
    uni-gram served, and windows whose left row is not zero (the rows a back-off leaves zero are
    skipped only where they are)."""
    store, _ = trained
    model = learned.load(store.path)
    keys = pack(unseen_windows(store))
    served, from_bigram = learned.served_backoff(store, keys, withhold=np.arange(len(keys)) % 2 == 0)
    assert 5 <= from_bigram.sum() <= len(keys) - 5  # both kinds of back-off (the bi-gram withheld from half)
    served[::3, 0] = served[::3, 1]  # a non-zero left row in a third of the windows
    centres = learned.CentreTable(store, VOCAB)
    projected = learned.ProjectedBackoff(model, centres, bf16)
    w = learned.unpack(keys)
    context = torch.from_numpy(learned.neighbour_states(store, keys, centres))
    served_t, flag = torch.from_numpy(served), torch.from_numpy(from_bigram)
    with torch.no_grad(), bf16_matmuls(bf16):
        want = model(served_t, context, flag).double()
        bound = forward_bound(model, served_t, context, flag, bf16)
    for part in (slice(0, len(keys) // 2), slice(None)):  # the per-token terms, computed once, then gathered
        with torch.no_grad():
            got = projected.estimate(served_t[part], w[part, 0], w[part, 2], flag[part]).double()
        excess = (got - want[part]).abs() - bound[part]
        assert excess.max() <= 0, f"{(excess > 0).sum()} entries outside the bound, by up to {excess.max():.3g}"
    assert 0 < projected.known.sum() < VOCAB
    # the lookup serves through the projection of its precision
    version = PlotVersion("root", store, encoder)
    lookup_projected = PlotLookup([version], policy="learned").learned[1][2]
    assert lookup_projected.bf16 == (learned.SERVE_BF16 and NATIVE_BF16)


def test_an_untrained_learned_backoff_serves_exactly_what_the_backoff_serves(tmp_path, plot, encoder):
    path = tmp_path / "p"
    shutil.copytree(plot, path)
    model = learned.LearnedBackoff(H, width=16)  # its output layer starts at zero
    save_file(model.state_dict(), str(path / learned.WEIGHTS))
    (path / learned.CONFIG).write_text(json.dumps({"hidden_size": H, "width": 16}))
    store = PlotStore(path, readonly=True)
    windows = np.concatenate([unseen_windows(store)[:30], np.array([[0, 5, 6], [7, 8, 0], [1, 2, 3]])])
    version = PlotVersion("root", store, encoder)
    got, hits = PlotLookup([version], policy="learned").window_reps(windows)
    want, _ = PlotLookup([version], policy="backoff").window_reps(windows)
    np.testing.assert_array_equal(got, want)
    assert hits["learned"] >= 30  # windows with an edge token ((0, c, r), (l, c, 0)) keep the back-off alone


def test_training_brings_missed_windows_closer_to_their_exact_states_than_the_backoff(trained, encoder):
    store, record = trained
    assert np.mean(record["held_out_cosine_learned"]) > np.mean(record["held_out_cosine_backoff"]) + 0.1
    windows = unseen_windows(store)
    with torch.no_grad():
        exact = encoder.lower(torch.from_numpy(windows)).float()
    version = PlotVersion("root", store, encoder)
    served, _ = PlotLookup([version], policy="backoff").window_reps(windows)
    estimated, _ = PlotLookup([version], policy="learned").window_reps(windows)
    cos = lambda x: F.cosine_similarity(torch.from_numpy(x.astype(np.float32)), exact, dim=-1).mean(0)  # noqa: E731
    # the left row, zeros in every back-off, gains most; no row loses
    assert cos(estimated).mean() > cos(served).mean() + 0.1 and (cos(estimated) > cos(served) - 0.01).all(), \
        (cos(estimated), cos(served))


def stopped_at_step(monkeypatch, store: PlotStore, cfg: TrainConfig, step: int) -> None:
    """Runs a training of ``store`` with ``cfg`` that stops (Ctrl+C) as it draws the batch of
    ``step``; batches are drawn as usual again afterwards."""
    import hmi.training.backoff as backoff

    real, calls = backoff.batch_inputs, []

    def dies(*a):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(backoff, "batch_inputs", dies)
    with pytest.raises(KeyboardInterrupt):
        train(store, cfg, progress=False)
    monkeypatch.setattr(backoff, "batch_inputs", real)


def test_a_stopped_training_resumes_to_the_uninterrupted_weights_bit_for_bit(trained, tmp_path, plot, monkeypatch):
    path = tmp_path / "p"
    shutil.copytree(plot, path)
    store = PlotStore(path, readonly=True)
    stopped_at_step(monkeypatch, store, SMALL, 50)
    assert (path / learned.CHECKPOINT).is_file() and not (path / learned.WEIGHTS).exists()
    (path / learned.WEIGHTS).write_bytes(b"cut short")  # weights a stop left half written, without their record
    assert learned.load(path) is None
    record = train(store, SMALL, progress=False)
    assert not (path / learned.CHECKPOINT).exists()
    resumed, clean = learned.load(path).state_dict(), learned.load(trained[0].path).state_dict()
    assert all(torch.equal(resumed[k], clean[k]) for k in clean)
    assert record["held_out_cosine_learned"] == trained[1]["held_out_cosine_learned"]
    assert train(store, SMALL, progress=False)["up_to_date"]


def test_a_model_trained_with_another_configuration_is_trained_again_and_served_until_replaced(
        tmp_path, plot, monkeypatch):
    path = tmp_path / "p"
    shutil.copytree(plot, path)
    store = PlotStore(path, readonly=True)
    train(store, SMALL, progress=False)
    first = learned.fingerprint(path)
    longer = dataclasses.replace(SMALL, steps=SMALL.steps + 20)
    stopped_at_step(monkeypatch, store, longer, 10)
    assert learned.fingerprint(path) == first  # the first model still serves
    record = train(store, longer, progress=False)
    assert not record.get("up_to_date") and record["steps"] == longer.steps
    assert learned.fingerprint(path) != first
    assert train(store, longer, progress=False)["up_to_date"]


@pytest.mark.parametrize("policy", ["learned", "learned+compute"])
def test_the_learned_policies_without_a_model_name_the_command_that_trains_one(plot, encoder, policy):
    store = PlotStore(plot, readonly=True)
    with pytest.raises(learned.LearnedBackoffMissingError, match="hmi plot learn-backoff"):
        PlotLookup([PlotVersion("root", store, encoder)], policy=policy)


def test_learn_backoff_refuses_a_plot_too_small_to_train_on_and_writes_nothing(tmp_path, encoder):
    path = tmp_path / "p"
    keys, counts = count_ngrams(texts(30, seed=0))  # about 300 tri-grams
    store = PlotStore(path, meta=META, readonly=False)
    build(store, encoder, plan_keys(keys, counts, Selection("all"), VOCAB), progress=False)
    store.close()
    with pytest.raises(SystemExit, match="a learned back-off needs at least 2512 to train on"):
        main(["plot", "learn-backoff", "--path", str(path)])
    with pytest.raises(SystemExit, match="no PLOT at .*hmi plot build"):
        main(["plot", "learn-backoff", "--path", str(tmp_path / "none")])
    assert not any(p.name.startswith("learned_backoff") for p in path.iterdir())


def test_the_default_policy_serves_the_shipped_learned_backoff_of_the_shipped_artifact(tmp_path):
    """``auto`` (the server's default): the learned back-off shipped beside the default root's
    artifact is placed beside its PLOT (checked by sha256) and served; a PLOT with none backs off."""
    from hmi.model.artifact import SHIPPED_DIR, find_shipped
    from hmi.model.root import default_spec, load_bert

    artifact = find_shipped(load_bert(default_spec().model_dir), 3)
    assert artifact is not None and learned.trained(artifact), "the default artifact ships its learned back-off"
    version = SimpleNamespace(store=SimpleNamespace(path=tmp_path / "plot"))  # only the PLOT's path is read
    def root(artifact_id, source=None, l_low=3):  # only its artifact and spec are read
        return SimpleNamespace(artifact_id=artifact_id, spec=SimpleNamespace(source=source, l_low=l_low))

    assert learned.auto_choice(tmp_path / "plot", artifact.name, None, 3) == "learned"  # before it is placed
    assert learned.auto_choice(tmp_path / "plot", "minilm-l3-not-shipped", None, 3) == "backoff"
    assert learned.resolve_policy("auto", version, root("minilm-l3-not-shipped")) == "backoff"
    assert not learned.trained(tmp_path / "plot")
    assert learned.resolve_policy("backoff", version, root(artifact.name)) == "backoff" and not learned.trained(tmp_path / "plot")
    assert learned.resolve_policy("auto", version, root(artifact.name)) == "learned"
    # with its learned back-off placed, the PLOT serves what the root chose on its front
    assert learned.resolve_policy("auto", version, root(artifact.name, "mpnet-base", 6)) == MPNET.miss_policy
    assert learned.fingerprint(tmp_path / "plot") == learned.fingerprint(SHIPPED_DIR / artifact.name)
    damaged = tmp_path / "damaged"
    shutil.copytree(artifact, damaged)
    (damaged / learned.WEIGHTS).write_bytes(b"x" + (damaged / learned.WEIGHTS).read_bytes()[1:])
    with pytest.raises(learned.ShippedBackoffDamagedError, match="damaged"):
        learned.install(tmp_path / "other", damaged)


def test_prepare_trains_the_learned_backoff_auto_serves_where_none_ships_and_only_there(tmp_path, plot, monkeypatch):
    """``hmi prepare``'s last step (``learn_served_backoff``): a root whose choice on its front reads a
    learned back-off gets its root PLOT's trained once; the default root's shipped one is placed,
    not trained; a root whose choice reads none gets none."""
    from hmi.model.artifact import find_shipped
    from hmi.model.root import default_spec, load_bert

    def root(artifact_id, source, l_low):  # only its artifact and spec are read
        return SimpleNamespace(artifact_id=artifact_id, spec=SimpleNamespace(source=source, l_low=l_low))

    path = tmp_path / "p"
    shutil.copytree(plot, path)
    store = PlotStore(path, readonly=True)
    record = learn_served_backoff(root("tiny-a", "/models/tiny", 2), store, SMALL)
    assert record["steps"] == SMALL.steps and learned.trained(path)
    assert learn_served_backoff(root("tiny-a", "/models/tiny", 2), store, SMALL) is None  # trained: nothing to do
    store.close()

    shipped = find_shipped(load_bert(default_spec().model_dir), 3)
    placed = SimpleNamespace(path=tmp_path / "default")  # only the PLOT's path is read
    assert learn_served_backoff(root(shipped.name, None, 3), placed, SMALL) is None
    assert learned.fingerprint(tmp_path / "default") == learned.fingerprint(shipped)

    monkeypatch.setitem(aliases.ALIASES, "mpnet-base", dataclasses.replace(MPNET, miss_policy="compute"))
    other = tmp_path / "q"
    shutil.copytree(plot, other)
    store = PlotStore(other, readonly=True)
    assert learn_served_backoff(root("tiny-a", "mpnet-base", MPNET.l_low), store, SMALL) is None
    assert not learned.trained(other)
    store.close()
