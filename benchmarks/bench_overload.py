"""Noisy neighbours and overload through the real HTTP server: does one tenant's flood raise the
others' latency, and what happens to admitted requests at twice the capacity?

Usage: python benchmarks/bench_overload.py [--quick] [--ray]

The server runs in this process on the current root and root PLOT with ten ready tenants (A, then
B..J), default configuration (fair shares: 2 batches in flight, 256 requests per tenant queue), or
with ``--ray`` as two Ray Serve replicas behind the HAProxy ingress (``hmi.scaleout.ray_serve``,
tenant affinity: each replica runs the whole server with its own fair queue; results in
docs/bench_overload_ray.md);
load comes from separate client processes on localhost (the same 2 cores), open loop (requests
sent on schedule whatever the answers), one real short text (a tweet) per request:

1. **capacity**: 64 closed-loop clients over all ten tenants: answered requests per second, C.
2. **baseline**: B..J together at 0.7 C (their fair shares), A silent.
3. **noisy neighbour**: the same, and A at 10 C (and again at 3 C). ``neighbour_p99_ratio`` =
   B..J's p99 here over their p99 in the baseline; A's share of 429s; whether anyone but A was
   refused.
   Then the same through the gate (``hmi serve --gate``, ``hmi.dispatcher.gate``): HAProxy in
   front of the server holds a tenant the server refused over its share to its fair rate (its
   weighted share of the answered requests per second) and refuses the rest itself, so most of the
   flood never reaches Python and what is admitted comes evenly (``neighbour_p99_ratio_gated``:
   B..J's p99 beside A over their p99 without A, both through the gate; skipped where no
   ``haproxy`` binary is installed: the ray extra ships one).
   Every row states the CPU its load generators used (cores, from their rusage).
4. **at capacity** and **overload**: all ten at 1.0 C, then at 2.0 C:
   ``overload_p99_over_capacity_p99`` = p99 of the answered requests at 2 C over that at 1 C, the
   share shed (429), and how fast a refusal comes back.
"""

from __future__ import annotations

import resource
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_latency import bench_home, run_load  # noqa: E402
from benchmarks.common import finish, free_port, start, table  # noqa: E402
from hmi.dispatcher.gate import HOLD_S, Gate, haproxy_binary  # noqa: E402

TENANTS = 10
REPLICAS = 2
RAY_NOTE = ("Through Ray Serve each replica runs the whole server (its own fair queue and admission, which every "
            "request the replica takes reaches); HAProxy routes a tenant's requests to one replica by the routing "
            "header's hash. Every request passes HAProxy, Ray Serve's replica front and the replica's forward to its "
            "server, on the same two cores as the load generator: a flood faster than those Python fronts can "
            "refuse waits in front of them, first come, first served, and everyone's latency grows with it.")
NOTE = ("What these figures say on 2 cores: admission holds the overload's answered p99 near the p99 at "
        "capacity by refusing at once what would wait past about 0.25 s; the fair queue puts a quiet tenant's "
        "request before a noisy tenant's backlog (tests/dispatcher/test_batcher.py). In one process every "
        "refusal of a flood is parsed, authenticated and answered by the server's Python event loop, which "
        "shares the interpreter lock and the two cores with the scheduler's threads: beside a flood at 10 C "
        "the others' latency rose tens of times and some of their requests were refused too (their queues "
        "grew past their share while the scheduler was starved). Through the gate (`hmi serve --gate`) "
        "HAProxy answers almost all of the flood itself, the flooding tenant is served evenly at its fair rate "
        "(about a tenth of the answered requests here), and nobody else is refused; the others' p99 still rises "
        "several times. What is left is the cores: with the flooding tenant admitted at its share the server "
        "answers about 0.76 C, near what it can answer while the load generators take half a core (last "
        "column) and HAProxy refuses about 1,500 requests a second, and the others' requests queue behind "
        "batches that are not preempted. With every request of the flooding tenant refused by HAProxy "
        "(a static rule, measured separately in 10 s runs) the ratio was 1.4 to 3.0: the bound of what "
        "admission can do on these two shared cores. Holding a flooding tenant's requests out of full "
        "batches (tried: they only filled the batches the others closed) made its admitted requests wait "
        "about 11 s and gave an overload shared by everyone a 10 s p99 tail, so it was not kept; so was "
        "refusing the gate's tenant for a whole second at a time (the ratio was 7.2: each time the hold "
        "ended, its queued burst filled whole batches).")


