"""Private tenants (split execution) against hosted tenants, side by side on loopback, in one run.

Usage: python benchmarks/bench_private.py [--quick] [--processes 4] [--texts 8]

One server process (the prepared default root) serves N tenants at once, each a client thread
sending requests of ``--texts`` real texts (cut to 64 tokens) one after another:
- hosted: the tenant's adapter on the server, ``POST /v1/tenants/{t}/infer``;
- private: the same adapter on the client (``hmi.split.PrivateModel``, the shipped noise on), the
  server's base executor batching the frozen projections of every client;
- private, unbatched: the same with the executor's cross-client batching off.
The clients run in ``--processes`` processes of their own (one torch thread each); the server and
every client share the machine's cores, so a private request's client work is paid on them too.
Reported: requests/s, p50/p99 latency, round trips and bytes per request, at 1, 8 and 32 clients.

Then the provider as an attacker (``hmi.split.attack``): a private LoRA tenant (rank 8 on every
upper layer's FFN input, B drawn at random so that the update is of a trained one's size) answers
held-out texts while the server records every call; four attackers fit the update of each upper
layer by least squares (on a sample of its output units), against no noise, the paper's noise
(effects computed by the server) and the shipped noise (effects computed by the client).  The
strongest, ``predicted``, knows the token ids and the public root: it predicts each layer's
activations and takes the pooled noise's directions out where the observations depart from the
prediction (``hmi.split.attack``).  And what the shipped noise costs a request.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

from common import adapter_variants, cores_apart, finish, machine, start, table, timeit

CLIENTS = (1, 8, 32)
CLIENT_CPUS: set[int] | None = None  # --apart: the client processes' cores
LOCAL = "private, blind, lower on client"  # the blind split with the lower layers on the client: no server call
GEMM_ROWS = (16, 64, 310, 923, 4096)  # 310: one request of 8 texts; 923: what 32 clients gathered
THROUGHPUT_HEADERS = ("clients", "tenants", "requests/s", "p50 ms", "p99 ms", "round trips / request",
                      "MiB / request", "rows / executor GEMM", "executor busy")


def _client_process(mode, url, jobs, texts, requests, ready, go, results, cpus=None):
    """Runs one client thread per (tenant, token, adapter zip) of ``jobs`` and reports
    (latencies, round trips, bytes) per thread; on ``cpus`` when given."""
    import threading

    if cpus:
        os.sched_setaffinity(0, cpus)

    import torch

    torch.set_num_threads(1)
    from hmi.client import Client
    from hmi.model.root import DEFAULT_L_LOW, default_spec
    from hmi.split.client import BaseClient
    from hmi.split.lower import LocalLower
    from hmi.split.model import PrivateModel
    from hmi.split.noise import ClientNoise

    models = []
    # the blind split with the lower layers here: one copy per process (read-only), no server call
    shared_lower = LocalLower.load(default_spec().model_dir, DEFAULT_L_LOW) if mode == LOCAL else None
    for tenant, token, archive in jobs:
        if mode == "hosted":
            models.append((tenant, Client(url, token), None))
        else:
            base = BaseClient(url, token)
            blind = mode.startswith("private, blind")
            models.append((tenant, base, PrivateModel(base, default_spec().model_dir, DEFAULT_L_LOW, PrivateModel.files_of(archive),
                                                      noise=None if blind else ClientNoise(default_spec().model_dir),
                                                      max_len=64, split="blind" if blind else "projections",
                                                      lower=shared_lower)))
    out = []

    def run(tenant, conn, model):
        lat = []
        for _ in range(requests):
            t = time.perf_counter()
            if model is None:
                conn.infer(tenant, texts, truncate=True)
            else:
                model.infer(texts, truncate=True)
            lat.append(time.perf_counter() - t)
        stats = getattr(conn, "stats", {"round_trips": requests, "bytes_sent": 0, "bytes_received": 0})
        out.append((lat, dict(stats)))

    if mode != "hosted":  # the noise's effects are computed once per client, before the clock starts
        for tenant, _, model in models:
            model.infer(texts[:1], truncate=True)
            model.base.stats.update(round_trips=0, bytes_sent=0, bytes_received=0)
    ready.put(1)
    go.wait()
    threads = [threading.Thread(target=run, args=m) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)


def measure(mode, url, tenants, texts, requests, processes):
    """(requests/s, p50 ms, p99 ms, round trips per request, bytes per request) of ``tenants``
    clients spread over ``processes`` processes."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    parts = [tenants[i::processes] for i in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(mode, url, p, texts, requests, ready, go, results, CLIENT_CPUS))
             for p in parts if p]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    t0 = time.perf_counter()
    go.set()
    rows = [r for _ in procs for r in results.get(timeout=1800)]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    lat = sorted(x for r, _ in rows for x in r)
    n = len(lat)
    trips = sum(s["round_trips"] for _, s in rows) / n
    sent = sum(s["bytes_sent"] + s["bytes_received"] for _, s in rows) / n
    return n / wall, 1000 * statistics.median(lat), 1000 * lat[min(n - 1, int(0.99 * n))], trips, sent


