"""Noisy neighbours and overload through the real HTTP server: does one tenant's flood raise the
others' latency, and what happens to admitted requests at twice the capacity?

Usage: python benchmarks/bench_overload.py [--quick] [--ray] [--apart [N]]

The server runs in this process on the current root and root PLOT with ten ready tenants (A, then
B..J), default configuration (fair shares: 2 batches in flight, 256 requests per tenant queue), or
with ``--ray`` as two Ray Serve replicas behind the HAProxy ingress (``hmi.scaleout.ray_serve``,
tenant affinity: each replica runs the whole server with its own fair queue; results in
docs/results/bench_overload_ray.md);
load comes from separate client processes on localhost (the same 2 cores; with ``--apart [N]`` on the
last N cores alone (default 1), the server and its gate on the others, results in docs/results/bench_overload_apart.md),
open loop (requests sent on schedule whatever the answers), one real short text (a tweet) per
request. The scenarios after the capacity run in interleaved rounds (three of 10 s; one with
``--quick``), so that the machine's drift falls on all of them alike:

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
   **fair**: B..J at 0.7 C beside A sending only its share (0.1 C), no flood, directly and through
   the gate (``neighbour_p99_ratio_fair``, ``..._gated_fair``): what any admission that serves A
   its share can reach.
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
from benchmarks.common import cores_apart, finish, start, table  # noqa: E402
from hmi.dispatcher.gate import HOLD_S, Gate, free_port, haproxy_binary  # noqa: E402

TENANTS = 10
CLIENT_CPUS: set[int] | None = None  # --apart: the load generators' cores
REPLICAS = 2
RAY_NOTE = ("Through Ray Serve each replica runs the whole server (its own fair queue and admission, which every "
            "request the replica takes reaches); HAProxy routes a tenant's requests to one replica by the routing "
            "header's hash. Every request passes HAProxy, Ray Serve's replica front and the replica's forward to its "
            "server, on the same two cores as the load generator: a flood faster than those Python fronts can "
            "refuse waits in front of them, first come, first served, and everyone's latency grows with it. "
            "Through the gate (`hmi serve --ray --gate`, HAProxy in front of Ray Serve's ingress) the replica that "
            "keeps refusing a tenant over its share marks it there, and HAProxy refuses the rest of its flood "
            "before any Python front sees it.")
NOTE = ("What these figures say on 2 cores. Admission holds the overload's answered p99 near the p99 at "
        "capacity by refusing at once what would wait past about 0.25 s, and the fair queue puts a quiet tenant's "
        "request before a noisy tenant's backlog (tests/scheduler/test_batcher.py). A tenant sending more than "
        "four times its fair rate is refused past its share of that bound among the tenants served lately, though "
        "the batcher is far from full: before, it could queue the whole bound (64 requests, about 0.6 s of work "
        "here) before any refusal, and those rows filled whole batches, which are not preempted. Directly, every "
        "refusal of a flood is parsed, authenticated and answered by the server's Python event loop, on the "
        "cores the scheduler needs: the others' latency rises many times and some of their requests are refused. "
        "Through the gate (`hmi serve --gate`) HAProxy answers almost all of the flood itself and admits the "
        "flooding tenant evenly at its fair rate. The 'fair' rows are the bound of any admission that serves "
        "the flooding tenant its share: the same tenant sending only that share, with no flood; the load is "
        "then about 0.8 C instead of 0.7 C, and the others' latency rises with it. On this machine every p99 "
        "carries stalls of 0.3 to 1 s that come and go (the baselines' own p99 varied from 77 to 452 ms between "
        "runs of the same command), so a p99 ratio moves by several times from run to run; the p50 column and "
        "the rows beside each other in one run (three interleaved rounds) are what to compare. With --apart the "
        "load generators run on their own core, as clients on other machines would, and the server and its gate "
        "on the other: the flood's generator then costs the server nothing.")


def pct(lat: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(lat), q)) * 1e3, 1) if len(lat) else float("nan")


def together(specs: list[dict]) -> list[dict]:
    """Runs load generators at the same time (each its own process, on ``CLIENT_CPUS`` when
    set); their results in order."""
    out = [None] * len(specs)

    def go(i):
        out[i] = run_load(specs[i], CLIENT_CPUS)

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
    """The results of load generators run together, and the CPU they used in cores (user + system
    seconds of the finished child processes over the wall time); first the server (when in this
    process) works off what an earlier scenario left queued."""
    settle(server)
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = together(specs)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return out, round(cpu / wall, 2)


def interleaved(scenarios: dict[str, list[dict]], rounds: int, server=None) -> dict[str, tuple[list[dict], float]]:
    """Runs every scenario (its load generators together) ``rounds`` times, round robin, each time
    for 1/rounds of its seconds, so that a drift of the machine's speed falls on all of them alike.
    Per scenario: its generators' summaries over all rounds, and the CPU they used (cores)."""
    runs: dict[str, list[tuple[list[dict], float]]] = {name: [] for name in scenarios}
    for _ in range(rounds):
        for name, specs in scenarios.items():
            runs[name].append(loads([{**spec, "seconds": spec["seconds"] / rounds} for spec in specs], server))
    return {name: ([summary(merged([out[i] for out, _ in runs[name]])) for i in range(len(scenarios[name]))],
                   round(sum(cpu for _, cpu in runs[name]) / rounds, 2)) for name in scenarios}


