"""Response times through the real HTTP server (the paper's Fig. 12 and 13): tenants sending at a
constant total rate, and a burst of concurrent clients; p50/p95/p99 and a CDF plot.

The server runs in this process on the current root and root PLOT with 1,000 registered tenants
(in a temporary home); the load comes from a separate client process on localhost, bounded in
request count and time.

Usage: python benchmarks/bench_latency.py [--quick]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import DOCS, adapter_variants, finish, prepared_root, start, table  # noqa: E402
from hmi.client import RETRY_DELAYS_S  # noqa: E402

TENANTS = 1000


# -- the load generator (runs as its own process) -------------------------------------------------
async def _client(url: str, token: str, tenants: list[str], texts: list[str], mode: str, rate: float,
                  clients: int, seconds: float, max_requests: int, seed: int, zipf: bool = False,
                  sequential: bool = False, inputs: int = 1, reference: dict | None = None, retries: int = 0) -> dict:
    """Tenants are drawn uniformly, Zipf-skewed (``zipf``: p(rank k) ~ 1/k) or each once in order
    (``sequential``).  Also counts the answers' ``X-HMI-Affinity`` and ``X-HMI-Replica`` headers
    (hmi.scaleout).  A request carries ``inputs`` texts.  With ``reference`` (``{"inputs": texts,
    "outputs": {tenant: outputs}}``) every request sends those texts for one of those tenants, each
    answer is checked against them (``wrong`` counts those that differ) and ``timeline`` lists
    ``[wall-clock time, status (0: no answer), wrong, replica]`` per request.  With ``retries``, a
    request that got no answer or a gateway error is sent again (up to that many times, after
    hmi.client's delays); ``retried`` counts those resends."""
    import aiohttp

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(tenants) + 1)
    p = p / p.sum() if zipf else None
    lat, errors, codes, affinity, replicas, refused, refused_by = [], 0, {}, {}, {}, [], {}
    drawn, wrong, timeline, retried = 0, 0, [], 0
    if reference is not None:
        tenants = sorted(reference["outputs"])
        p = None
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=120)

    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            nonlocal errors, drawn, wrong, retried
            if sequential:
                tenant = tenants[drawn % len(tenants)]
            else:
                tenant = tenants[int(rng.choice(len(tenants), p=p) if zipf else rng.integers(len(tenants)))]
            drawn += 1
            body = {"inputs": [texts[int(rng.integers(len(texts)))] for _ in range(inputs)]}
            if reference is not None:
                body = {"inputs": reference["inputs"]}
            t, status, bad, replica = time.perf_counter(), 0, False, None
            for attempt in range(retries + 1):  # as hmi.client resends an inference that got no answer
                try:
                    # The routing header, as hmi.client sends it: Ray Serve routes by it, a single server ignores it.
                    async with session.post(f"{url}/v1/tenants/{tenant}/infer", json=body,
                                            headers={"serve_multiplexed_model_id": tenant}) as r:
                        raw = await r.read()
                        status, replica = r.status, r.headers.get("X-HMI-Replica")
                except (aiohttp.ClientError, asyncio.TimeoutError):  # the connection closed, or no answer in time
                    status = 0
                if attempt < retries and (status in (0, 502, 503, 504) or (status >= 500 and not hmi_error(raw))):
                    retried += 1
                    await asyncio.sleep(RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)])
                    continue
                break
            if status == 0:
                errors += 1
                codes["no answer"] = codes.get("no answer", 0) + 1
            else:
                codes[status] = codes.get(status, 0) + 1
                for counts, header in ((affinity, "X-HMI-Affinity"), (replicas, "X-HMI-Replica"),
                                       (refused_by, "X-HMI-Refused-By")):
                    if header in r.headers:
                        counts[r.headers[header]] = counts.get(r.headers[header], 0) + 1
                if status == 200:
                    lat.append(time.perf_counter() - t)
                    if reference is not None:
                        bad = not same(json.loads(raw)["outputs"], reference["outputs"][tenant])
                        wrong += bad
                else:
                    errors += 1
                    if status == 429:
                        refused.append(time.perf_counter() - t)
            if reference is not None:
                timeline.append([time.time(), status, bad, replica])

        t0 = time.perf_counter()
        if mode == "rate":  # open loop: a request every 1/rate seconds, whatever the answers
            tasks, k = [], 0
            while time.perf_counter() - t0 < seconds and k < max_requests:
                tasks.append(asyncio.ensure_future(one()))
                k += 1
                await asyncio.sleep(max(0.0, t0 + k / rate - time.perf_counter()))
            await asyncio.gather(*tasks)
        else:  # closed loop: ``clients`` concurrent clients, each sending as soon as its answer came
            sent = 0

            async def worker() -> None:
                nonlocal sent
                while time.perf_counter() - t0 < seconds and sent < max_requests:
                    sent += 1
                    await one()

            await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"latencies_s": lat, "errors": errors, "codes": codes, "wall_s": wall, "affinity": affinity,
            "replicas": replicas, "wrong": wrong, "timeline": timeline, "refused_s": refused, "retried": retried,
            "refused_by": refused_by}


def hmi_error(raw: bytes) -> bool:
    """Whether an error answer is HMI's own (JSON with an error code), not a proxy's on the way
    (which hmi.client resends: ``hmi.client.lost_on_the_way``)."""
    try:
        return "code" in json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False