def _trainer_process(url, token, archive, rows, ready, stop, results, cpus=None):
    """A private fine-tune (LoRA on every linear layer, the shipped noise) until ``stop``; reports
    the steps it made meanwhile; on ``cpus`` when given."""
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)

    torch.set_num_threads(1)
    from hmi.model.root import DEFAULT_L_LOW, default_spec
    from hmi.split.client import BaseClient
    from hmi.split.model import PrivateModel
    from hmi.split.noise import ClientNoise
    from hmi.split.train import finetune_private
    from hmi.training.finetune import FinetuneConfig
    from hmi.training.fit import Cancelled

    base = BaseClient(url, token)
    model = PrivateModel(base, default_spec().model_dir, DEFAULT_L_LOW, PrivateModel.files_of(archive),
                         noise=ClientNoise(default_spec().model_dir), max_len=64)
    cfg = FinetuneConfig(epochs=1000, batch_size=16, max_len=64, patience=1000)
    total = -(-len(rows) // cfg.batch_size) * cfg.epochs
    reports = []  # (time, steps done), every few steps

    def on_progress(fraction, info):
        reports.append((time.perf_counter(), round(fraction * total)))
        if len(reports) == 1:
            ready.put(1)

    try:
        finetune_private(model, rows, rows[:16], cfg, on_progress=on_progress, should_stop=stop.is_set)
    except Cancelled:
        pass
    (t0, s0), (t1, s1) = reports[0], reports[-1]
    results.put({"steps": s1 - s0, "steps_per_s": (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0})


def beside_training(url, private, trainer, rows, texts, requests, processes) -> dict:
    """Inference clients' latency alone, then beside a fine-tuning client (its calls at training
    priority; its process shares the cores with the inference clients' and the server's)."""
    ctx = mp.get_context("spawn")
    alone = measure("private", url, private, texts, requests, processes)
    ready, stop, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_trainer_process, args=(url, *trainer, rows, ready, stop, results, CLIENT_CPUS))
    proc.start()
    ready.get(timeout=600)
    beside = measure("private", url, private, texts, requests, processes)
    stop.set()
    trained = results.get(timeout=600)
    proc.join()
    return {"inference_alone_p50_ms": round(alone[1], 1), "inference_alone_p99_ms": round(alone[2], 1),
            "inference_beside_training_p50_ms": round(beside[1], 1),
            "inference_beside_training_p99_ms": round(beside[2], 1),
            "inference_beside_training_over_alone_p50": round(beside[1] / alone[1], 3),
            "training_steps_meanwhile": trained["steps"], "training_steps_per_s": round(trained["steps_per_s"], 2)}


SCHEMES = ("none", "paper", "shipped")


def observed(server, model, texts: list[str], caller: str = "bench-attack"):
    """(everything the server received from ``caller`` while ``model`` answered ``texts`` in
    requests of 16, the answers)."""
    from hmi.split import attack

    recording, answers = attack.Recording(caller), []
    server.executor.observers.append(recording)
    try:
        for i in range(0, len(texts), 16):
            answers += model.infer(texts[i:i + 16], truncate=True)
    finally:
        server.executor.observers.remove(recording)
    return recording, answers


def blind_check(server, url, token, model_dir, l_low, files, texts) -> dict:
    """The default private option (the blind split) against every attacker: the server's received
    tensors with the tenant's adapter and with a zero adapter, compared bit for bit.  Identical,
    nothing the provider sees depends on the adapter: any estimate it makes scores as guessing 0
    (1.0) whatever the number of texts."""
    import torch

    from hmi.split.client import BaseClient
    from hmi.split.model import PrivateModel

    model = PrivateModel(BaseClient(url, token), model_dir, l_low, files, max_len=64, split="blind")
    seen = []
    for zero in (False, True):
        if zero:
            model.load({k: torch.zeros_like(v) for k, v in model.weights().items()})
        seen.append(observed(server, model, texts)[0].calls)
    same = len(seen[0]) == len(seen[1]) and all(a[0] == b[0] and torch.equal(a[1], b[1])
                                                for a, b in zip(seen[0], seen[1]))
    return {"default_private_option": "blind", "server_inputs_identical_with_zero_adapter": same,
            "extraction_error_strongest": 1.0 if same else None,
            "strongest_attacker": "any (the blind split's server inputs do not depend on the adapter)" if same
            else "not established: the server's inputs differ with the adapter"}


def noise_curve(server, url, token, model_dir, l_low, files, texts, lower, bert, weights, spec,
                sample) -> tuple[list[tuple], dict]:
    """The predicting attacker's extraction error on the first upper layer (its input known
    exactly from the token ids: only the noise stands in the way) against the number of texts
    it observed, for each noise setting; with what the setting costs in answers (largest score
    difference from the noiseless model) and the texts a 1/sqrt(n) fit of the curve needs for an
    error of 0.5."""
    import math

    from hmi.split import attack
    from hmi.split.client import BaseClient
    from hmi.split.model import PrivateModel
    from hmi.split.noise import ClientNoise, FreshNoise

    settings = (("shipped: pool of 16", lambda: ClientNoise(model_dir), 16),
                ("pool of 64", lambda: ClientNoise(model_dir, count=64), 64),
                ("fresh, every direction", lambda: FreshNoise(model_dir), None),
                ("fresh, every direction, x10", lambda: FreshNoise(model_dir, scale=10.0), None))
    batches = [b for b in (1, 2, 4, 8, 12, 16, 32, 50) if 16 * b <= len(texts)]
    true = attack.lora_update(weights, 0, "ffn_in", spec.alpha / spec.rank)
    plain = PrivateModel(BaseClient(url, token), model_dir, l_low, files, max_len=64).infer(texts[:16], truncate=True)
    rows, out = [], {}
    for label, make, k in settings:
        model = PrivateModel(BaseClient(url, token), model_dir, l_low, files, noise=make(), max_len=64)
        recording, answers = observed(server, model, texts[:16 * batches[-1]])
        diff = max(abs(a["scores"][c] - b["scores"][c]) for a, b in zip(plain, answers[:16]) for c in a["scores"])
        curve = []
        for b in batches:
            est = attack.predicted(recording.first(b), lower, bert.encoder.layer[l_low:l_low + 1], l_low, k,
                                   getattr(bert, "relative_bias", None), units=sample)[l_low]
            curve.append((16 * b, attack.extraction_error(est, true)))
        key = label.split(":")[0].replace(", ", "_").replace(" ", "_").replace("x10", "scale_10")
        # the first observed count at which the error is under 0.5; past the curve, an extrapolation of
        # error ~ c / sqrt(n) from its last point (where the fit covers the units)
        n_last, e_last = curve[-1]
        needed = next((n for n, e in curve if e < 0.5), None)
        if needed is None and e_last != 1.0:  # 1.0 exactly: the fit covered no unit yet
            needed = n_last * (e_last / 0.5) ** 2
        out[f"noise_curve_{key}"] = [[n, round(e, 4)] for n, e in curve]
        out[f"noise_max_abs_diff_{key}"] = round(diff, 8)
        out[f"texts_for_error_0_5_{key}"] = None if needed is None else int(math.ceil(needed))
        rows.append((label, *(f"{e:.3g}" for _, e in curve), f"{diff:.1e}",
                     "-" if needed is None else f"{needed:,.0f}"))
        print(rows[-1], flush=True)
    out["noise_curve_texts"] = [16 * b for b in batches]
    return rows, out


def attack_setup(server, root, n_texts: int, units: int, seed: int):
    """The attacked tenant: a private LoRA of rank 8 on each upper layer's ``ffn_in`` with random
    B (so an update to find), its archive's files, token, held-out texts and sampled units."""
    import torch

    from hmi.adapters.portable import RootShape, write_encoder
    from hmi.adapters.spec import AdapterSpec
    from hmi.archive import zip_files
    from hmi.data import held_out_texts
    from hmi.split.model import PrivateModel
    from hmi.training.finetune import initial_weights

    c, l_low = root.bert.config, root.l_low
    spec = AdapterSpec(kind="lora", rank=8, alpha=8.0, targets=("ffn_in",), labels=("neg", "pos"))
    weights = initial_weights(c, l_low, spec, seed)
    gen = torch.Generator().manual_seed(seed)
    for li in range(c.num_hidden_layers - l_low):
        weights[f"layers.{li}.lora.ffn_in_B"] = 0.05 * torch.randn(weights[f"layers.{li}.lora.ffn_in_B"].shape,
                                                                   generator=gen)
    shape = RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, l_low, c.hidden_size, root.spec.name)
    files = PrivateModel.files_of(zip_files(write_encoder(spec, weights, shape, "bench-attack"), "bench-attack"))
    token = server.tenants.create_private("bench-attack")
    sample = torch.randperm(c.intermediate_size, generator=gen)[:units].sort().values
    return spec, weights, files, token, held_out_texts(n_texts), sample


