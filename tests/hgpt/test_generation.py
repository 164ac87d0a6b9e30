import numpy as np
import pytest
import torch

from hmi.adapters.spec import AdapterSpec
from hmi.hgpt.generation import EngineConfig, GenerationEngine, GenerationError, GenRequest
from hmi.model.decoder import run_layers
from tests.conftest import DEVICES
from tests.helpers.generation import L_LOW, PROMPTS, VOCAB, CharTokenizer, engine, world  # noqa: F401


def reference_greedy(world, tenant, prompt, n):
    """Library model, one tenant, no cache: the whole text through the upper layers at every step."""
    root, lookup, lib, _ = world
    lib.set_active_adapters(tenant)
    ids = CharTokenizer()(prompt)["input_ids"]
    for _ in range(n):
        arr = np.array([ids])
        h = lookup.merged(arr, np.ones_like(arr))
        out = run_layers(root, lib.model.layers[L_LOW:], h, torch.ones(1, len(ids), dtype=torch.long))
        ids.append(int(lib.lm_head(lib.model.norm(out))[0, -1].argmax()))
    lib.set_active_adapters(None)
    return CharTokenizer().decode(ids[len(CharTokenizer()(prompt)["input_ids"]):])


@pytest.mark.parametrize("device", DEVICES)
def test_batched_multi_tenant_lora_generation_equals_the_library_one_tenant_at_a_time_without_cache(world, device):
    """On a GPU: upper layers, KV cache and LoRA pool there; the reference runs on the CPU."""
    e = engine(world, device=device)
    got = e.generate([GenRequest(t, p, max_new_tokens=6) for t, p in PROMPTS])
    for (t, p), r in zip(PROMPTS, got):
        assert r["text"] == reference_greedy(world, t, p, 6), (t, p)
        assert r["finish_reason"] == "length" and r["tokens"] == 6


@pytest.mark.parametrize("device", DEVICES)
def test_requests_that_finish_at_different_steps_and_join_late_get_their_solo_results(world, device):
    lengths = [3, 9, 1, 7, 5, 2]
    batch = engine(world, max_active=3, device=device).generate([GenRequest(t, p, max_new_tokens=n) for (t, p), n in zip(PROMPTS, lengths)])
    for (t, p), n, r in zip(PROMPTS, lengths, batch):
        solo = engine(world).generate([GenRequest(t, p, max_new_tokens=n)])[0]
        assert r == solo
        assert r["tokens"] == n


def test_sampling_is_reproducible_with_a_seed_and_streams_the_final_text(world):
    pieces = []
    reqs = [GenRequest("t0", "hello", max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7, on_text=pieces.append),
            GenRequest("t0", "hello", max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7)]
    a, b = engine(world).generate(reqs)
    assert a["text"] == b["text"]
    assert "".join(pieces) == a["text"]


def test_stop_strings_end_the_completion_before_the_stop_and_are_never_streamed(world):
    full = engine(world).generate([GenRequest("t1", "the cat sat on", max_new_tokens=12)])[0]["text"]
    stop = full[4:6]
    pieces = []
    r = engine(world).generate([GenRequest("t1", "the cat sat on", max_new_tokens=12, stop=(stop,), on_text=pieces.append)])[0]
    assert r["text"] == full[:full.find(stop)]
    assert r["finish_reason"] == "stop"
    assert "".join(pieces) == r["text"]


@pytest.mark.parametrize("kw,code", [({"prompt": ""}, "bad_prompt"), ({"max_new_tokens": 0}, "bad_max_new_tokens"),
                                     ({"temperature": -1}, "bad_temperature"), ({"top_p": 0}, "bad_top_p"),
                                     ({"stop": ["a"] * 9}, "bad_stop"), ({"prompt": "y" * 200}, "input_too_long")])
def test_invalid_requests_are_refused_with_a_named_error(world, kw, code):
    args = {"tenant": "t0", "prompt": "hi", **kw}
    with pytest.raises(GenerationError) as err:
        engine(world).submit(GenRequest(**args))
    assert err.value.code == code


def test_an_unknown_tenant_fails_alone(world):
    e = engine(world)
    ok = GenRequest("t0", "hello", max_new_tokens=3)
    bad = GenRequest("nobody", "hello", max_new_tokens=3)
    e.submit(ok)
    e.submit(bad)
    while e.waiting or e.active:
        e.step()
    assert ok.future.result()["tokens"] == 3
    assert isinstance(bad.future.exception(), KeyError)


