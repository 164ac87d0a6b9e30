"""Distillation of a served adapter from a teacher (``hmi.training.distil``): the loss against a
written-out reference, the positions a tagging teacher answers, and a fine-tune on a real PLOT
lookup whose unlabeled texts carry the teacher's answers into the student."""

import math
from dataclasses import replace

import pytest
import torch

from benchmarks.bench_tenants import FullContextLower
from hmi.adapters.spec import AdapterSpec
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import default_spec, load_tokenizer
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from hmi.training.distil import Distillation, unlabeled
from hmi.training.examples import IGNORE
from hmi.training.finetune import FinetuneConfig, finetune, fit, tenant_model
from tests.conftest import tiny_bert

H, L_LOW = 32, 2


def reference_loss(logits, y, soft, where, t, w):
    """The loss written out in fp64, one position at a time."""
    logits, soft = logits.double().reshape(-1, logits.shape[-1]), soft.double().reshape(-1, soft.shape[-1])
    y, where = y.reshape(-1), where.reshape(-1)
    ce = [-(logits[i] - logits[i].exp().sum().log())[y[i]] for i in range(len(y)) if y[i] != IGNORE]
    kl = []
    for i in range(len(where)):
        if where[i]:
            p = (soft[i] / t).softmax(-1)
            q = (logits[i] / t).softmax(-1)
            kl.append(float((p * (p.log() - q.log())).sum()))
    ce_mean = float(sum(ce) / len(ce)) if ce else 0.0
    return (1 - w) * ce_mean + w * t * t * (sum(kl) / len(kl) if kl else 0.0)


@pytest.mark.parametrize("tagging", [False, True])
def test_the_loss_is_the_labels_cross_entropy_and_the_teachers_divergence_weighted(tagging):
    g = torch.Generator().manual_seed(0)
    shape = (4, 6, 5) if tagging else (8, 5)
    logits, soft = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g) * 3
    y = torch.randint(0, 5, shape[:-1], generator=g)
    y[torch.rand(shape[:-1], generator=g) < 0.4] = IGNORE  # unlabeled examples, later sub-tokens
    where = torch.rand(shape[:-1], generator=g) < 0.7
    d = Distillation(teacher=None, temperature=2.0, weight=0.3)
    got = float(d.loss(logits, y, soft, where))
    # fp32 against fp64: each term is a sum of a few numbers of size ~10, so a few ulps of 10
    assert math.isclose(got, reference_loss(logits, y, soft, where, 2.0, 0.3), rel_tol=0, abs_tol=1e-4)


def test_a_batch_without_labels_is_the_divergence_alone_and_without_teacher_positions_the_labels_alone():
    logits, soft = torch.randn(3, 4), torch.randn(3, 4)
    d = Distillation(teacher=None, temperature=1.0, weight=0.5)
    none = torch.full((3,), IGNORE)
    assert math.isclose(float(d.loss(logits, none, soft, torch.ones(3, dtype=torch.bool))),
                        reference_loss(logits, none, soft, torch.ones(3, dtype=torch.bool), 1.0, 0.5), abs_tol=1e-5)
    y = torch.tensor([0, 1, 2])
    assert math.isclose(float(d.loss(logits, y, soft, torch.zeros(3, dtype=torch.bool))),
                        0.5 * float(torch.nn.functional.cross_entropy(logits, y)), abs_tol=1e-6)


def test_a_tagging_teacher_answers_each_words_first_sub_token_of_an_unlabeled_text():
    tok = load_tokenizer(default_spec().model_dir)
    spec = AdapterSpec("bottleneck", head="tagging", labels=("N", "V"))
    text = "Unbelievably tokenization works"
    (ex,) = unlabeled(tok, [text], spec, 64)
    words = tok(text.split(), is_split_into_words=True).word_ids()
    firsts = [i for i, w in enumerate(words) if w is not None and (i == 0 or words[i - 1] != w)]
    assert len(ex.ids) > len(firsts) + 2  # some word has several sub-tokens
    examples, soft, where = Distillation(lambda exs: [torch.zeros(len(e.ids), 2) for e in exs]).extend(
        tok, [], spec, 64)
    assert examples == [] and soft == [] and where == []
    d = Distillation(lambda exs: [torch.zeros(len(e.ids), 2) for e in exs], texts=[text, "Short one"])
    examples, soft, where = d.extend(tok, [], spec, 64)
    assert torch.nonzero(where[0]).flatten().tolist() == firsts
    assert all(t == IGNORE for t in examples[0].target)  # nothing of an unlabeled text counts as a label
    s, w = Distillation.batch(soft, where, [0, 1], tagging=True)
    assert s.shape == (2, len(examples[0].ids), 2) and w[1, len(examples[1].ids):].sum() == 0