def curve(server, url, root, n_texts: int, units: int, seed: int = 0) -> tuple[list[tuple], dict]:
    """The default option's check (``blind_check``) and the projections split's noise curve."""
    from hmi.split import attack

    spec, weights, files, token, texts, sample = attack_setup(server, root, n_texts, units, seed)
    model_dir, l_low, bert = root.spec.model_dir, root.l_low, root.bert
    lower = lambda ids, mask: server.lookup.merged(ids.numpy(), mask.numpy()).float()  # noqa: E731
    res = blind_check(server, url, token, model_dir, l_low, files, texts[:32])
    rows, curve_res = noise_curve(server, url, token, model_dir, l_low, files, texts, lower, bert, weights, spec,
                                  sample)
    true = attack.lora_update(weights, 0, "ffn_in", spec.alpha / spec.rank)
    res.update(curve_res, attack_units_per_layer=units, update_over_weight_first_layer=round(float(
        true.norm() / bert.encoder.layer[l_low].intermediate.dense.weight.norm()), 4))
    server.tenants.delete("bench-attack", server.registry.get("tenants", "bench-attack"))
    return rows, res


def privacy(server, url, root, n_texts: int, units: int, seed: int = 0) -> tuple[list[tuple], dict]:
    """Each attacker's extraction error against each noise scheme, over ``units`` sampled output
    units of every upper layer (the largest over layers), and what the shipped noise costs."""
    from hmi.split import attack
    from hmi.split.base_executor import FrozenLinears
    from hmi.split.client import BaseClient
    from hmi.split.model import PrivateModel
    from hmi.split.noise import ClientNoise, ServerNoise

    bert, l_low, c = root.bert, root.l_low, root.bert.config
    spec, weights, files, token, texts, sample = attack_setup(server, root, n_texts, units, seed)
    frozen = FrozenLinears(bert, l_low).weights
    layers = range(l_low, c.num_hidden_layers)
    model_dir = root.spec.model_dir
    rows, errors, ratio = [], {}, []
    for scheme in SCHEMES:
        base = BaseClient(url, token)
        noise = {"none": None, "paper": ServerNoise(base), "shipped": ClientNoise(model_dir)}[scheme]
        model = PrivateModel(base, model_dir, l_low, files, noise=noise, max_len=64)
        recording = observed(server, model, texts)[0]
        pool = {"none": 0, "paper": noise.count if noise else 0, "shipped": noise.count if noise else 0}[scheme]
        strongest = attack.predicted(recording, lambda ids, mask: server.lookup.merged(ids.numpy(), mask.numpy()).float(),
                                     bert.encoder.layer[l_low:], l_low, pool, getattr(bert, "relative_bias", None),
                                     units=sample)
        for li, layer in enumerate(layers):
            w = frozen[layer, "ffn_in"][0]
            norm = bert.encoder.layer[layer].attention.output.LayerNorm
            true = attack.lora_update(weights, li, "ffn_in", spec.alpha / spec.rank)
            ratio.append(float(true.norm() / w.norm()))
            fits = {"naive": attack.naive(recording, layer, w, norm.weight, units=sample),
                    "informed": attack.informed(recording, layer, w, norm.weight, norm.bias, units=sample),
                    "subspace": attack.subspace(recording, layer, w, norm.weight, 16, units=sample),
                    "predicted": strongest[layer]}
            if scheme == "shipped":  # told the pools' values, so the exact subspaces the noise lies in
                fits["subspace, told"] = attack.subspace(recording, layer, w, norm.weight, 16, units=sample,
                                                         told=(noise.values[layer, "ffn_in"][0],
                                                               noise.values[layer, "ffn_out"][0]))
            for name, est in fits.items():
                err = attack.extraction_error(est, true)
                key = (scheme, name)
                errors[key] = max(errors.get(key, 0.0), err)
                covered = errors.setdefault((scheme, name, "covered"), units)
                errors[scheme, name, "covered"] = min(covered, int(est.covered.sum()))
            if scheme == "shipped":
                floor = attack.noise_floor(true, noise.values[layer, "ffn_out"][0], strongest[layer])
                errors["shipped", "floor"] = max(errors.get(("shipped", "floor"), 0.0), floor)
        names = ("naive", "informed", "subspace", "predicted") + (("subspace, told",) if scheme == "shipped" else ())
        rows.extend((scheme, name, f"{errors[scheme, name]:.3g}", errors[scheme, name, "covered"]) for name in names)
        print(rows[-len(names):], flush=True)
    res = {"extraction_error_without_noise": round(errors["none", "informed"], 6),
           "extraction_error_with_noise": round(errors["shipped", "informed"], 6),
           "extraction_error_paper_noise_naive": round(errors["paper", "naive"], 6),
           "extraction_error_paper_noise_informed": round(errors["paper", "informed"], 6),
           "extraction_error_with_noise_subspace": round(errors["shipped", "subspace"], 6),
           "extraction_error_with_noise_subspace_told": round(errors["shipped", "subspace, told"], 6),
           "extraction_error_with_noise_predicted": round(errors["shipped", "predicted"], 6),
           "extraction_error_paper_noise_predicted": round(errors["paper", "predicted"], 6),
           "extraction_error_without_noise_predicted": round(errors["none", "predicted"], 6),
           # the update's share within the shipped noise's 16 directions: what the predicting attacker cannot see
           "extraction_floor_with_noise_predicted": round(errors["shipped", "floor"], 6),
           "strongest_attacker": "predicted",
           "extraction_error_strongest_projections_shipped_noise": round(min(errors["shipped", name] for name in
                                                                             ("naive", "informed", "subspace",
                                                                              "predicted")), 6),
           "attack_texts": len(texts), "attack_units_per_layer": units,
           "update_over_weight": round(max(ratio), 4)}
    # What the shipped noise costs: its effects once (the projections' weights read, the pool's
    # effects computed), and a request's extra work, against no noise, one client alone.
    batch = texts[:8]
    for scheme in ("none", "shipped"):
        base = BaseClient(url, token)
        noise = ClientNoise(model_dir) if scheme == "shipped" else None
        model = PrivateModel(base, model_dir, l_low, files, noise=noise, max_len=64)
        t = time.perf_counter()
        model.infer(batch, truncate=True)
        first = time.perf_counter() - t
        times = []
        for _ in range(10):
            t = time.perf_counter()
            model.infer(batch, truncate=True)
            times.append(time.perf_counter() - t)
        res[f"noise_{scheme}_first_ms"] = round(1000 * first, 1)
        res[f"noise_{scheme}_p50_ms"] = round(1000 * statistics.median(times), 1)
        res[f"noise_{scheme}_round_trips"] = base.stats["round_trips"] / 11
    server.tenants.delete("bench-attack", server.registry.get("tenants", "bench-attack"))
    return rows, res