def merged(results: list[dict]) -> dict:
    """One load generator's results over several runs, as if it had run once."""
    out = {"latencies_s": [], "refused_s": [], "wall_s": 0.0, "codes": {}, "refused_by": {}}
    for r in results:
        out["latencies_s"] += r["latencies_s"]
        out["refused_s"] += r["refused_s"]
        out["wall_s"] += r["wall_s"]
        for key in ("codes", "refused_by"):
            for k, v in r[key].items():
                out[key][k] = out[key].get(k, 0) + v
    return out


class Quiet:
    """Stands for a server that runs elsewhere (Ray Serve's replicas) in ``settle``: idle once a
    request of a quiet tenant is answered within half a second (a flood's backlog in front of the
    replicas is gone)."""

    def __init__(self, url: str, token: str, tenant: str):
        self.url, self.token, self.tenant = url, token, tenant

    @property
    def idle(self) -> bool:
        import json
        import urllib.request

        from hmi.client import ROUTING_HEADER

        req = urllib.request.Request(f"{self.url}/v1/tenants/{self.tenant}/infer", json.dumps({"inputs": ["quiet?"]}).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}",
                                      ROUTING_HEADER: self.tenant})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except OSError:
            return False
        return time.monotonic() - t0 < 0.5


def settle(server, timeout_s: float = 120.0) -> None:
    """Waits until ``server``'s batcher is idle (a flood's backlog answered; a ``Quiet`` for
    replicas elsewhere), then a second more."""
    deadline = time.monotonic() + timeout_s
    while (server is not None and not (server.idle if isinstance(server, Quiet) else server.batcher.idle)
           and time.monotonic() < deadline):
        time.sleep(0.1)
    time.sleep(1.0)


def serving(ray: bool, tmp: Path, token: str, root):
    """(url, the server's config, stop(), the server or None, the gate or None): the server in this
    process, or two Ray Serve replicas on the same home behind the HAProxy ingress, that behind the
    gate (``hmi serve --ray --gate``, which the replicas mark) where HAProxy is installed; ``url``
    is then Ray Serve's own ingress, the gate's URL ``gate.url``."""
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.services.server import ServerConfig

    cfg = ServerConfig()
    if not ray:
        server = build_server(cfg, home=tmp, root=root)
        url, stop = run_in_thread(server)

        def close() -> None:
            stop()
            server.shutdown()
        return url, cfg, close, server, None
    from hmi.scaleout.ray_serve import ReplicaServer, start_behind_gate, stop
    from hmi.scaleout.ray_serve import start as start_ray

    env = {"HMI_HOME": str(tmp), "HMI_ADMIN_TOKEN": token}
    if not haproxy_binary():
        return start_ray(ReplicaServer(cfg, str(tmp)), port=free_port(), replicas=REPLICAS, env=env), cfg, stop, None, None
    gate, url = start_behind_gate(ReplicaServer(cfg, str(tmp)), port=free_port(), replicas=REPLICAS, env=env)

    def close_both() -> None:
        stop()
        gate.close()
    return url, cfg, close_both, None, gate