POSITIVE, NEGATIVE = "a wonderful day", "a plain day"


@pytest.fixture
def tiny_lookup(tmp_path):
    bert = tiny_bert(layers=4, hidden=H, vocab=30522)
    enc = WindowedEncoder(bert, L_LOW).eval()
    store = PlotStore(tmp_path / "plot", meta=PlotMeta("tiny", L_LOW, H), readonly=False)
    return bert, load_tokenizer(default_spec().model_dir), PlotLookup([PlotVersion("root", store, enc)], policy="compute")


def test_a_fine_tune_without_dev_examples_runs_every_epoch_and_keeps_the_last(tiny_lookup):
    """Labels at random, a high rate and a patience of one epoch: what a batch's loss does from one
    epoch to the next is noise, and without a dev split the fine-tune neither stops on it nor keeps
    an earlier epoch: the weights it returns are those after its last step."""
    bert, tok, lookup = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4, pooling="mean")
    gen = torch.Generator().manual_seed(0)
    words = ["day", "film", "meal", "story", "song", "game", "book", "trip"]
    rows = [{"text": f"the {a} and the {b}", "label": ("neg", "pos")[int(torch.randint(2, (1,), generator=gen))]}
            for a in words for b in words[:4]]
    cfg = FinetuneConfig(epochs=6, lr=1e-1, batch_size=8, patience=1)
    for seed in range(3):
        model = tenant_model(bert, L_LOW, spec, None, seed)
        last = {}

        def snapshot(fraction, info, model=model, last=last):
            if fraction == 1.0 and not info.get("done"):  # after the last step, before the kept epoch loads
                last.update({k: v.clone() for k, v in model.weights().items()})

        weights, metrics = fit(model, lookup, tok, rows, [], None, replace(cfg, seed=seed), progress=False,
                               on_progress=snapshot)
        assert metrics["epochs_run"] == cfg.epochs and metrics["dev"] is None
        assert weights.keys() == last.keys() and all(torch.equal(weights[k], last[k]) for k in last)


@pytest.mark.parametrize("reader", ["plot", "full-context"])
def test_unlabeled_texts_carry_the_teachers_answers_into_the_student(tiny_lookup, reader):
    """The labelled texts say nothing about "wonderful" (all "neg"); the teacher answers "pos" for
    every text that holds it.  Distilled, the student answers as the teacher on texts it never saw
    labelled; fine-tuned on the labels alone, it answers "neg" throughout.  The same on the PLOT
    lookup (as served) and on the full-context lower layers (eval_accuracy's perfect windows,
    ``--schemes hBERT-full-distilled``)."""
    bert, tok, lookup = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4, pooling="mean")
    wonderful = tok.convert_tokens_to_ids("wonderful")
    subjects = ["the", "my", "our", "your", "this", "that", "his", "her"]
    texts = [f"{s} {'wonderful' if i % 2 else 'plain'} {n}" for i, s in enumerate(subjects)
             for n in ("day", "film", "meal")]
    judged = [{"text": t, "label": "pos" if "wonderful" in t else "neg"} for t in texts]
    train = [{"text": f"{s} plain thing", "label": "neg"} for s in subjects]

    def teacher(exs):
        return [torch.tensor([0.0, 6.0]) if wonderful in e.ids else torch.tensor([6.0, 0.0]) for e in exs]

    cfg = FinetuneConfig(epochs=12, lr=3e-2, batch_size=8, patience=12)

    def trained(distil=None) -> dict:
        if reader == "plot":
            return finetune(bert, L_LOW, lookup, tok, spec, train, [], judged, cfg, progress=False, distil=distil)[1]
        model = tenant_model(bert, L_LOW, spec, None, cfg.seed)
        return fit(model, FullContextLower(bert, L_LOW, "cpu"), tok, train, [], judged, cfg, progress=False,
                   distil=distil)[1]

    plain = trained()
    taught = trained(Distillation(teacher, texts=texts, temperature=1.0, weight=0.9))
    assert plain["test"]["accuracy"] == 0.5  # every text "neg"
    assert taught["test"]["accuracy"] >= 0.9
    assert taught["train"]["n"] == len(train)  # the training metrics count the labelled texts alone