def test_tenants_get_their_own_adapters(world):
    out = engine(world).generate([GenRequest(t, "hello world", max_new_tokens=8) for t in ("t0", "t1", "t2")])
    assert len({r["text"] for r in out}) == 3


def test_lora_fine_tune_lowers_dev_loss_resumes_from_saved_weights_and_serves(world, tmp_path):
    from hmi.adapters.store import AdapterStore
    from hmi.training.finetune_lm import LmFinetuneConfig, finetune_lm

    root, lookup, _, _ = world
    text = ["the quick brown fox jumps over the lazy dog", "a quick brown dog jumps over the lazy fox"] * 4
    cfg = LmFinetuneConfig(epochs=3, batch_size=4, lr=1e-2, patience=3, max_len=48)
    w, m = finetune_lm(root, lookup, AdapterSpec.decoder(rank=4, alpha=8), text, text[:2], cfg, progress=False)
    assert m["dev_ppl_after"] < m["dev_ppl_before"]
    w2, m2 = finetune_lm(root, lookup, AdapterSpec.decoder(rank=4, alpha=8), text, text[:2],
                         LmFinetuneConfig(epochs=1, lr=1e-2, max_len=48), init=w, progress=False)
    assert m2["dev_ppl_before"] == pytest.approx(m["dev_ppl_after"], rel=1e-3)  # continues where it stopped
    store = AdapterStore(tmp_path / "tenants")
    store.save("fox", AdapterSpec.decoder(rank=4, alpha=8), w2)
    e = GenerationEngine(root, lookup, lambda t: (AdapterSpec.from_dict(store.info(t)["spec"]), store.load(t)),
                         EngineConfig(rank=4, max_len=96))
    out = e.generate([GenRequest("fox", "the quick brown", max_new_tokens=10)])[0]
    assert out["tokens"] == 10


def test_decoder_calibration_moves_window_states_toward_the_full_context_states(world, tmp_path):
    import json

    from hmi.model.decoder import full_hidden, windowed_hidden
    from hmi.training.calibrate_decoder import DecoderCalibrationConfig, calibrate_decoder, save_decoder_artifact

    root = world[0]
    lines = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps in the sun all day"] * 8
    lower, info = calibrate_decoder(root, lines, DecoderCalibrationConfig(steps=40, batch_size=4, lr=3e-3), progress=False)
    enc = CharTokenizer()(lines[:2], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    m = mask.bool()
    target = full_hidden(root, ids, mask, root.l_low)[m]
    before = ((windowed_hidden(root, ids.numpy(), mask.numpy())[m] - target) ** 2).mean()
    after = ((windowed_hidden(root, ids.numpy(), mask.numpy(), lower)[m] - target) ** 2).mean()
    assert after < 0.7 * before
    assert all(not p.requires_grad for p in root.model.parameters())  # the shared model is untouched
    name = save_decoder_artifact(root, lower, info, tmp_path)
    assert (tmp_path / "roots" / "current_decoder").read_text() == f"{name}-l{root.l_low}"
    assert json.loads((tmp_path / "roots" / f"{name}-l{root.l_low}" / "meta.json").read_text())["l_low"] == root.l_low


def test_a_tenant_that_floods_the_generation_service_waits_behind_itself_and_alone_is_refused(world):
    from hmi.hgpt.generation import GenerationService
    from hmi.scheduler.fair import TenantQueueFullError

    service = GenerationService(engine(world, max_active=1), tenant_queue=12)
    done: list[str] = []
    try:
        futures = []
        for i, tenant in enumerate(["t0"] * 12 + ["t1"] * 2):
            req = GenRequest(tenant, "hello world", max_new_tokens=4)
            futures.append(service.submit(req))
            futures[-1].add_done_callback(lambda _f, name=f"{tenant}:{i}": done.append(name))
        with pytest.raises(TenantQueueFullError):  # t0 holds its queue's limit: only t0 is refused
            for _ in range(13):
                service.submit(GenRequest("t0", "hello world", max_new_tokens=4))
        service.submit(GenRequest("t2", "abc", max_new_tokens=1))
        for f in futures:
            f.result(timeout=120)
        quiet = [k for k, name in enumerate(done) if name.startswith("t1")]
        assert len(quiet) == 2 and max(quiet) <= 5, done  # not after t0's twelve, as first come first served would
    finally:
        service.shutdown()
