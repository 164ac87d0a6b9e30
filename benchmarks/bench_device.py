"""The compute paths that run on a GPU, on the CPU and on the GPU side by side in one run, on
layers of MiniLM-L6's shapes with random weights (speed does not depend on the values, and no
packaged model or data is needed: ``make gpu-check`` runs this on a bare GPU machine).

Usage: python benchmarks/bench_device.py [--quick]

- **Upper layers, many tenants** (the serving path's stage C): the 3 shared upper layers of a
  3+3 split with each row's own LoRA (rank 8 on query and value) and head, batched across
  tenants (``hmi.adapters.batched.upper_forward`` over slot pools, weights resident), 32 texts
  of 64 tokens, at 1 and 100 tenants: rows per second.
- **PLOT hot tier**: a batch's distinct windows (4,096 keys, 90% held) looked up in a tier of
  500,000 entries of the root's value shape (``hmi.plot.hot.HotTier``: ``searchsorted`` and a
  gather; 1.1 GB), values left on the tier's device: microseconds per key.
- **Base executor** (private tenants): 32 clients at once, each calling the 12 frozen
  projections of the upper layers on its own 64 rows, through ``BaseExecutor`` with cross-client
  batching and with every call alone (calls arrive and leave as CPU tensors, as over HTTP):
  calls per second and the ratio of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

import torch
from common import adapter_variants, finish, machine, table

HIDDEN, HEADS, INTERMEDIATE, LAYERS, L_LOW = 384, 12, 1536, 6, 3  # MiniLM-L6, split 3+3
BATCH, TOKENS, CLIENTS = 32, 64, 32


def minilm_shaped_root():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1000, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     intermediate_size=INTERMEDIATE, attn_implementation="eager")
    return BertModel(cfg, add_pooling_layer=False).eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def upper_rows_per_s(bert, device: torch.device, tenants: int, repeat: int) -> float:
    """Rows per second of the batched multi-tenant upper layers (resident adapters, one pool)."""
    from hmi.adapters.batched import Group, batched_heads, segment_plan, upper_forward
    from hmi.adapters.pool import SlotPool
    from hmi.adapters.spec import AdapterSpec

    spec = AdapterSpec("lora", rank=8, labels=("a", "b", "c", "d"))
    pool = SlotPool(spec.signature(HIDDEN), tenants, LAYERS - L_LOW, HIDDEN, INTERMEDIATE, max_labels=4,
                    scaling=spec.scaling, device=device)
    variants = adapter_variants(bert, L_LOW, spec, min(tenants, 4))  # a few distinct adapters, reused across tenants
    for slot in range(tenants):
        pool.write(slot, variants[slot % len(variants)])
    slots = [row % tenants for row in range(BATCH)]
    group = Group(torch.arange(BATCH, device=device), torch.tensor(slots, device=device), pool, all_rows=True,
                  plan=segment_plan(slots))
    layers = torch.nn.ModuleList(bert.encoder.layer[L_LOW:])
    if device.type != "cpu":
        layers = copy.deepcopy(layers).to(device)
    hidden = torch.randn(BATCH, TOKENS, HIDDEN, device=device)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long, device=device)
    flags = torch.zeros(BATCH, dtype=torch.bool, device=device)

    def once():
        with torch.no_grad():
            batched_heads(upper_forward(layers, hidden, mask, [group]), [group], flags, mask, flags)
        sync(device)

    once()
    start = time.perf_counter()
    for _ in range(repeat):
        once()
    return BATCH * repeat / (time.perf_counter() - start)


def hot_tier_us_per_key(device: torch.device, repeat: int, entries: int = 500_000, queries: int = 4096) -> float:
    """Microseconds per key of a hot-tier lookup and gather (values stay on the device)."""
    import numpy as np

    from hmi.plot.hot import HotTier

    rng = np.random.default_rng(0)
    keys = rng.choice(np.uint64(1) << np.uint64(62), size=entries, replace=False).astype(np.uint64)
    tier = HotTier(keys, np.ones((entries, 3, HIDDEN), dtype=np.float16), device)
    held = rng.choice(keys, size=int(queries * 0.9))
    q = np.concatenate([held, rng.integers(1, 1 << 62, size=queries - len(held), dtype=np.int64).astype(np.uint64)])
    q = torch.from_numpy(q.view(np.int64)).to(device)

    def once():
        pos, found = tier.lookup(q)
        tier.values[pos[found]]
        sync(device)

    once()
    start = time.perf_counter()
    for _ in range(repeat):
        once()
    return (time.perf_counter() - start) / repeat / queries * 1e6


def executor_calls_per_s(bert, device: torch.device, batching: bool, rounds: int) -> tuple[float, float]:
    """Calls per second of ``CLIENTS`` clients calling every upper-layer projection at once, and
    the mean rows per GEMM."""
    from hmi.split.base_executor import BaseExecutor, FrozenLinears

    linears = FrozenLinears(bert, L_LOW, device)
    executor = BaseExecutor(linears, batching=batching)
    steps = [(layer, p) for layer in range(L_LOW, LAYERS) for p in ("qkv", "attn_out", "ffn_in", "ffn_out")]
    inputs = {key: torch.randn(TOKENS, linears.width(*key, "forward")) for key in steps}

    async def client():
        for key in steps:
            await executor.call(*key, "forward", inputs[key])

    async def clients():
        await asyncio.gather(*(client() for _ in range(CLIENTS)))

    try:
        asyncio.run(clients())  # warm-up
        before = dict(executor.stats)
        start = time.perf_counter()
        for _ in range(rounds):
            asyncio.run(clients())
        seconds = time.perf_counter() - start
        gemms = executor.stats["batches"] - before["batches"]
        rows = executor.stats["rows"] - before["rows"]
    finally:
        executor.shutdown()
    return CLIENTS * len(steps) * rounds / seconds, rows / max(gemms, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    from hmi.bootstrap import quiet_transformers

    quiet_transformers()
    bert = minilm_shaped_root()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    repeat, rounds = (3, 2) if args.quick else (10, 5)
    result, upper_rows, exec_rows, hot_rows = {}, [], [], []
    for device in devices:
        d = device.type
        for tenants in (1, 100):
            rps = upper_rows_per_s(bert, device, tenants, repeat if d == "cpu" else 20 * repeat)
            result[f"upper_rows_per_s_{d}_{tenants}"] = round(rps, 1)
            upper_rows.append((d, tenants, f"{rps:,.0f}"))
        us = hot_tier_us_per_key(device, 5 * repeat)
        result[f"hot_tier_us_per_key_{d}"] = round(us, 3)
        hot_rows.append((d, f"{us:.3f}"))
        (batched, per_gemm), (alone, _) = (executor_calls_per_s(bert, device, b, rounds) for b in (True, False))
        result[f"executor_batched_over_unbatched_{d}_{CLIENTS}"] = round(batched / alone, 2)
        exec_rows.append((d, f"{batched:,.0f}", f"{alone:,.0f}", f"{batched / alone:.2f}", f"{per_gemm:.0f}"))
    if torch.cuda.is_available():
        for tenants in (1, 100):
            result[f"upper_cuda_over_cpu_{tenants}"] = round(
                result[f"upper_rows_per_s_cuda_{tenants}"] / result[f"upper_rows_per_s_cpu_{tenants}"], 1)
    text = "\n\n".join([
        f"Layers of MiniLM-L6's shapes (hidden {HIDDEN}, intermediate {INTERMEDIATE}, split {L_LOW}+{LAYERS - L_LOW}), "
        "random weights. " + ("" if torch.cuda.is_available() else "No GPU here: the CPU rows only."),
        f"Upper layers, {BATCH} texts x {TOKENS} tokens, LoRA rank 8 on q and v plus a head per tenant "
        "(adapters resident):\n\n" + table(upper_rows, ("device", "tenants", "rows/s")),
        "PLOT hot tier, 4,096 distinct windows (90% held) in 500,000 entries:\n\n" + table(hot_rows, ("device", "us / key")),
        f"Base executor, {CLIENTS} clients at once, each calling the {4 * (LAYERS - L_LOW)} upper-layer projections "
        f"on {TOKENS} rows (CPU tensors in and out):\n\n"
        + table(exec_rows, ("device", "calls/s batched", "calls/s alone", "batched/alone", "rows per GEMM")),
    ])
    finish("bench_device", text, result, "python benchmarks/bench_device.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    print(machine())
    main()