# Private fine-tuning options, as the label attacker sees them: (split, noise, where the lower layers run).
FINE_TUNE_OPTIONS = {"projections, shipped noise": ("projections", "shipped", "server"),
                     "blind (the default)": ("blind", None, "server"),
                     "blind, lower layers on the client": ("blind", None, "client")}
DEFAULT_FINE_TUNE_OPTION = "blind (the default)"


def labels(server, url, root, n_examples: int, seed: int = 0) -> tuple[list[tuple], dict]:
    """The label attacker (``attack.labels_from_gradients``) against a private fine-tune of each
    option: LoRA on every linear layer, review sentiment, one epoch of ``n_examples`` in batches of
    16; the share of labels it recovers (up to one global flip) against the majority class's."""
    import numpy as np
    import torch

    from hmi.adapters.portable import RootShape, write_encoder
    from hmi.adapters.spec import AdapterSpec
    from hmi.archive import zip_files
    from hmi.data import load_task
    from hmi.split import attack
    from hmi.split.client import BaseClient
    from hmi.split.lower import LocalLower
    from hmi.split.model import PrivateModel
    from hmi.split.noise import ClientNoise
    from hmi.split.train import finetune_private
    from hmi.training.finetune import FinetuneConfig, initial_weights

    rows = load_task("review-sentiment", "train", n_examples)
    names = sorted({r["label"] for r in rows})
    c = root.bert.config
    spec = AdapterSpec.for_task("classification", tuple(names), "lora", targets="all")
    shape = RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, root.l_low, c.hidden_size, root.spec.name)
    files = PrivateModel.files_of(zip_files(write_encoder(spec, initial_weights(c, root.l_low, spec, seed), shape,
                                                          "bench-labels"), "bench-labels"))
    token = server.tenants.create_private("bench-labels")
    model_dir, cfg = root.spec.model_dir, FinetuneConfig(epochs=1, batch_size=16, max_len=64, seed=seed)
    order = np.random.default_rng(seed).permutation(len(rows))  # the epoch's batches, as the fine-tune runs them
    truth = torch.tensor([names.index(rows[i]["label"]) for i in order])
    out, table_rows = {}, []
    for option, (split, noise, lower) in FINE_TUNE_OPTIONS.items():
        local = LocalLower.load(model_dir, root.l_low) if lower == "client" else None
        base = None if split == "blind" and local is not None else BaseClient(url, token)
        model = PrivateModel(base, model_dir, root.l_low, files, noise=ClientNoise(model_dir) if noise else None,
                             max_len=64, split=split, lower=local)
        recording = attack.Recording("bench-labels")
        server.executor.observers.append(recording)
        t = time.perf_counter()
        try:
            finetune_private(model, rows, [], cfg)
        finally:
            server.executor.observers.remove(recording)
        seconds = time.perf_counter() - t
        guesses = attack.labels_from_gradients(recording, c.num_hidden_layers - 1)
        rate = attack.label_recovery(guesses, truth)
        if split == "projections" and rate < 0.9:  # the attack works there: anything less is a broken ground truth
            raise SystemExit(f"the label attacker recovered {rate:.2f} through the projections split: check the order")
        key = option.split(" (")[0].replace(", ", "_").replace(" ", "_")
        out[f"label_recovery_{key}"] = round(rate, 4)
        out[f"fine_tune_seconds_{key}"] = round(seconds, 1)
        calls = sum(1 for call, _ in recording.calls)
        table_rows.append((option, f"{rate:.3f}", calls, "none" if guesses is None else len(guesses), f"{seconds:.0f}"))
        print(table_rows[-1], flush=True)
    server.tenants.delete("bench-labels", server.registry.get("tenants", "bench-labels"))
    majority = attack.label_recovery(None, truth)
    default_key = DEFAULT_FINE_TUNE_OPTION.split(" (")[0]
    out.update({"label_recovery_majority": round(majority, 4),
                "label_recovery_strongest": out[f"label_recovery_{default_key}"],
                "label_strongest_attacker": "gradients (labels_from_gradients)",
                "label_default_option": DEFAULT_FINE_TUNE_OPTION, "label_attack_examples": len(rows)})
    return table_rows, out