def test_a_teacher_learns_its_task_on_the_full_context_root_and_answers_each_example(tiny_lookup):
    from hmi.training.full_context import train_teacher

    bert, tok, _ = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4, pooling="mean")
    rows = [{"text": f"{s} {w} {n}", "label": "pos" if w == "wonderful" else "neg"}
            for s in ("the", "my", "our", "his") for w in ("wonderful", "plain") for n in ("day", "film")]
    before = [p.detach().clone() for p in bert.parameters()]
    answers, info = train_teacher(bert, tok, spec, rows, [], FinetuneConfig(epochs=30, max_len=16), lr=3e-2)
    assert info["dev"] is None  # without dev examples the last epoch is kept
    exs = unlabeled(tok, [r["text"] for r in rows], spec, 16)
    logits = answers(exs)
    assert [tuple(x.shape) for x in logits] == [(2,)] * len(rows)
    right = sum(int(x.argmax()) == (r["label"] == "pos") for x, r in zip(logits, rows))
    assert right >= 0.9 * len(rows)
    assert all(torch.equal(a, b) for a, b in zip(before, bert.parameters()))  # the root is not touched
    tags = AdapterSpec("bottleneck", head="tagging", labels=("N", "V"))
    answers, _ = train_teacher(bert, tok, tags, [{"tokens": ["dogs", "run"], "tags": ["N", "V"]}], [],
                               FinetuneConfig(epochs=1, max_len=16))
    (ex,) = unlabeled(tok, ["cats sleep soundly"], tags, 16)
    assert tuple(answers([ex])[0].shape) == (len(ex.ids), 2)


@pytest.mark.parametrize("kind", ["bottleneck", "lora"])
def test_a_student_started_from_its_teacher_answers_as_the_teachers_upper_layers_before_any_step(tiny_lookup, kind):
    """``Distillation.start``: a teacher with adapters from ``L_LOW`` up (mode "upper": its lower
    layers are the root's), its weights moved away from the library's zero start; the student built
    from ``upper_weights`` answers exactly as the teacher on the full-context lower layers' output,
    in float64 (the two differ in their order of operations alone, about 1e-15 relative; a key read
    into the wrong layer, site or orientation moves the logits by 1e-2 or more).  A fine-tune given
    that start at learning rate 0 ends where it started."""
    from hmi.training.examples import encode, pad
    from hmi.training.full_context import FullContextModel

    _, tok, lookup = tiny_lookup
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        bert = tiny_bert(layers=4, hidden=H, vocab=30522).double()
        spec = AdapterSpec(kind, labels=("neg", "pos", "mixed"), pooling="mean",
                           **({"reduction_factor": 4} if kind == "bottleneck" else {"rank": 4}))
        teacher = FullContextModel(bert, spec, "upper", L_LOW, seed=0)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in teacher.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        rows = [{"text": t, "label": "neg"} for t in ("a plain day", "my wonderful film was long", "our meal")]
        exs = encode(tok, rows, spec, 16)
        student = tenant_model(bert, L_LOW, spec, teacher.upper_weights(L_LOW))
        ids, mask = pad(exs)  # the lower layers' output in float64 (a fine-tune keeps it in float16, as served)
        got = student.logits(FullContextLower(bert, L_LOW, "cpu").merged(ids, mask), torch.from_numpy(mask))
        want = torch.stack(teacher.answers(exs))
        assert float(want.std()) > 0.1  # the teacher's adapters and head do move its answers
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    finally:
        torch.set_default_dtype(before)
    bert32, _, _ = tiny_lookup
    start = tenant_model(bert32, L_LOW, spec, None, seed=5).weights()  # any start other than a new tenant's (seed 0)
    kept, _ = finetune(bert32, L_LOW, lookup, tok, spec, rows, [], None, FinetuneConfig(epochs=1, lr=0.0, max_len=16),
                       progress=False, distil=Distillation(lambda e: [torch.zeros(3) for _ in e], start=start))
    assert all(torch.equal(kept[k], start[k]) for k in start)