def main() -> None:
    def options(ap):
        ap.add_argument("--ray", action="store_true", help=f"through Ray Serve: {REPLICAS} replicas, HAProxy ingress")
        ap.add_argument("--apart", type=int, nargs="?", const=1, default=0, metavar="N",
                        help="load generators on the last N cores (default 1), the server and its gate on the others")

    args = start(__doc__, options)
    global CLIENT_CPUS
    if args.apart:
        CLIENT_CPUS, _ = cores_apart(args.apart)
    from hmi.data import load_task
    seconds, rounds = (2, 1) if args.tiny else (10, 1) if args.quick else (30, 3)
    tmp, token, root, names = bench_home("hmi-bench-overload-", TENANTS)
    try:
        noisy, others = names[0], names[1:]
        texts = [r["text"] for r in load_task("tweet-sentiment", "test")]
        url, cfg, close, server, ray_gate = serving(args.ray, tmp, token, root)
        if server is None:
            server = Quiet(url, token, others[0])
        base = {"url": url, "token": token, "texts": texts, "clients": 1, "seconds": seconds, "max_requests": 200_000,
                "seed": 0, "mode": "rate", "rate": 1.0}
        run_load({**base, "tenants": names, "mode": "closed", "clients": 16, "seconds": 3})  # warm-up
        ((cap,), cpu_cap), = interleaved({"capacity": [{**base, "tenants": names, "mode": "closed", "clients": 64}]},
                                         1, server).values()
        c = cap["answered_per_s"]
        print("capacity", cap, flush=True)

        def scenarios(at: str) -> dict[str, list[dict]]:
            others_load = {**base, "url": at, "tenants": others, "rate": 0.7 * c}

            def beside(rate: float) -> list[dict]:
                return [others_load, {**base, "url": at, "tenants": [noisy], "rate": rate * c, "seed": 1}]
            return {"baseline": [others_load], "noisy": beside(10), "noisy_at_3c": beside(3), "fair": beside(0.1)}

        direct = interleaved(scenarios(url), rounds, server)
        print("direct", direct, flush=True)
        gated = None
        if not isinstance(server, Quiet) and haproxy_binary():
            server.gate = gate = Gate.start("127.0.0.1", free_port(), url.rsplit("//", 1)[1])
            try:
                gated = interleaved(scenarios(gate.url), rounds, server)
            finally:
                server.gate = None
                gate.close()
            print("through the gate", gated, flush=True)
        elif ray_gate is not None:
            gated = interleaved(scenarios(ray_gate.url), rounds, server)
            print("through the gate", gated, flush=True)
        overload = interleaved({"at_capacity": [{**base, "tenants": names, "rate": 1.0 * c}],
                                "overload": [{**base, "tenants": names, "rate": 2.0 * c}]}, rounds, server)
        print("capacity / overload", overload, flush=True)
        close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    res = results(c, cap, cpu_cap, direct, gated, overload)
    res.update({"config": {"batches_in_flight": cfg.batches_in_flight, "tenant_queue": cfg.tenant_queue,
                           "max_batch": cfg.max_batch, "max_wait_ms": cfg.max_wait_ms},
                "seconds": seconds, "rounds": rounds,
                "serving": f"Ray Serve, {REPLICAS} replicas, HAProxy ingress" if args.ray else "one process",
                "load_generators": (f"on {len(CLIENT_CPUS)} core(s) of their own ({', '.join(map(str, sorted(CLIENT_CPUS)))}), "
                                    "the server and its gate on the others" if CLIENT_CPUS else "on the same cores as the server")})
    name = "bench_overload" + ("_ray" if args.ray else "") + ("_apart" if args.apart else "")
    finish(name, report(res, args.ray), res, "python benchmarks/bench_overload.py" + (" --quick" if args.quick else "")
           + (" --ray" if args.ray else "") + (f" --apart {args.apart}" if args.apart > 1 else " --apart" if args.apart else ""))