def pct(lat: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(lat), q)) * 1e3, 1) if len(lat) else float("nan")


def together(specs: list[dict]) -> list[dict]:
    """Runs load generators at the same time (each its own process); their results in order."""
    out = [None] * len(specs)

    def go(i):
        out[i] = run_load(specs[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def summary(r: dict) -> dict:
    lat = r["latencies_s"]
    return {"answered": len(lat), "codes": r["codes"], "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
            "refused_p99_ms": pct(r["refused_s"], 99), "answered_per_s": round(len(lat) / r["wall_s"], 1),
            "refused_by_gate": r["refused_by"].get("gate", 0)}


def loads(specs: list[dict], server=None) -> tuple[list[dict], float]:
    """The summaries of load generators run together, and the CPU they used in cores (user +
    system seconds of the finished child processes over the wall time); first the server (when in
    this process) works off what an earlier scenario left queued."""
    settle(server)
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = together(specs)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return [summary(r) for r in out], round(cpu / wall, 2)


def settle(server, timeout_s: float = 120.0) -> None:
    """Waits until ``server``'s batcher is idle (a flood's backlog answered), then a second more."""
    deadline = time.monotonic() + timeout_s
    while server is not None and not server.batcher.idle and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)


def serving(ray: bool, tmp: Path, token: str, root):
    """(url, the server's config, stop(), the server or None): the server in this process, or two
    Ray Serve replicas on the same home behind the HAProxy ingress."""
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.dispatcher.server import ServerConfig

    cfg = ServerConfig()
    if not ray:
        server = build_server(cfg, home=tmp, root=root)
        url, stop = run_in_thread(server)

        def close() -> None:
            stop()
            server.shutdown()
        return url, cfg, close, server
    from hmi.scaleout.ray_serve import ReplicaServer, stop
    from hmi.scaleout.ray_serve import start as start_ray

    url = start_ray(ReplicaServer(cfg, str(tmp)), port=free_port(), replicas=REPLICAS,
                    env={"HMI_HOME": str(tmp), "HMI_ADMIN_TOKEN": token})
    return url, cfg, stop, None


def main() -> None:
    def options(ap):
        ap.add_argument("--ray", action="store_true", help=f"through Ray Serve: {REPLICAS} replicas, HAProxy ingress")

    args = start(__doc__, options)
    from hmi.data import load_task
    seconds = 10 if args.quick else 30
    tmp, token, root, names = bench_home("hmi-bench-overload-", TENANTS)
    try:
        noisy, others = names[0], names[1:]
        texts = [r["text"] for r in load_task("tweet-sentiment", "test")]
        url, cfg, close, server = serving(args.ray, tmp, token, root)
        base = {"url": url, "token": token, "texts": texts, "clients": 1, "seconds": seconds, "max_requests": 200_000,
                "seed": 0, "mode": "rate", "rate": 1.0}
        run_load({**base, "tenants": names, "mode": "closed", "clients": 16, "seconds": 3})  # warm-up
        (cap,), cpu_cap = loads([{**base, "tenants": names, "mode": "closed", "clients": 64}], server)
        c = cap["answered_per_s"]
        print("capacity", cap, flush=True)
        (baseline,), cpu_base = loads([{**base, "tenants": others, "rate": 0.7 * c}], server)
        print("baseline", baseline, flush=True)

        def beside(rate: float, at: str = url) -> tuple[list[dict], float]:
            return loads([{**base, "url": at, "tenants": others, "rate": 0.7 * c},
                          {**base, "url": at, "tenants": [noisy], "rate": rate * c, "seed": 1}], server)

        (quiet, loud), cpu_noisy = beside(10)
        print("noisy", quiet, loud, flush=True)
        (quiet3, loud3), cpu_noisy3 = beside(3)
        print("noisy at 3 C", quiet3, loud3, flush=True)
        gated = None
        if server is not None and haproxy_binary():
            server.gate = gate = Gate.start("127.0.0.1", free_port(), url.rsplit("//", 1)[1])
            try:
                (baseline_g,), cpu_base_g = loads([{**base, "url": gate.url, "tenants": others, "rate": 0.7 * c}], server)
                (quiet_g, loud_g), cpu_g = beside(10, gate.url)
                (quiet3_g, loud3_g), cpu3_g = beside(3, gate.url)
            finally:
                server.gate = None
                gate.close()
            gated = {"baseline": baseline_g, "others": quiet_g, "noisy": loud_g, "others_at_3c": quiet3_g,
                     "noisy_at_3c": loud3_g, "cpu": {"baseline": cpu_base_g, "noisy": cpu_g, "noisy_at_3c": cpu3_g}}
            print("through the gate", gated, flush=True)
        (at_cap,), cpu_at = loads([{**base, "tenants": names, "rate": 1.0 * c}], server)
        (over,), cpu_over = loads([{**base, "tenants": names, "rate": 2.0 * c}], server)
        print("capacity / overload", at_cap, over, flush=True)
        close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    res = {"capacity_per_s": c, "capacity": cap, "baseline": baseline, "noisy_others": quiet, "noisy_tenant": loud,
           "at_capacity": at_cap, "overload": over,
           "noisy3_others": quiet3, "noisy3_tenant": loud3, "gated": gated,
           "generators_cpu_cores": {"capacity": cpu_cap, "baseline": cpu_base, "noisy": cpu_noisy,
                                    "noisy_at_3c": cpu_noisy3, "at_capacity": cpu_at, "overload": cpu_over},
           "neighbour_p99_ratio": round(quiet["p99_ms"] / baseline["p99_ms"], 2),
           "neighbour_p99_ratio_at_3c": round(quiet3["p99_ms"] / baseline["p99_ms"], 2),
           "neighbour_p99_ratio_gated": (round(gated["others"]["p99_ms"] / gated["baseline"]["p99_ms"], 2)
                                         if gated else None),
           "neighbour_p99_ratio_gated_at_3c": (round(gated["others_at_3c"]["p99_ms"] / gated["baseline"]["p99_ms"], 2)
                                               if gated else None),
           "noisy_refused_by_gate_share": (round(gated["noisy"]["refused_by_gate"] / max(1, sent(gated["noisy"])), 3)
                                           if gated else None),
           "noisy_429_share": round(loud["codes"].get("429", 0) / max(1, sent(loud)), 3),
           "others_refused": sent(quiet) - quiet["answered"],
           "overload_p99_over_capacity_p99": round(over["p99_ms"] / at_cap["p99_ms"], 2),
           "overload_shed_share": round(over["codes"].get("429", 0) / max(1, sent(over)), 3),
           "config": {"batches_in_flight": cfg.batches_in_flight, "tenant_queue": cfg.tenant_queue,
                      "max_batch": cfg.max_batch, "max_wait_ms": cfg.max_wait_ms}, "seconds": seconds,
           "serving": f"Ray Serve, {REPLICAS} replicas, HAProxy ingress" if args.ray else "one process"}
    finish("bench_overload_ray" if args.ray else "bench_overload", report(res, args.ray), res,
           "python benchmarks/bench_overload.py" + (" --quick" if args.quick else "") + (" --ray" if args.ray else ""))


def sent(s: dict) -> int:
    return sum(v for v in s["codes"].values())


def report(res: dict, ray: bool) -> str:
    """The results page's table and text, from the result alone."""
    c, gated, cpu = res["capacity_per_s"], res["gated"], res["generators_cpu_cores"]

    def row(label: str, r: dict, cores: float | str) -> tuple:
        return (label, sent(r), r["answered"], r["codes"].get("429", 0), r["p50_ms"], r["p99_ms"], cores)

    rows = [row("capacity: 64 closed-loop clients, all tenants", res["capacity"], cpu["capacity"]),
            row(f"baseline: B..J at 0.7 C ({0.7 * c:.0f}/s)", res["baseline"], cpu["baseline"]),
            row("noisy: B..J at 0.7 C, beside A", res["noisy_others"], cpu["noisy"]),
            row(f"noisy: A at 10 C ({10 * c:.0f}/s)", res["noisy_tenant"], "(with the row above)"),
            row("noisy: B..J at 0.7 C, beside A at 3 C", res["noisy3_others"], cpu["noisy_at_3c"]),
            row(f"noisy: A at 3 C ({3 * c:.0f}/s)", res["noisy3_tenant"], "(with the row above)")]
    if gated:
        rows += [row("gate: baseline, B..J at 0.7 C", gated["baseline"], gated["cpu"]["baseline"]),
                 row("gate: B..J at 0.7 C, beside A", gated["others"], gated["cpu"]["noisy"]),
                 row("gate: A at 10 C", gated["noisy"], "(with the row above)"),
                 row("gate: B..J at 0.7 C, beside A at 3 C", gated["others_at_3c"], gated["cpu"]["noisy_at_3c"]),
                 row("gate: A at 3 C", gated["noisy_at_3c"], "(with the row above)")]
    rows += [row(f"all tenants at 1.0 C ({c:.0f}/s)", res["at_capacity"], cpu["at_capacity"]),
             row(f"all tenants at 2.0 C ({2 * c:.0f}/s)", res["overload"], cpu["overload"])]
    text = table(rows, ("load", "sent", "answered", "429", "p50 ms (answered)", "p99 ms (answered)",
                        "load generators' CPU (cores)"))
    return (text + f"\n\nCapacity C = {c} answered requests/s. `neighbour_p99_ratio` (B..J's p99 beside the noisy "
            f"tenant over without it): **{res['neighbour_p99_ratio']}** (target <= 1.5; with A at 3 C: "
            f"{res['neighbour_p99_ratio_at_3c']}); the noisy tenant's requests refused "
            f"(429 over_share): {res['noisy_429_share']:.1%}; requests of B..J refused: {res['others_refused']}. "
            f"`overload_p99_over_capacity_p99`: **{res['overload_p99_over_capacity_p99']}** (target <= 2), "
            f"{res['overload_shed_share']:.1%} shed with 429, a refusal's p99 {res['overload']['refused_p99_ms']} ms. "
            + (f"Through the gate (`hmi serve --gate`: HAProxy holds a tenant the server refused over its share "
               f"to its fair rate, its share of the answered requests per second, until it has sent within that "
               f"rate for {HOLD_S:g} s): `neighbour_p99_ratio_gated` **{res['neighbour_p99_ratio_gated']}** "
               f"(with A at 3 C: {res['neighbour_p99_ratio_gated_at_3c']}), B..J's p99 {gated['others']['p99_ms']} ms "
               f"against {gated['baseline']['p99_ms']} without A through the same gate; A answered "
               f"{gated['noisy']['answered_per_s']} requests/s ({gated['noisy']['answered_per_s'] / c:.2f} C), "
               f"{res['noisy_refused_by_gate_share']:.1%} of its requests refused by the gate itself; requests of "
               f"B..J refused: {sent(gated['others']) - gated['others']['answered']}. " if gated else "")
            + f"{res['seconds']} s per scenario; server config: {res['config']}; serving: {res['serving']}.\n\n"
            + (RAY_NOTE if ray else NOTE))


if __name__ == "__main__":
    main()