LABEL_HEADERS = ("private fine-tune option", "labels recovered", "calls the server saw",
                 "examples the attacker could read", "fine-tune s")


def throughput(server, url, root, args, requests: int) -> tuple[list[tuple], dict]:
    """Hosted, private and private-unbatched tenants at 1, 8 and 32 clients; and how far a private
    tenant's answers (with the shipped noise) are from the same adapter's hosted ones."""
    from hmi.adapters.portable import RootShape, write_encoder
    from hmi.adapters.spec import AdapterSpec
    from hmi.archive import zip_files
    from hmi.client import Client
    from hmi.data import held_out_texts, load_task
    from hmi.split.client import BaseClient
    from hmi.split.model import PrivateModel
    from hmi.split.noise import ClientNoise

    texts = held_out_texts(args.texts)
    c = root.bert.config
    shape = RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, root.l_low, c.hidden_size, root.spec.name)
    spec = AdapterSpec(labels=("neg", "pos"))
    weights = adapter_variants(root.bert, root.l_low, spec, max(CLIENTS))
    hosted, private = [], []
    for i, w in enumerate(weights):
        token = server.transfer.import_adapter(f"bench-hosted-{i}", "encoder", spec, w)
        archive = zip_files(write_encoder(spec, w, shape, f"bench-{i}"), f"bench-{i}")
        hosted.append((f"bench-hosted-{i}", token, archive))
        private.append((f"bench-private-{i}", server.tenants.create_private(f"bench-private-{i}"), archive))
    want = Client(url, hosted[0][1]).infer(hosted[0][0], texts, truncate=True)
    got = PrivateModel(BaseClient(url, private[0][1]), root.spec.model_dir, root.l_low,
                       PrivateModel.files_of(private[0][2]), noise=ClientNoise(root.spec.model_dir), max_len=64)
    mine = got.infer(texts, truncate=True)
    diff = max(abs(a["scores"][k] - b["scores"][k]) for a, b in zip(want, mine) for k in a["scores"])
    rows, res = [], {"max_abs_diff_vs_hosted": round(diff, 8), "requests_per_client": requests, "texts": args.texts,
                     "processes": args.processes}
    # The table's rows: every client count with requests of --texts texts, then 32 clients with
    # requests of one text (small calls: where batching across clients can pay on a CPU).
    for n, batch, tag in [(n, texts, "") for n in CLIENTS] + [(max(CLIENTS), texts[:1], "_one_text")]:
        for mode, tenants, batching in (("hosted", hosted, True), ("private", private, True),
                                        ("private, unbatched", private, False), ("private, blind", private, True),
                                        (LOCAL, private, True)):
            server.executor.batching = batching
            before = dict(server.executor.stats)
            reqs = requests * (4 if tag else 1)  # small requests: more of them, for a stable rate
            rps, p50, p99, trips, nbytes = measure(mode, url, tenants[:n], batch, reqs, args.processes)
            after = server.executor.stats
            gemm_rows = (after["rows"] - before["rows"]) / max(1, after["batches"] - before["batches"])
            busy = (after["seconds"] - before["seconds"]) / (n * reqs / rps)  # of the run's wall time
            private_only = (lambda v: v) if mode != "hosted" else (lambda v: "-")
            rows.append((f"{n}" + (" (1 text)" if tag else ""), mode, f"{rps:.2f}", f"{p50:.0f}", f"{p99:.0f}",
                         f"{trips:.1f}", f"{nbytes / 2**20:.2f}", private_only(f"{gemm_rows:.0f}"),
                         private_only(f"{100 * busy:.0f}%")))
            res[f"{mode.replace(', ', '_').replace(' ', '_')}_{n}{tag}_rps"] = round(rps, 3)
            print(rows[-1], flush=True)
    server.executor.batching = True
    # What a bigger GEMM buys on this CPU: microseconds a row of one layer's four projections, by
    # rows a GEMM (the executor's own kernels, alone; its thread is otherwise idle here).
    import torch

    lin, layer = server.executor.linears, root.l_low
    for n in GEMM_ROWS:
        xs = {p: torch.randn(n, lin.width(layer, p, "forward")) for p in ("qkv", "attn_out", "ffn_in", "ffn_out")}
        with torch.no_grad():
            sec = timeit(lambda: [lin.run(layer, p, "forward", x) for p, x in xs.items()], repeat=7)
        res[f"gemm_us_per_row_{n}"] = round(1e6 * sec / n, 2)
    trainee = AdapterSpec.for_task("classification", ("fresh", "rotten"), "lora", targets="all")
    w = adapter_variants(root.bert, root.l_low, trainee, 1)[0]
    trainer = (server.tenants.create_private("bench-trainer"), zip_files(write_encoder(trainee, w, shape, "bench-t"),
                                                                          "bench-t"))
    res.update(beside_training(url, private[:8], trainer, load_task("review-sentiment", "train", 256), texts,
                               requests, args.processes))
    print({k: v for k, v in res.items() if k.startswith(("inference", "training"))}, flush=True)
    res["private_over_hosted_32"] = round(res["private_32_rps"] / res["hosted_32_rps"], 3)
    res["blind_over_hosted_32"] = round(res["private_blind_32_rps"] / res["hosted_32_rps"], 3)
    res["blind_lower_on_client_over_hosted_32"] = round(res["private_blind_lower_on_client_32_rps"]
                                                        / res["hosted_32_rps"], 3)
    res["blind_lower_on_client_over_blind_1"] = round(res["private_blind_lower_on_client_1_rps"]
                                                      / res["private_blind_1_rps"], 3)
    res["batched_over_unbatched_32"] = round(res["private_32_rps"] / res["private_unbatched_32_rps"], 3)
    res["private_over_hosted_32_one_text"] = round(res["private_32_one_text_rps"] / res["hosted_32_one_text_rps"], 3)
    res["batched_over_unbatched_32_one_text"] = round(res["private_32_one_text_rps"]
                                                      / res["private_unbatched_32_one_text_rps"], 3)
    return rows, res


