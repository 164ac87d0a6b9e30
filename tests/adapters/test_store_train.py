
import pytest
import torch

from hmi.adapters.interop import export_library_format, import_library_format
from hmi.adapters.spec import AdapterSpec, SpecError
from hmi.adapters.store import AdapterStore, TenantMissingError
from hmi.model.hplm import WindowedEncoder
from hmi.plot.build import Selection, build, count_ngrams, plan_keys
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.store import PlotMeta, PlotStore
from hmi.training.examples import encode
from hmi.training.finetune import FinetuneConfig, finetune, tenant_model
from tests.conftest import tiny_bert
from tests.helpers.tokenizers import CharTokenizer

H, L_LOW = 32, 2


def random_weights(spec, seed=0):
    bert = tiny_bert(hidden=H)
    t = tenant_model(bert, L_LOW, spec, seed=seed)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return bert, {k: v.half().float() for k, v in t.weights().items()}


def test_store_round_trip_is_fp16_exact_and_atomic_replace(tmp_path):
    spec = AdapterSpec("bottleneck", labels=("a", "b", "c"))
    _, w = random_weights(spec)
    store = AdapterStore(tmp_path / "tenants")
    store.save("acme", spec, w, {"domain": "root"})
    got = store.load("acme")
    assert set(got) == set(w)
    for k in w:
        torch.testing.assert_close(got[k].float(), w[k], atol=0, rtol=0)
    assert store.spec("acme") == spec and store.info("acme")["domain"] == "root"
    store.save("acme", spec, {k: v * 0 for k, v in w.items()})
    assert float(store.load("acme")["head.b"].abs().sum()) == 0.0  # cache invalidated on replace
    assert store.tenants() == ["acme"] and not list(p for p in (tmp_path / "tenants").iterdir() if p.name.startswith("."))
    store.delete("acme")
    with pytest.raises(TenantMissingError):
        store.load("acme")


def test_recovery_on_a_shared_home_spares_the_versions_of_jobs_still_running_elsewhere(tmp_path):
    """A replica starting beside others must not remove what their running jobs wrote but have not
    published yet (a new tenant's first version, a further version, one still being written)."""
    spec = AdapterSpec("bottleneck", labels=("a", "b"))
    _, w = random_weights(spec)
    store = AdapterStore(tmp_path / "tenants")
    store.save("new", spec, w, version="job-new", publish=False)  # first version, not published yet
    store.save("old", spec, w, version="v1")
    store.save("old", spec, w, version="job-upd", publish=False)
    (store.path("old") / ".tmp-job-late-0a1b2c3d").mkdir()  # a save in progress
    store.save("cut", spec, w, version="job-dead", publish=False)  # a job nobody runs any more
    store.save("old2", spec, w, version="v1")
    store.save("old2", spec, w, version="job-gone", publish=False)
    running = {"job-new", "job-upd", "job-late"}
    AdapterStore(tmp_path / "tenants").recover(keep=running.__contains__)
    assert (store.path("new") / "job-new").is_dir() and (store.path("old") / "job-upd").is_dir()
    assert (store.path("old") / ".tmp-job-late-0a1b2c3d").is_dir() and store.current("old").name == "v1"
    assert not store.path("cut").exists() and not (store.path("old2") / "job-gone").exists()
    store.publish("new", "job-new")
    assert store.spec("new") == spec
    AdapterStore(tmp_path / "tenants").recover()  # alone on its home: every unpublished version goes
    assert not (store.path("old") / "job-upd").exists() and not (store.path("old") / ".tmp-job-late-0a1b2c3d").exists()


def test_host_cache_is_bounded_in_bytes(tmp_path):
    spec = AdapterSpec("ia3", labels=("a", "b"))
    _, w = random_weights(spec)
    store = AdapterStore(tmp_path / "t", host_cache_mb=0.001)  # about 1 KB: fits one tenant at most
    for name in ("a1", "a2", "a3"):
        store.save(name, spec, w)
        store.load(name)
    assert store.host_bytes <= max(1024, sum(v.numel() * 2 for v in w.values()))
    assert store.stats["host_evictions"] >= 2


def test_invalid_tenant_names_are_refused(tmp_path):
    store = AdapterStore(tmp_path / "t")
    for bad in ("", "../etc", "A B", "x" * 70, ".hidden"):
        with pytest.raises(ValueError, match="invalid tenant name"):
            store.path(bad)


