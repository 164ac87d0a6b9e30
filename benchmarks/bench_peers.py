"""HMI against what a user would run instead, side by side in one process on the same texts.

Usage: python benchmarks/bench_peers.py [--quick]

- **Many adapters on one model, the library way**: Hugging Face PEFT's mixed-adapter batches
  (``adapter_names=[...]`` per row) on the full root, LoRA rank 8 on query and value of the
  upper layers plus a per-tenant classification head (``modules_to_save``), with the stock torch
  kernels a user gets, and again with the linear kernels HMI uses (``hmi.model.kernels``).
- **HMI's hBERT**, the serving path: PLOT lookup and the batched upper layers
  (``hmi.scheduler.pipeline.Scheduler``), the same adapters (weights copied across, so both
  sides compute the same tenant on the same upper layers); again with the whole root PLOT in a
  hot tier (``hmi serve --plot-hot-mb`` of its size: the same values, no LMDB read).
- **bf16** (where the CPU multiplies it natively): HMI with its shared upper layers in bf16
  (``hmi serve --upper-precision bf16``), against the stock PEFT model and against the same PEFT
  model cast to bf16 (``model.to(torch.bfloat16)``, what a PEFT user on this CPU would do); and
  HMI's fastest configuration here, bf16 with the root PLOT in the hot tier.
- **ONNX Runtime**: the full root for one model (an upper bound for one tenant), and the upper
  layers alone with one adapter merged, against HMI's upper layers on the same tokens
  (``hmi_upper_over_ort_upper``: HMI's speed over ONNX Runtime's; 1.0 = as fast).

Batches of 32 news texts cut to 64 and to 128 tokens, tenants drawn uniformly from 1, 100 and
1,000; 5 rounds interleaved (1 with --quick), medians.  PEFT adds adapters one at a time (its
``add_adapter``) and each add takes longer than the last, so it holds at most ``PEFT_CAP`` of them: at 1,000 tenants
its rows are served by ``tenant mod PEFT_CAP`` (its speed with 1,000 resident would be no
higher), and its time to load 1,000 is extrapolated from the measured adds (said so on the page).
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_tenants import scheduler_rps, trace, warm_page_cache  # noqa: E402
from benchmarks.common import DOCS, adapter_variants, cut_texts, finish, machine, prepared_root, round_robin, start, table  # noqa: E402

B, COUNTS, LENGTHS, RANK, LABELS = 32, (1, 100, 1000), (64, 128), 8, tuple("abcde")
PEFT_CAP = 100
DEVICE = None  # main: the scheduler's device


class Classifier(nn.Module):
    """The root with a classification head on [CLS], as a PEFT user would wrap it."""

    def __init__(self, bert, labels: int):
        super().__init__()
        self.bert, self.classifier = bert, nn.Linear(bert.config.hidden_size, labels)

    def forward(self, input_ids, attention_mask):
        return self.classifier(self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0])


def plain_root():
    """The packaged root as transformers loads it (no HMI kernels)."""
    from transformers import BertModel

    from hmi.model.root import packaged_root_dir

    return BertModel.from_pretrained(str(packaged_root_dir()), add_pooling_layer=False, attn_implementation="eager").eval()


def peft_model(weights: list[dict], n: int, l_low: int, hmi_kernels: bool) -> tuple[nn.Module, list[float]]:
    """A PEFT model holding ``n`` adapters (tenant i gets ``weights[i % len(weights)]``); the
    seconds each ``add_adapter`` took."""
    from peft import LoraConfig, get_peft_model

    from hmi.model.kernels import use_onednn_linear

    base = Classifier(plain_root(), len(LABELS)).eval()
    if hmi_kernels:
        use_onednn_linear(base)
    layers = list(range(l_low, base.bert.config.num_hidden_layers))
    cfg = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["query", "value"], layers_to_transform=layers,
                     modules_to_save=["classifier"], lora_dropout=0.0)
    model, adds = None, []
    for i in range(n):
        name, w = f"t{i:05d}", weights[i % len(weights)]
        t = time.perf_counter()
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        adds.append(time.perf_counter() - t)
        with torch.no_grad():
            for j, li in enumerate(layers):
                att = base.bert.encoder.layer[li].attention.self
                for site, lin in (("q", att.query), ("v", att.value)):
                    lin.lora_A[name].weight.copy_(w[f"layers.{j}.lora.{site}_A"])
                    lin.lora_B[name].weight.copy_(w[f"layers.{j}.lora.{site}_B"])
            head = base.classifier.modules_to_save[name]
            head.weight.copy_(w["head.w"].T)
            head.bias.copy_(w["head.b"])
    return model.eval().to(DEVICE), adds


def peft_rps(model, tok, texts, batches, held: int) -> float:
    """Rows per second of PEFT's mixed-adapter batches over the trace (tokenization included), on
    the device HMI's scheduler serves from."""
    n, start_t = 0, time.perf_counter()
    with torch.no_grad():
        for bi, b in enumerate(batches):
            enc = tok([texts[(bi * B + j) % len(texts)] for j in range(len(b))], padding=True, return_tensors="pt")
            model(input_ids=enc["input_ids"].to(DEVICE), attention_mask=enc["attention_mask"].to(DEVICE),
                  adapter_names=[f"t{t % held:05d}" for t in b])
            n += len(b)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start_t)