def main() -> None:
    global CLIENT_CPUS
    args = start(__doc__, lambda ap: (ap.add_argument("--processes", type=int, default=4),
                                     ap.add_argument("--texts", type=int, default=8),
                                     ap.add_argument("--apart", type=int, default=0, metavar="N",
                                                     help="the client processes on the last N cores, the server on "
                                                          "the others (default: all share every core)"),
                                     ap.add_argument("--part", choices=("all", "throughput", "privacy", "curve", "labels"), default="all",
                                                     help="run one part only (its page: docs/bench_private_<part>.md)")))
    from hmi.bootstrap import prepare_default
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.home import hmi_home
    from hmi.services.server import ServerConfig

    requests = 1 if args.tiny else 3 if args.quick else 10
    if args.apart:
        CLIENT_CPUS, _ = cores_apart(args.apart)  # before the server starts its threads: they inherit the rest
    prepare_default(hmi_home())  # the default root and its root PLOT, when missing
    server = build_server(ServerConfig(max_len=64, max_inputs=64))
    root = server.root
    url, stop = run_in_thread(server)

    def clean():  # bench tenants, also of a run stopped before it cleaned up
        for name, rec in server.registry.items("tenants"):
            if name.startswith("bench-"):
                server.tenants.delete(name, rec)

    clean()
    rows, res, attack_rows, label_rows, curve_rows = [], {}, [], [], []
    try:
        if args.part in ("all", "throughput"):
            rows, res = throughput(server, url, root, args, requests)
        if args.part in ("all", "privacy"):
            attack_rows, attack_res = privacy(server, url, root, 200 if args.quick else 800, 96 if args.quick else 384)
            res.update(attack_res)
        if args.part in ("all", "curve"):
            curve_rows, curve_res = curve(server, url, root, 200 if args.quick else 800, 96 if args.quick else 384)
            res.update(curve_res)
        if args.part in ("all", "labels"):
            label_rows, label_res = labels(server, url, root, 480 if args.quick else 1920)
            res.update(label_res)
    finally:
        clean()
        stop()
    cores = (f"the clients on {args.apart} cores of their own, the server on the others" if args.apart else
             "the server and every client share the machine's cores")
    command = ("python benchmarks/bench_private.py" + (" --quick" if args.quick else "")
               + (f" --processes {args.processes}" if args.processes != 4 else "") + (f" --apart {args.apart}" if args.apart else ""))
    label_text = (f"The provider reads a private fine-tune's labels (review sentiment, {res.get('label_attack_examples')} "
                  "examples, one epoch in batches of 16, LoRA on every linear layer) from the backward calls it "
                  "served (`attack.labels_from_gradients`: each example's gradient row along the direction they "
                  "vary most; recovered up to one global flip). The majority class holds "
                  f"{res.get('label_recovery_majority')} of the labels: what a provider knowing only how labels are "
                  "spread recovers.\n\n" + table(label_rows, LABEL_HEADERS)) if label_rows else ""
    curve_text = ("The default private option: the blind split. The server's inputs with the tenant's adapter and with "
                  f"a zero adapter, bit for bit the same: {res.get('server_inputs_identical_with_zero_adapter')}; so "
                  f"every attacker's extraction error is {res.get('extraction_error_strongest')} (guessing 0) however "
                  "many texts it observes.\n\nThe projections split's noise against the number of texts observed: "
                  "the predicting attacker's extraction error on the first upper layer (its input known exactly from "
                  "the token ids: the noise alone stands in the way), the largest score difference the noise makes "
                  "(exactly subtracted: float32 rounding), and the texts a c / sqrt(n) fit of the last point needs "
                  "for an error of 0.5 (an extrapolation).\n\n"
                  + table(curve_rows, ("noise", *(f"{n} texts" for n in res.get("noise_curve_texts", [])),
                                       "score difference", "texts for error 0.5"))) if curve_rows else ""
    if args.part != "all":  # one part: its own page, docs/bench_private_<part>.md
        if args.part in ("labels", "curve"):
            body = label_text if args.part == "labels" else curve_text
        elif args.part == "privacy":
            body = table(attack_rows, ("noise", "attacker", "extraction error", "units fitted (fewest over layers)"))
        else:
            body = table(rows, THROUGHPUT_HEADERS)
        finish(f"bench_private_{args.part}", f"{machine()}; one part of the benchmark (`--part {args.part}`); {cores}.\n\n"
               + body, res, f"{command} --part {args.part}")
        return
    text = (f"{args.texts} texts of held-out real text a request (cut to 64 tokens), {requests} requests a client in "
            f"a row, clients in {args.processes} processes (one torch thread each); {cores} ({machine()}). Private "
            "tenants with the shipped noise (effects computed by the client, once, before the clock starts). Executor "
            "busy: the executor thread's seconds in GEMMs over the run's wall time (its count includes the "
            "clients' warm-up requests, so it can pass 100%).\n\n"
            + table(rows, THROUGHPUT_HEADERS)
            + f"\n\nprivate (blind split) / hosted at 32 clients: {res['blind_over_hosted_32']}; "
              f"private / hosted at 32 clients: {res['private_over_hosted_32']} (one text a request: "
              f"{res['private_over_hosted_32_one_text']}); cross-client batching / none at 32 clients: "
              f"{res['batched_over_unbatched_32']} (one text a request: {res['batched_over_unbatched_32_one_text']}); "
              "largest score difference private (with noise) vs "
              f"hosted: {res['max_abs_diff_vs_hosted']:.2e}.\n\n"
            + f"Inference beside a private fine-tune (8 private inference clients, then the same beside one client "
              f"fine-tuning LoRA on every linear layer, batches of 16, in a process of its own on the same cores): p50 "
              f"{res['inference_alone_p50_ms']} ms alone, {res['inference_beside_training_p50_ms']} ms beside it "
              f"({res['inference_beside_training_over_alone_p50']}x; p99 {res['inference_alone_p99_ms']} and "
              f"{res['inference_beside_training_p99_ms']} ms); the fine-tune made "
              f"{res['training_steps_meanwhile']} steps meanwhile ({res['training_steps_per_s']} a second).\n\n"
            + "What a bigger GEMM buys here: one layer's four projections, microseconds a row, by rows a GEMM "
              "(the executor's kernels alone): "
            + ", ".join(f"{n} rows {res[f'gemm_us_per_row_{n}']}" for n in GEMM_ROWS) + ".\n\n"
            + f"The provider as an attacker: a private LoRA tenant (rank 8 on each upper layer's FFN input, "
              f"||delta W|| / ||W|| up to {res['update_over_weight']}) answered {res['attack_texts']} held-out texts; "
              f"each attacker fitted {res['attack_units_per_layer']} sampled output units of every upper layer "
              "(extraction error ||est - delta W|| / ||delta W|| over the units it could fit, the largest over "
              "layers; 1 is what guessing 0 scores):\n\n"
            + table(attack_rows, ("noise", "attacker", "extraction error", "units fitted (fewest over layers)"))
            + f"\n\nWhat the shipped noise costs one client alone (8 texts a request): first request "
              f"{res['noise_shipped_first_ms']} ms against {res['noise_none_first_ms']} ms without noise (the "
              f"effects computed once), then p50 {res['noise_shipped_p50_ms']} ms against {res['noise_none_p50_ms']} "
              f"ms; round trips a request {res['noise_shipped_round_trips']:.2f} against "
              f"{res['noise_none_round_trips']:.2f}.\n\n" + curve_text + "\n\n" + label_text)
    finish("bench_private", text, res, command)


if __name__ == "__main__":
    main()