def test_a_probe_first_trains_the_head_alone_and_the_adapters_go_on_from_the_probes_state(tiny_lookup):
    """LP-FT (``probe_epochs``): the probe's epochs move the head and leave the adapters at the
    library's start and the root untouched; a fine-tune after it starts from the probe's state, and
    dev keeps that state when the fine-tune cannot better it (at learning rate 0 it stays there);
    at a learning rate it moves the adapters."""
    from hmi.training.examples import encode
    from hmi.training.full_context import FullContextModel

    bert, tok, _ = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4, pooling="mean")
    rows = [{"text": f"{s} {w} {n}", "label": "pos" if w == "wonderful" else "neg"}
            for s in ("the", "my", "our", "his") for w in ("wonderful", "plain") for n in ("day", "film")]
    exs = encode(tok, rows, spec, 16)
    root = [p.detach().clone() for p in bert.parameters()]

    def trained(epochs: int, lr: float, dev=exs) -> FullContextModel:
        m = FullContextModel(bert, spec, "adapter", 0, seed=0)
        m.train(exs, dev, epochs, lr, seed=0, probe_epochs=3)
        return m

    start = FullContextModel(bert, spec, "adapter", 0, seed=0)
    probed, continued = trained(0, 3e-2), trained(2, 0.0)
    adapters = {k: v for k, v in start.model.state_dict().items() if ".adapters." in k}
    assert adapters and all(torch.equal(probed.model.state_dict()[k], v) for k, v in adapters.items())
    assert not torch.equal(probed.head.weight, start.head.weight)
    assert all(torch.equal(a, b) for a, b in zip(root, bert.parameters()))
    for m in (probed, continued):  # the fine-tune's rate does not reach the probe's epochs
        assert torch.equal(m.head.weight, probed.head.weight)
    assert all(torch.equal(continued.model.state_dict()[k], v) for k, v in adapters.items())
    moved = trained(2, 3e-2, dev=[])  # without dev examples the last epoch is kept: the fine-tune's
    assert any(not torch.equal(moved.model.state_dict()[k], v) for k, v in adapters.items())
    with pytest.raises(ValueError, match="adapter modes"):
        FullContextModel(bert, spec, "head", 0).train(exs, exs, 1, 1e-2, probe_epochs=1)


def test_a_head_rate_of_its_own_moves_the_head_alone_when_the_adapters_rate_is_zero(tiny_lookup):
    """``head_lr`` (a tenant's fine-tune, ``FinetuneConfig.head_lr``, and a full-context model's
    ``train``): the head trains at its own rate, the adapters at the fine-tune's. At an adapter rate
    of 0 the adapters stay at their start and the head moves; without a head rate it stays too."""
    from hmi.training.examples import encode
    from hmi.training.full_context import FullContextModel

    bert, tok, lookup = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4, pooling="mean")
    rows = [{"text": f"{s} {w} {n}", "label": "pos" if w == "wonderful" else "neg"}
            for s in ("the", "my", "our", "his") for w in ("wonderful", "plain") for n in ("day", "film")]
    for head_lr in (None, 3e-2):
        model = tenant_model(bert, L_LOW, spec, None, 0)
        start = model.weights()
        weights, _ = fit(model, lookup, tok, rows, [], None,
                         FinetuneConfig(epochs=2, lr=0.0, head_lr=head_lr, batch_size=8), progress=False)
        heads = [k for k in start if k.startswith("head.")]
        assert heads and all(torch.equal(weights[k], start[k]) for k in start if k not in heads)
        assert any(not torch.equal(weights[k], start[k]) for k in heads) == (head_lr is not None)
        m = FullContextModel(bert, spec, "adapter", 0, seed=0)
        first = {k: v.clone() for k, v in m.model.state_dict().items()}, m.head.weight.detach().clone()
        m.train(encode(tok, rows, spec, 16), [], 2, 0.0, seed=0, head_lr=head_lr)
        assert all(torch.equal(v, first[0][k]) for k, v in m.model.state_dict().items())
        assert (not torch.equal(m.head.weight, first[1])) == (head_lr is not None)