def results(c: float, cap: dict, cpu_cap: float, direct: dict, gated: dict | None, overload: dict) -> dict:
    """The JSON result from the scenarios' summaries (``interleaved``)."""
    def ratio(runs: dict, name: str) -> float:
        return round(runs[name][0][0]["p99_ms"] / runs["baseline"][0][0]["p99_ms"], 2)

    (baseline,), _ = direct["baseline"]
    (quiet, loud), _ = direct["noisy"]
    (at_cap,), _ = overload["at_capacity"]
    (over,), _ = overload["overload"]
    res = {"capacity_per_s": c, "capacity": cap, "baseline": baseline, "noisy_others": quiet, "noisy_tenant": loud,
           "noisy3_others": direct["noisy_at_3c"][0][0], "noisy3_tenant": direct["noisy_at_3c"][0][1],
           "fair_others": direct["fair"][0][0], "fair_tenant": direct["fair"][0][1],
           "at_capacity": at_cap, "overload": over,
           "generators_cpu_cores": {"capacity": cpu_cap, **{k: cpu for k, (_, cpu) in direct.items()},
                                    **{k: cpu for k, (_, cpu) in overload.items()}},
           "neighbour_p99_ratio": ratio(direct, "noisy"), "neighbour_p99_ratio_at_3c": ratio(direct, "noisy_at_3c"),
           "neighbour_p99_ratio_fair": ratio(direct, "fair"),
           "noisy_429_share": round(loud["codes"].get("429", 0) / max(1, sent(loud)), 3),
           "others_refused": sent(quiet) - quiet["answered"],
           "overload_p99_over_capacity_p99": round(over["p99_ms"] / at_cap["p99_ms"], 2),
           "overload_shed_share": round(over["codes"].get("429", 0) / max(1, sent(over)), 3), "gated": None}
    if gated:
        res["gated"] = {"baseline": gated["baseline"][0][0], "others": gated["noisy"][0][0],
                        "noisy": gated["noisy"][0][1], "others_at_3c": gated["noisy_at_3c"][0][0],
                        "noisy_at_3c": gated["noisy_at_3c"][0][1], "others_fair": gated["fair"][0][0],
                        "fair_tenant": gated["fair"][0][1], "cpu": {k: cpu for k, (_, cpu) in gated.items()}}
        res.update({"neighbour_p99_ratio_gated": ratio(gated, "noisy"),
                    "neighbour_p99_ratio_gated_at_3c": ratio(gated, "noisy_at_3c"),
                    "neighbour_p99_ratio_gated_fair": ratio(gated, "fair"),
                    "noisy_refused_by_gate_share": round(res["gated"]["noisy"]["refused_by_gate"]
                                                         / max(1, sent(res["gated"]["noisy"])), 3)})
    return res



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
            row(f"noisy: A at 3 C ({3 * c:.0f}/s)", res["noisy3_tenant"], "(with the row above)"),
            row("fair: B..J at 0.7 C, beside A at its share", res["fair_others"], cpu["fair"]),
            row(f"fair: A at 0.1 C ({0.1 * c:.0f}/s, no flood)", res["fair_tenant"], "(with the row above)")]
    if gated:
        rows += [row("gate: baseline, B..J at 0.7 C", gated["baseline"], gated["cpu"]["baseline"]),
                 row("gate: B..J at 0.7 C, beside A", gated["others"], gated["cpu"]["noisy"]),
                 row("gate: A at 10 C", gated["noisy"], "(with the row above)"),
                 row("gate: B..J at 0.7 C, beside A at 3 C", gated["others_at_3c"], gated["cpu"]["noisy_at_3c"]),
                 row("gate: A at 3 C", gated["noisy_at_3c"], "(with the row above)"),
                 row("gate: B..J at 0.7 C, beside A at its share", gated["others_fair"], gated["cpu"]["fair"]),
                 row("gate: A at 0.1 C (no flood)", gated["fair_tenant"], "(with the row above)")]
    rows += [row(f"all tenants at 1.0 C ({c:.0f}/s)", res["at_capacity"], cpu["at_capacity"]),
             row(f"all tenants at 2.0 C ({2 * c:.0f}/s)", res["overload"], cpu["overload"])]
    text = table(rows, ("load", "sent", "answered", "429", "p50 ms (answered)", "p99 ms (answered)",
                        "load generators' CPU (cores)"))
    return (text + f"\n\nCapacity C = {c} answered requests/s. `neighbour_p99_ratio` (B..J's p99 beside the noisy "
            f"tenant over without it): **{res['neighbour_p99_ratio']}** (target <= 1.5; with A at 3 C: "
            f"{res['neighbour_p99_ratio_at_3c']}; beside A sending only its share, 0.1 C: "
            f"{res['neighbour_p99_ratio_fair']}, what any admission that serves A its share can reach); "
            f"the noisy tenant's requests refused "
            f"(429 over_share): {res['noisy_429_share']:.1%}; requests of B..J refused: {res['others_refused']}. "
            f"`overload_p99_over_capacity_p99`: **{res['overload_p99_over_capacity_p99']}** (target <= 2), "
            f"{res['overload_shed_share']:.1%} shed with 429, a refusal's p99 {res['overload']['refused_p99_ms']} ms. "
            + (f"Through the gate (`hmi serve{' --ray' if ray else ''} --gate`: HAProxy holds a tenant the "
               f"{'replicas' if ray else 'server'} refused over its share "
               f"to its fair rate, its share of the answered requests per second, until it has sent within that "
               f"rate for {HOLD_S:g} s): `neighbour_p99_ratio_gated` **{res['neighbour_p99_ratio_gated']}** "
               f"(with A at 3 C: {res['neighbour_p99_ratio_gated_at_3c']}; beside A at its share: "
               f"{res['neighbour_p99_ratio_gated_fair']}), B..J's p99 {gated['others']['p99_ms']} ms "
               f"against {gated['baseline']['p99_ms']} without A through the same gate; A answered "
               f"{gated['noisy']['answered_per_s']} requests/s ({gated['noisy']['answered_per_s'] / c:.2f} C), "
               f"{res['noisy_refused_by_gate_share']:.1%} of its requests refused by the gate itself; requests of "
               f"B..J refused: {sent(gated['others']) - gated['others']['answered']}. " if gated else "")
            + f"{res['seconds']} s per scenario in {res['rounds']} interleaved rounds; server config: {res['config']}; "
            f"serving: {res['serving']}; load generators {res['load_generators']}.\n\n"
            + (RAY_NOTE if ray else NOTE))


if __name__ == "__main__":
    main()