@pytest.mark.parametrize("kind, pooling", [("bottleneck", "cls"), ("lora", "cls"), ("ia3", "cls"), ("bottleneck", "mean")])
def test_export_import_library_format_round_trip(tmp_path, kind, pooling):
    spec = AdapterSpec(kind, labels=("a", "b"), rank=4, pooling=pooling)
    bert, w = random_weights(spec)
    out = export_library_format(bert, spec, L_LOW, w, tmp_path / "exported")
    assert (out / "adapter_config.json").exists()
    assert any(p.suffix == ".safetensors" for p in out.iterdir() if p.name != "hmi_head.safetensors")
    spec2, w2 = import_library_format(bert, out, L_LOW)
    assert spec2 == spec and set(w2) == set(w)
    for k in w:
        torch.testing.assert_close(w2[k], w[k], atol=1e-6, rtol=0)


def test_import_refuses_a_folder_without_library_config(tmp_path):
    bert = tiny_bert(hidden=H)
    (tmp_path / "x").mkdir()
    with pytest.raises(SpecError, match="adapter_config.json"):
        import_library_format(bert, tmp_path / "x", L_LOW)


# -- fine-tuning on PLOT representations ----------------------------------------------------------

TEXTS = {"pos": ["good great fine", "great good day", "fine good film", "good good good", "great fine day"],
         "neg": ["bad awful poor", "awful bad day", "poor bad film", "bad bad bad", "awful poor day"]}


@pytest.fixture
def tiny_setup(tmp_path):
    bert = tiny_bert(hidden=H, vocab=110)
    enc = WindowedEncoder(bert, L_LOW).eval()
    tok = CharTokenizer()
    rows = [{"text": t, "label": lab} for lab, ts in TEXTS.items() for t in ts]
    ids = tok([r["text"] for r in rows])["input_ids"]
    keys, counts = count_ngrams([[int(i) for i in r if i > 0] for r in ids])
    store = PlotStore(tmp_path / "plot", meta=PlotMeta("tiny", L_LOW, H), readonly=False)
    build(store, enc, plan_keys(keys, counts, Selection("all"), 110), progress=False)
    return bert, PlotLookup([PlotVersion("root", store, enc)]), tok, rows


def test_finetune_learns_a_separable_task_and_reports_metrics(tiny_setup):
    bert, lookup, tok, rows = tiny_setup
    spec = AdapterSpec("lora", labels=("neg", "pos"), rank=4)
    w, m = finetune(bert, L_LOW, lookup, tok, spec, rows * 4, rows, rows, FinetuneConfig(epochs=15, lr=3e-2, batch_size=8, patience=15),
                    progress=False)
    assert m["test"]["accuracy"] >= 0.9 and m["train"]["n"] == 40
    assert set(k for k in w if k.startswith("head.")) == {"head.w", "head.b"}
    assert lookup.hits["trigram:root"] > 0


def test_continue_training_resumes_from_saved_weights(tiny_setup):
    bert, lookup, tok, rows = tiny_setup
    spec = AdapterSpec("bottleneck", labels=("neg", "pos"), reduction_factor=4)
    w1, m1 = finetune(bert, L_LOW, lookup, tok, spec, rows * 4, rows, rows, FinetuneConfig(epochs=3, lr=1e-2, batch_size=8),
                      progress=False)
    # Zero further epochs of learning rate: continuing must start exactly from the saved weights.
    w2, m2 = finetune(bert, L_LOW, lookup, tok, spec, rows, rows, rows, FinetuneConfig(epochs=1, lr=0.0, batch_size=8),
                      init=w1, progress=False)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k])
    assert m2["dev"]["accuracy"] == m1["dev"]["accuracy"]


def test_training_labels_outside_the_spec_are_refused(tiny_setup):
    _, _, tok, rows = tiny_setup
    with pytest.raises(SpecError, match="not in the tenant's label set"):
        encode(tok, rows + [{"text": "x", "label": "meh"}], AdapterSpec(labels=("neg", "pos")), 32)


def test_decoder_specs_need_lora_without_labels_and_default_alpha_to_twice_the_rank():
    spec = AdapterSpec.decoder(rank=4)
    assert spec.alpha == 8.0 and spec.scaling == 2.0 and spec.is_decoder and spec.num_labels == 0
    assert AdapterSpec.from_dict(spec.to_dict()) == spec
    assert AdapterSpec.from_dict({"rank": 4, "alpha": 8.0, "kind": "lora", "head": "lm"}) == spec  # older records
    with pytest.raises(SpecError, match="language-model head"):
        AdapterSpec(kind="bottleneck", head="lm")
    with pytest.raises(SpecError, match="rank"):
        AdapterSpec.decoder(rank=0)


def test_decoder_adapters_saved_under_the_older_names_load_under_the_canonical_ones(tmp_path):
    from hmi.adapters.store import AdapterStore

    store = AdapterStore(tmp_path)
    old = {"layers.0.q_A": torch.ones(2, 4), "layers.0.v_B": torch.ones(4, 2)}
    store.save("t", AdapterSpec.decoder(rank=2), old)
    assert sorted(AdapterStore(tmp_path).load("t")) == ["layers.0.lora.q_A", "layers.0.lora.v_B"]