def test_a_teacher_with_dev_examples_is_trained_at_each_pooling_and_rate_and_the_best_on_dev_is_kept(tiny_lookup):
    """As the accuracy tables choose hBERT-adapter's: (cls, mean) x GRID_LRS for classification,
    the rates alone for tagging, in that order, the first of equal dev accuracies kept; the kept
    teacher's answers are its model's."""
    from hmi.training.finetune import GRID_LRS
    from hmi.training.full_context import teacher_options, train_teacher

    bert, tok, _ = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4)
    assert teacher_options(spec, True) == [(p, r) for p in ("cls", "mean") for r in GRID_LRS]
    assert teacher_options(spec, False) == [("cls", GRID_LRS[0])] and teacher_options(spec, True, 0.1) == [("cls", 0.1)]
    tags = AdapterSpec("lora", head="tagging", labels=("N", "V"))
    assert teacher_options(tags, True) == [("cls", r) for r in GRID_LRS]
    rows = [{"text": f"{s} {w}", "label": "pos" if w == "good" else "neg"} for s in ("a", "the", "my") for w in ("good", "bad")]
    answers, info = train_teacher(bert, tok, spec, rows, rows[:4], FinetuneConfig(epochs=2, max_len=16))
    assert [t[:2] for t in info["tried"]] == [list(o) for o in teacher_options(spec, True)]
    devs = [t[2] for t in info["tried"]]
    first_best = devs.index(max(devs))
    assert (info["pooling"], info["lr"], info["dev"]) == (*info["tried"][first_best][:2], max(devs))
    assert info["model"].spec.pooling == info["pooling"] and answers == info["model"].answers


@pytest.mark.parametrize("distilled", [False, True])
def test_a_fine_tune_with_options_serves_the_setting_best_on_dev_as_the_fits_one_by_one_would(tiny_lookup, distilled):
    """A tenant's fine-tune trains each (pooling, rate) of ``dev_options`` and keeps the best on dev
    (the first of equals), as the accuracy tables choose their columns: its weights, pooling and
    scores are those of the same setting fine-tuned alone (features shared between the settings
    change nothing), and ``tried`` lists every setting's dev accuracy in order."""
    from hmi.training.finetune import GRID_LRS, dev_options

    bert, tok, lookup = tiny_lookup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4)
    rows = [{"text": f"{s} {w} {n}", "label": "pos" if w == "good" else "neg"}
            for s in ("a", "the", "my") for w in ("good", "bad") for n in ("day", "film")]
    train, dev = rows[::2], rows[1::2]
    distil = Distillation(lambda exs: [torch.tensor([0.0, 3.0]) for _ in exs], ["my plain meal"]) if distilled else None
    options = dev_options(spec, True, 1e-3)
    assert options == [(p, r) for p in ("cls", "mean") for r in GRID_LRS]
    assert dev_options(spec, True, 1e-3, keep_pooling=True) == [("cls", r) for r in GRID_LRS]
    assert dev_options(spec, False, 1e-3) == [("cls", 1e-3)]
    cfg = FinetuneConfig(epochs=2, max_len=16, batch_size=4)
    weights, metrics = finetune(bert, L_LOW, lookup, tok, spec, train, dev, dev, cfg, progress=False, distil=distil,
                                options=options)
    alone = [finetune(bert, L_LOW, lookup, tok, replace(spec, pooling=p), train, dev, dev, replace(cfg, lr=r),
                      progress=False, distil=distil) for p, r in options]
    devs = [m["dev"]["accuracy"] for _, m in alone]
    assert metrics["tried"] == [[p, r, d] for (p, r), d in zip(options, devs)]
    best = devs.index(max(devs))
    assert metrics["pooling"] == options[best][0] and metrics["config"]["lr"] == options[best][1]
    assert metrics["dev"] == alone[best][1]["dev"] and metrics["test"] == alone[best][1]["test"]
    assert weights.keys() == alone[best][0].keys()
    assert all(torch.equal(weights[k], alone[best][0][k]) for k in weights)