def merged_upper(bert, l_low: int, w: dict, scaling: float) -> nn.Module:
    """The upper layers with one tenant's LoRA merged into query and value, and its head."""

    class Upper(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = copy.deepcopy(bert.encoder.layer[l_low:])
            with torch.no_grad():
                for j, layer in enumerate(self.layers):
                    for site, lin in (("q", layer.attention.self.query), ("v", layer.attention.self.value)):
                        lin.weight += scaling * w[f"layers.{j}.lora.{site}_B"] @ w[f"layers.{j}.lora.{site}_A"]
            self.head = nn.Linear(bert.config.hidden_size, len(LABELS))
            with torch.no_grad():
                self.head.weight.copy_(w["head.w"].T)
                self.head.bias.copy_(w["head.b"])

        def forward(self, hidden, mask):
            ext = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=ext)[0]
            return self.head(hidden[:, 0])

    return Upper().eval()


def ort_session(module: nn.Module, inputs: tuple, names: list[str], path: Path):
    """``module`` exported to ONNX (legacy exporter, dynamic batch and length) in an ONNX Runtime
    session with as many threads as torch uses, not spinning between runs.  The export runs on a copy: it leaves the module
    it traces in another state."""
    import onnxruntime as ort

    torch.onnx.export(copy.deepcopy(module), inputs, str(path), input_names=names, output_names=["out"],
                      dynamic_axes={n: {0: "batch", 1: "tokens"} for n in names}, dynamo=False)
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    # ORT's threads spin after a run by default and take the cores from whatever runs next (here
    # HMI's side of an interleaved round: 250 -> 187 rows/s); a server sharing its cores turns it off.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


SERIES = {"hmi": "HMI hBERT", "hmi_hot": "HMI, whole PLOT in a hot tier", "peft": "PEFT",
          "peft_hmi_kernels": "PEFT on HMI's kernels", "hmi_bf16": "HMI, upper layers in bf16",
          "hmi_bf16_hot": "HMI bf16, PLOT in a hot tier", "peft_bf16": "PEFT in bf16"}