def same(got, want, tol: float = 1e-3) -> bool:
    """Whether two answers agree: equal structure and strings, numbers within ``tol`` (batches of
    other compositions may change the last digits)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k], tol) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(same(g, w, tol) for g, w in zip(got, want))
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and abs(got - want) <= tol
    return got == want


def client_main() -> None:
    spec = json.loads(sys.stdin.read())
    out = asyncio.run(_client(**spec))
    print(json.dumps(out))


def run_load(spec: dict, cpus: set[int] | None = None) -> dict:
    """One load generator's results, run in its own process (on ``cpus`` when given)."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.run([sys.executable, __file__, "--client"], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=spec["seconds"] + 300, preexec_fn=pin)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- server side ------------------------------------------------------------------------------------
def temp_home(tmp: Path, real: Path, n: int):
    """A home sharing the real root artifact and root PLOT (and the decoder's fp32 copy where the
    real home holds one), with ``n`` ready tenants."""

    from hmi.adapters.spec import AdapterSpec
    from hmi.adapters.store import AdapterStore
    from hmi.model.artifact import load_root
    from hmi.services.auth import hash_token, new_token
    from hmi.services.registry import Registry

    for part in ("roots", "plots", "models"):
        if part != "models" or (real / part).exists():
            (tmp / part).symlink_to(real / part)
    root = load_root(home=tmp)
    spec = AdapterSpec("bottleneck", labels=tuple("abcde"))
    variants = adapter_variants(root.bert, root.spec.l_low, spec, 16, seed=0)
    store = AdapterStore(tmp / "tenants")
    reg = Registry(tmp / "registry")
    names = [f"bench-{i:04d}" for i in range(n)]
    for i, name in enumerate(names):
        store.save(name, spec, variants[i % len(variants)])
        reg.put("tenants", name, {"state": "ready", "domain": "root", "spec": spec.to_dict(),
                                  "token_hash": hash_token(new_token("hmi_t")), "version": 0})
    reg.close()
    return root, names


def bench_home(prefix: str, n: int):
    """(temporary home, admin token, root, tenant names): a home sharing the prepared root
    artifact and root PLOT with ``n`` ready tenants; servers built in this process take the token."""
    from hmi.home import hmi_home

    real = hmi_home()
    prepared_root(real)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["HMI_ADMIN_TOKEN"] = token = "bench-admin-token-" + os.urandom(8).hex()
    try:
        root, names = temp_home(tmp, real, n)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, token, root, names


def cdf_png(runs: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, lat in runs.items():
        x = np.sort(np.asarray(lat) * 1e3)
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
    ax.set_xlabel("response time (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("HMI over HTTP, 1,000 tenants, one 128-token input per request", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    args = start(__doc__, lambda ap: ap.add_argument("--client", action="store_true", help=argparse_suppress()))
    from hmi.data import load_task
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.services.server import ServerConfig
    seconds = 10 if args.quick else 40
    tmp, token, root, names = bench_home("hmi-bench-latency-", TENANTS)
    try:
        tok = root.tokenizer
        texts = [r["text"] for r in load_task("news-topic", "test")]
        texts = [tok.decode(tok(t, truncation=True, max_length=128)["input_ids"][1:-1]) for t in texts]
        texts = [t for t in texts if len(tok(t)["input_ids"]) <= 128]
        server = build_server(ServerConfig(max_batch=32, max_wait_ms=5.0, host_cache_mb=1024), home=tmp, root=root)
        url, stop = run_in_thread(server)
        base = {"url": url, "token": token, "tenants": names, "texts": texts, "rate": 1.0, "clients": 1,
                "seconds": seconds, "max_requests": 20_000, "seed": 0}
        run_load({**base, "mode": "closed", "clients": 8, "seconds": 3})  # warm-up
        scenarios = [("constant rate 10 req/s", {"mode": "rate", "rate": 10.0}),
                     ("constant rate 25 req/s", {"mode": "rate", "rate": 25.0}),
                     ("constant rate 40 req/s", {"mode": "rate", "rate": 40.0}),
                     ("burst: 64 concurrent clients", {"mode": "closed", "clients": 64})]
        rows, res, cdfs = [], {}, {}
        for label, sc in scenarios:
            r = run_load({**base, **sc})
            lat = np.asarray(r["latencies_s"])
            p50, p95, p99 = (float(np.percentile(lat, q) * 1e3) for q in (50, 95, 99))
            achieved = len(lat) / r["wall_s"]
            res[label] = {"p50_ms": round(p50, 1), "p95_ms": round(p95, 1), "p99_ms": round(p99, 1),
                          "answered": len(lat), "errors": r["errors"], "codes": r["codes"], "rps": round(achieved, 2)}
            cdfs[label] = lat.tolist()
            rows.append((label, len(lat), r["errors"], f"{achieved:.1f}", f"{p50:.0f}", f"{p95:.0f}", f"{p99:.0f}"))
            print(rows[-1], flush=True)
        stop()
        server.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cdf_png(cdfs, DOCS / "latency_cdf.png")
    text = table(rows, ("load", "answered", "errors", "answered / s", "p50 ms", "p95 ms", "p99 ms"))
    text += (f"\n\nThe real server (aiohttp, batcher with max 32 requests / 5 ms, pipelined scheduler, root PLOT "
             f"with back-off) in this process with {TENANTS:,} registered tenants drawn uniformly; the load from a "
             f"separate client process on localhost (the same 2 cores), {seconds} s per scenario, one real 128-token "
             "BBC text per request. Constant rate: open loop, requests sent on schedule whatever the answers. Burst: "
             "64 clients each sending its next request as soon as its answer arrives. CDF: `docs/results/latency_cdf.png`.")
    finish("bench_latency", text, {"scenarios": res, "tenants": TENANTS, "seconds": seconds},
           "python benchmarks/bench_latency.py" + (" --quick" if args.quick else ""))


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    if "--client" in sys.argv:
        client_main()
    else:
        main()