def plot_rows(result: dict, png: Path) -> None:
    """Rows/s against tenants, one panel per length, one line per side (``result["rows_per_s_<length>"]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LENGTHS), figsize=(9, 4), sharey=False, squeeze=False)
    axes = axes[0]  # one row of panels, however many lengths
    for ax, length in zip(axes, LENGTHS):
        cells = result[f"rows_per_s_{length}"]
        xs = sorted(int(k) for k in cells)
        for key, name in SERIES.items():
            if key not in cells[str(xs[0])]:
                continue
            ax.plot(xs, [cells[str(x)][key] for x in xs], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tenants (drawn uniformly)")
        ax.set_title(f"{length} tokens, batches of {B}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rows / s")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"HMI against PEFT's mixed-adapter batches; {machine()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    global COUNTS, LENGTHS, PEFT_CAP, DEVICE
    args = start(__doc__)
    if args.tiny:
        COUNTS, LENGTHS, PEFT_CAP = (1, 8), (64,), 8
    from hmi.scheduler.pipeline import pick_device

    DEVICE = pick_device("auto")  # where the scheduler serves from (SchedulerConfig.device), PEFT beside it
    from hmi.adapters.batched import Group, batched_heads, segment_plan, upper_forward
    from hmi.adapters.pool import SlotPool
    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore
    from hmi.data import load_task
    from hmi.model.kernels import NATIVE_BF16, bf16_matmuls
    from hmi.plot.hot import HotTier
    from hmi.plot.lookup import PlotLookup, PlotVersion
    from hmi.plot.paths import root_plot_path
    from hmi.scheduler.pipeline import Scheduler, SchedulerConfig
    from hmi.scheduler.types import FixedTenants, TenantEntry

    root, version = prepared_root()
    tok, bert, l_low, H = root.tokenizer, root.bert, root.spec.l_low, root.hidden_size
    spec = AdapterSpec("lora", rank=RANK, alpha=float(RANK), labels=LABELS)
    variants = adapter_variants(bert, l_low, spec, 32, seed=1)
    lookup = PlotLookup([version], policy="backoff")
    hot_lookup = PlotLookup([PlotVersion(version.name, version.store, version.encoder, hot=HotTier.whole(version.store))],
                            policy="backoff")
    warm_page_cache(root_plot_path(root))
    raw = [r["text"] for r in load_task("news-topic", "test")]
    measured, warm = (1, 1) if args.tiny else (3, 1) if args.quick else (10, 2)
    result, rows, loads, bf16_rows = {}, [], [], []
    tmp = Path(tempfile.mkdtemp(prefix="hmi-bench-peers-"))

    # -- loading K adapters ---------------------------------------------------------------------
    store = AdapterStore(tmp / "adapters")
    t0 = time.perf_counter()
    for i in range(max(COUNTS)):
        store.save(f"t{i:05d}", spec, variants[i % len(variants)])
        store.load(f"t{i:05d}")
    hmi_load = time.perf_counter() - t0
    entries = {f"t{i:05d}": TenantEntry(f"t{i:05d}", spec) for i in range(max(COUNTS))}
    peers = {}
    for kernels in (False, True):
        if kernels and DEVICE.type != "cpu":  # HMI's CPU kernels do not apply on a GPU: the column repeats PEFT's
            peers[kernels] = peers[False]
            continue
        peers[kernels], adds = peft_model(variants, PEFT_CAP, l_low, kernels)
        if not kernels:
            slope = np.polyfit(np.arange(len(adds)), adds, 1)[0]  # seconds more per adapter already present
            peft_1000 = sum(adds) + sum(adds[-1] + slope * k for k in range(1, max(COUNTS) - PEFT_CAP + 1))
            result.update({"peft_load_100_s": round(sum(adds), 2), "peft_load_1000_s_extrapolated": round(peft_1000, 1),
                           "peft_add_growth_ms_per_adapter": round(slope * 1e3, 3), "hmi_load_1000_s": round(hmi_load, 2)})
            if NATIVE_BF16:
                peers["bf16"] = copy.deepcopy(peers[False]).to(torch.bfloat16)
            loads = [("HMI (adapter store: write the file, load into host memory)", f"{hmi_load:.1f} (measured)"),
                     (f"PEFT add_adapter, {PEFT_CAP}", f"{sum(adds):.1f} (measured; each add {slope * 1e3:.2f} ms "
                      "slower than the one before)"),
                     ("PEFT add_adapter, 1,000", f"{peft_1000:.0f} (extrapolated)")]

    # -- rows/s against tenants -----------------------------------------------------------------
    rounds = 1 if args.quick else 5
    for length in LENGTHS:
        texts = cut_texts(tok, raw, length, exact=True) or cut_texts(tok, raw, length)
        for n in COUNTS:
            cell = {"hmi": [], "hmi_hot": [], "peft": [], "peft_hmi_kernels": []}
            sides = [("hmi", lookup, "fp32"), ("hmi_hot", hot_lookup, "fp32")]
            if NATIVE_BF16:
                cell.update(hmi_bf16=[], hmi_bf16_hot=[], peft_bf16=[])
                sides += [("hmi_bf16", lookup, "bf16"), ("hmi_bf16_hot", hot_lookup, "bf16")]
            for r in range(rounds):
                batches = trace(n, "uniform", warm + measured, seed=n + 7919 * r + length)
                for key, lk, precision in sides:
                    s = Scheduler(bert, l_low, tok, store, FixedTenants(entries), FixedTenants(entries, lk),
                                  SchedulerConfig(max_batch=B, pool_slots=64, upper_precision=precision))
                    try:
                        cell[key].append(scheduler_rps(s, texts, batches, warm))
                    finally:
                        s.shutdown()
                held = min(n, PEFT_CAP)
                peft_rps(peers[False], tok, texts, batches[:warm], held)
                cell["peft"].append(peft_rps(peers[False], tok, texts, batches[warm:], held))
                peft_rps(peers[True], tok, texts, batches[:warm], held)
                cell["peft_hmi_kernels"].append(peft_rps(peers[True], tok, texts, batches[warm:], held))
                if NATIVE_BF16:
                    peft_rps(peers["bf16"], tok, texts, batches[:warm], held)
                    cell["peft_bf16"].append(peft_rps(peers["bf16"], tok, texts, batches[warm:], held))
            med = {k: statistics.median(v) for k, v in cell.items()}
            result[f"rows_per_s_{length}"] = {**result.get(f"rows_per_s_{length}", {}),
                                              str(n): {k: round(v, 1) for k, v in med.items()}}
            if length == 64:
                result[f"hmi_over_peft_{n}"] = round(med["hmi"] / med["peft"], 2)
                result[f"hmi_over_peft_hmi_kernels_{n}"] = round(med["hmi"] / med["peft_hmi_kernels"], 2)
                result[f"hmi_hot_over_peft_{n}"] = round(med["hmi_hot"] / med["peft"], 2)
                if NATIVE_BF16:
                    result[f"hmi_bf16_over_peft_{n}"] = round(med["hmi_bf16"] / med["peft"], 2)
                    result[f"hmi_bf16_over_peft_bf16_{n}"] = round(med["hmi_bf16"] / med["peft_bf16"], 2)
                    result[f"hmi_bf16_hot_over_peft_{n}"] = round(med["hmi_bf16_hot"] / med["peft"], 2)
            rows.append((length, n, f"{med['hmi']:.1f}", f"{med['hmi_hot']:.1f}", f"{med['peft']:.1f}",
                         f"{med['peft_hmi_kernels']:.1f}", f"{med['hmi'] / med['peft']:.2f}",
                         f"{med['hmi_hot'] / med['peft']:.2f}", f"{med['hmi'] / med['peft_hmi_kernels']:.2f}"))
            print(rows[-1], flush=True)
            if NATIVE_BF16:
                bf16_rows.append((length, n, f"{med['hmi_bf16']:.1f}", f"{med['hmi_bf16_hot']:.1f}", f"{med['peft_bf16']:.1f}",
                                  f"{med['hmi_bf16'] / med['peft']:.2f}", f"{med['hmi_bf16_hot'] / med['peft']:.2f}",
                                  f"{med['hmi_bf16'] / med['peft_bf16']:.2f}"))
                print(bf16_rows[-1], flush=True)

    # -- ONNX Runtime: the full root, and the upper layers against HMI's ------------------------
    ort_rows = []
    plain = plain_root()
    w = variants[0]
    upper = merged_upper(plain, l_low, w, spec.scaling)
    full = Classifier(plain, len(LABELS)).eval()
    for length in LENGTHS:
        texts = cut_texts(tok, raw, length)[:B]
        enc = tok(texts, padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        hidden = lookup.merged(ids.numpy(), mask.numpy())
        full_sess = ort_session(full, (ids, mask), ["input_ids", "attention_mask"], tmp / f"full{length}.onnx")
        upper_sess = ort_session(upper, (hidden, mask.float()), ["hidden", "mask"], tmp / f"upper{length}.onnx")
        pool = SlotPool(spec.signature(H), 1, bert.config.num_hidden_layers - l_low, H, bert.config.intermediate_size,
                        max_labels=len(LABELS), scaling=spec.scaling)
        pool.write(0, w)
        group = Group(torch.arange(B), torch.zeros(B, dtype=torch.long), pool, all_rows=True, plan=segment_plan([0] * B))
        flags = torch.zeros(B, dtype=torch.bool)
        layers = nn.ModuleList(bert.encoder.layer[l_low:])

        def hmi_upper():
            with torch.no_grad():
                return batched_heads(upper_forward(layers, hidden, mask, [group]), [group], flags, mask, flags)[:, 0]

        def hmi_upper_bf16():
            with bf16_matmuls():
                return hmi_upper()

        def ort_upper():
            return upper_sess.run(None, {"hidden": hidden.numpy(), "mask": mask.float().numpy()})[0]

        got, want = hmi_upper()[:, :len(LABELS)].numpy(), ort_upper()
        t = round_robin({"hmi_upper": hmi_upper, "ort_upper": ort_upper, "hmi_upper_bf16": hmi_upper_bf16,
                         "ort_full": lambda: full_sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})},
                        5 if args.quick else 20, warmup=2)
        result[f"hmi_upper_over_ort_upper_{length}"] = round(t["ort_upper"] / t["hmi_upper"], 2)
        result[f"ort_full_rows_per_s_{length}"] = round(B / t["ort_full"], 1)
        result[f"upper_max_abs_diff_{length}"] = float(np.abs(got - want).max())
        if NATIVE_BF16:
            result[f"hmi_upper_bf16_over_ort_upper_{length}"] = round(t["ort_upper"] / t["hmi_upper_bf16"], 2)
        ort_rows.append((length, f"{B / t['hmi_upper']:.0f}", f"{B / t['ort_upper']:.0f}",
                         f"{t['ort_upper'] / t['hmi_upper']:.2f}", f"{np.abs(got - want).max():.1e}", f"{B / t['ort_full']:.0f}",
                         f"{B / t['hmi_upper_bf16']:.0f}" if NATIVE_BF16 else "-"))
    result["hmi_upper_over_ort_upper"] = result["hmi_upper_over_ort_upper_64"]

    plot_rows(result, DOCS / "peers_rows.png")
    text = "\n\n".join([
        "Plot: `docs/results/peers_rows.png`. HMI's scheduler and PEFT run on the "
        + ("GPU; HMI's CPU kernels do not apply there: the column 'PEFT on HMI's kernels' repeats PEFT; the ONNX "
           "Runtime comparison below runs on the CPU." if DEVICE.type != "cpu" else "CPU."),
        f"Rows per second (median of {rounds} rounds that run every side in turn on the same trace), batches of {B} "
        f"news texts, tenants drawn uniformly; LoRA rank {RANK} on q and v of the "
        f"upper layers plus a head per tenant on both sides (the same weights). PEFT holds at most {PEFT_CAP} adapters "
        f"(at 1,000 tenants a row is served by tenant mod {PEFT_CAP}).\n\n"
        + table(rows, ("tokens", "tenants", "HMI hBERT", "HMI, whole PLOT in a hot tier", "PEFT", "PEFT on HMI's kernels",
                       "HMI / PEFT", "HMI hot tier / PEFT", "HMI / PEFT on HMI's kernels")),
        ("The same with bf16 products (this CPU multiplies bf16 natively): HMI's shared upper layers in bf16 "
         "(`hmi serve --upper-precision bf16`; the PLOT, adapters and heads fp32; scores within about 5e-3 of fp32, "
         "`docs/results/bench_precision.md`), PEFT cast to bf16 whole:\n\n"
         + table(bf16_rows, ("tokens", "tenants", "HMI, upper layers bf16", "HMI bf16, whole PLOT in a hot tier",
                             "PEFT in bf16", "HMI bf16 / PEFT", "HMI bf16 hot tier / PEFT", "HMI bf16 / PEFT in bf16"))
         if bf16_rows else "No native bf16 on this CPU: the bf16 columns were not measured."),
        "Time to load the adapters, seconds:\n\n" + table(loads, ("", "seconds")),
        f"ONNX Runtime ({B} rows; the upper layers with one adapter merged, on the hidden states the PLOT gives; the "
        "full root for one model with no adapter):\n\n"
        + table(ort_rows, ("tokens", "HMI upper layers rows/s", "ORT upper layers rows/s", "HMI / ORT",
                           "max |diff| of the logits", "ORT full root rows/s", "HMI upper layers in bf16 rows/s")),
    ])
    finish("bench_peers", text, result, "python benchmarks/bench_peers.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
