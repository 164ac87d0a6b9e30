"""Scale-out on Ray Serve (``hmi serve --ray``) against the single-process server, side by side in
one run on the same home, tenants and load.

1. The single-process server (``hmi serve``) in this process; a closed-loop load of concurrent
   clients from a separate process, tenants drawn Zipf-skewed over 1,000 tenants.
2. The Ray Serve path with 1 replica, the same load, through the HAProxy ingress (the default of
   ``hmi serve --ray``), in rounds alternating with the single process (``--rounds``, default 3; a
   fresh single-process server and a fresh local Ray cluster for each run, each stopped after it:
   neither runs beside the other): ``ray_over_single_1replica`` is the median of the rounds' ratios.
   Every measured run starts after every tenant was requested once (what a server that has served
   its tenants holds: their adapters in its host cache, on Ray in the replica's multiplexed LRU,
   whose every new tenant Ray Serve also announces to its ingress); that first pass is reported
   beside it.
   Then Ray Serve's Python HTTP proxy (``ray_over_single_1replica_proxy``, against the median
   single-process figure).  Then the HAProxy ingress again with the
   registry actor (``--registry actor``, what replicas on several machines share) instead of the
   home's LMDB: ``ray_over_single_1replica_registry_actor``, and with each replica keeping a tenant's
   record 0.5 s (``--registry-cache-s 0.5``): ``ray_over_single_1replica_registry_actor_cached``.
3. 2 replicas (default ingress): every tenant requested once (cold: no replica holds any), then the Zipf load:
   ``affinity_hit_rate_2replicas`` is the share of those requests answered by a replica that
   already held the tenant (``X-HMI-Affinity``), and the requests per replica.
4. Still 2 replicas, under the same closed-loop load (each request: two fixed texts for one of 40
   tenants, its answer checked against the single-process server's): three tenants are created
   (fine-tune jobs on real BBC rows), and once one job runs, the replica running it is killed
   (SIGKILL).  ``lost_jobs_on_replica_kill`` counts accepted jobs that did not succeed,
   ``wrong_answers_on_replica_kill`` answers that differ from the single process's; also the
   errors answered, and how long until the replacement replica answered.

Both paths answer through HTTP on localhost; this machine's cores are shared by the client, Ray's
ingress and the replicas.

Usage: python benchmarks/bench_scale.py [--quick] [--rounds N]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_latency import run_load, temp_home  # noqa: E402
from benchmarks.common import finish, prepared_root, start, table  # noqa: E402
from hmi.dispatcher.gate import free_port  # noqa: E402

TENANTS = 1000
CLIENTS = 32
INGRESS_NAMES = {"proxy": "Python proxy", "haproxy": "HAProxy ingress"}
CACHE_S = 0.5  # --registry-cache-s of the cached registry actor's run
ACTOR = "Ray Serve, 1 replica, HAProxy ingress, registry actor"
ACTOR_CACHED = f"Ray Serve, 1 replica, HAProxy ingress, registry actor, records cached {CACHE_S} s"


def summary(r: dict) -> dict:
    lat = np.asarray(r["latencies_s"])
    hits, misses = r["affinity"].get("hit", 0), r["affinity"].get("miss", 0)
    return {"rps": round(len(lat) / r["wall_s"], 2), "answered": len(lat), "errors": r["errors"],
            "p50_ms": round(float(np.percentile(lat, 50) * 1e3), 1) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99) * 1e3), 1) if len(lat) else None,
            "affinity_hit_rate": round(hits / (hits + misses), 3) if hits + misses else None,
            "per_replica": sorted(r["replicas"].values(), reverse=True)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median requests / s of ``runs`` (their number odd), with every run's figure."""
    ranked = sorted(runs, key=lambda r: r["rps"])
    return {**ranked[len(ranked) // 2], "rps_rounds": [r["rps"] for r in runs]}


def replica_pids(url: str, probes: int = 40) -> set[int]:
    """The pids of the replicas that answer ``/healthz`` (not routed: any replica answers) in
    ``probes`` requests, read from ``X-HMI-Replica`` (host:pid:id)."""
    import urllib.request

    pids = set()
    for _ in range(probes):
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                pids.add(int(r.headers.get("X-HMI-Replica", "::").split(":")[1] or 0))
        except (OSError, ValueError):
            pass
    return pids - {0}


def replica_kill(url: str, home: Path, token: str, load: dict, seconds: float) -> dict:
    """Phase 4 (see the module's docstring): returns the jobs' ends and the answers' counts."""
    import signal
    import threading

    from hmi.client import ApiError, Client
    from hmi.data import load_task
    from hmi.services.registry import Registry

    admin = Client(url, token)

    def job(j: str) -> dict:  # a request that reached the killed replica is asked again
        for _ in range(50):
            try:
                return admin.job(j)
            except (ApiError, OSError):
                time.sleep(1)
        return admin.job(j)

    def wait(j: str) -> dict:
        while (rec := job(j))["state"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(1)
        return rec

    rows = load_task("news-topic", "train")[:96]
    labels = sorted({r["label"] for r in rows})
    box: dict = {}
    # The clients resend an inference that got no answer, as hmi.client does (twice at most).
    loader = threading.Thread(target=lambda: box.update(run_load({**load, "url": url, "seconds": seconds, "retries": 2})))
    loader.start()
    time.sleep(3)
    jobs = [admin.create_tenant(f"kill-{i}", labels, training_data={"train": rows}, epochs=2,
                                truncate=True)["job"] for i in range(3)]
    deadline = time.time() + 300
    while not (running := [j for j in jobs if job(j)["state"] == "running"]):
        if time.time() > deadline:
            raise RuntimeError("no job started running within 300 s")
        time.sleep(0.2)
    reg = Registry(home / "registry")
    owner = reg.get("jobs", running[0])["owner"]
    reg.close()
    pids = replica_pids(url)
    t_kill = time.time()
    os.kill(int(owner.rpartition(":")[2]), signal.SIGKILL)
    print(f"killed the replica {owner} running job {running[0]}", flush=True)
    replaced = None
    while replaced is None and time.time() < t_kill + 600:  # the replica Ray Serve starts in its place
        if replica_pids(url, probes=5) - pids:
            replaced = time.time() - t_kill
        time.sleep(0.5)
    loader.join()
    ends = [wait(j) for j in jobs]
    for j in ends:
        print(f"job {j['id']}: {j['state']}, attempt {j.get('attempt')}, {j.get('error') or ''}", flush=True)
    tl = box["timeline"]
    after = [(t, status) for t, status, _, _ in tl if t >= t_kill]
    failed = [t for t, status in after if status != 200]
    return {"jobs": len(jobs), "lost_jobs": sum(j["state"] != "succeeded" for j in ends),
            "jobs_run_again": sum(j.get("attempt", 1) > 1 for j in ends),
            "killed_job_attempt": next(j.get("attempt") for j in ends if j["id"] == running[0]),
            "answered": len(tl), "wrong": box["wrong"], "errors_after_kill": len(failed),
            "resent_by_the_client": box["retried"],
            "answers_after_kill": len(after), "error_codes": box["codes"],
            "last_error_after_kill_s": round(failed[-1] - t_kill, 1) if failed else 0.0,
            "replacement_replica_answered_s": None if replaced is None else round(replaced, 1),
            "jobs_done_after_kill_s": round(max(j.get("finished", j["updated"]) for j in ends) - t_kill, 1)}


def main() -> None:
    def options(ap):
        ap.add_argument("--inputs", type=int, default=1, help="texts per request (default 1)")
        ap.add_argument("--rounds", type=int, help="alternating single-process / Ray rounds (default 3; 1 with --quick)")
        ap.add_argument("--kill-only", action="store_true",
                        help="phase 4 alone (a replica killed under load), written to docs/results/bench_scale_kill.md")

    args = start(__doc__, options)
    rounds = args.rounds or (1 if args.quick else 3)
    import ray

    from hmi.data import load_task
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.home import hmi_home
    from hmi.scaleout.ray_registry import RemoteRegistry, start_registry_actor, stop_registry_actor
    from hmi.scaleout.ray_serve import ReplicaServer, stop
    from hmi.scaleout.ray_serve import start as start_ray
    from hmi.services.server import ServerConfig

    real = hmi_home()
    prepared_root(real)
    seconds = 8 if args.quick else 30
    tmp = Path(tempfile.mkdtemp(prefix="hmi-bench-scale-"))
    os.environ["HMI_ADMIN_TOKEN"] = token = "bench-admin-token-" + os.urandom(8).hex()
    cfg = ServerConfig(max_batch=32, max_wait_ms=5.0, host_cache_mb=1024)
    res: dict = {}
    try:
        root, names = temp_home(tmp, real, TENANTS)
        tok = root.tokenizer
        texts = [r["text"] for r in load_task("news-topic", "test")]
        texts = [tok.decode(tok(t, truncation=True, max_length=64)["input_ids"][1:-1]) for t in texts]
        base = {"token": token, "tenants": names, "texts": texts, "rate": 1.0, "clients": CLIENTS, "mode": "closed",
                "seconds": seconds, "max_requests": 50_000, "seed": 0, "zipf": True, "inputs": args.inputs}

        from hmi.client import Client

        def warm(url: str) -> float:
            """Before a measured run: every tenant requested once (the steady state of a server that
            has served its tenants: each one's adapter in the host cache and, on Ray, in the
            replica's multiplexed LRU), then 3 s of the Zipf load; returns that first pass's
            requests / s (the tenants cold)."""
            cold = run_load({**base, "url": url, "sequential": True, "zipf": False, "max_requests": TENANTS,
                             "seconds": 600})
            run_load({**base, "url": url, "seconds": 3})
            return summary(cold)["rps"]

        def single_run(first: bool) -> dict:
            """One run of a fresh single-process server in this process, stopped after it (nothing
            of it runs beside the Ray path); the first also answers the replica-kill reference."""
            url, stop_single = run_in_thread(build_server(cfg, home=tmp, root=root))
            try:
                cold = warm(url)
                if first:
                    single = Client(url, token)
                    reference.update({"inputs": texts[:2],
                                      "outputs": {t: single.infer(t, texts[:2]) for t in names[:40]}})
                out = {**summary(run_load({**base, "url": url})), "cold_rps": cold}
            finally:
                stop_single()
            print("single process", out, flush=True)
            return out

        reference: dict = {}
        env = {"HMI_HOME": str(tmp), "HMI_ADMIN_TOKEN": token}
        port = free_port()

        def ray_run(ingress: str, name: str) -> None:
            """One run through a fresh local cluster with ``ingress`` (chosen when the cluster starts)."""
            t = time.perf_counter()
            ray_url = start_ray(ReplicaServer(cfg, str(tmp)), port=port, replicas=1, env=env, ingress=ingress)
            res[f"ray start s ({ingress})"] = round(time.perf_counter() - t, 1)
            cold = warm(ray_url)
            res[name] = {**summary(run_load({**base, "url": ray_url})), "cold_rps": cold}
            print(name, res[name], flush=True)
            stop()

        if args.kill_only:
            url, stop_single = run_in_thread(build_server(cfg, home=tmp, root=root))
            single = Client(url, token)
            reference.update({"inputs": texts[:2], "outputs": {t: single.infer(t, texts[:2]) for t in names[:40]}})
            stop_single()
            ray_url = start_ray(ReplicaServer(cfg, str(tmp)), port=port, replicas=2, env=env)
            kill = replica_kill(ray_url, tmp, token, {**base, "reference": reference}, 40 if args.quick else 90)
            stop()
            failed = kill["errors_after_kill"]
            text = (f"Two replicas (HAProxy ingress), {CLIENTS} closed-loop clients each asking two fixed texts for one "
                    f"of 40 tenants (answers checked against the single process) and resending one that got no answer "
                    f"as hmi.client does (at most twice, after 0.5 and 2 s); three fine-tune jobs, and once one runs, "
                    f"the replica running it is killed (SIGKILL). errors_after_kill: requests that failed in the end; "
                    f"resent_by_the_client: the answers the ingress could not give (HAProxy resends what a dead "
                    f"replica lost before it answered; what it cannot resend, the client does).\n\n"
                    + table([(k, v) for k, v in kill.items()], ("", "value")))
            finish("bench_scale_kill", text, {"failed_requests_on_replica_kill": failed, **kill},
                   "python benchmarks/bench_scale.py --kill-only" + (" --quick" if args.quick else ""))
            return

        pairs = []
        for r in range(rounds):  # the single process and the Ray path alternate, each alone on the machine
            one = single_run(first=r == 0)
            ray_run("haproxy", f"round {r + 1}")
            pairs.append((one, res.pop(f"round {r + 1}")))
        res["single process"] = median_run([p[0] for p in pairs])
        res["Ray Serve, 1 replica, HAProxy ingress"] = median_run([p[1] for p in pairs])
        ratios = [round(b["rps"] / a["rps"], 3) for a, b in pairs]
        ray_run("proxy", "Ray Serve, 1 replica, Python proxy")

        from ray import serve

        for cache_s, name in ((0.0, ACTOR), (CACHE_S, ACTOR_CACHED)):  # a local cluster, the HAProxy ingress
            ray_url = start_ray(ReplicaServer(cfg, str(tmp), registry="actor", registry_cache_s=cache_s), port=port,
                                replicas=1, env=env)
            actor = start_registry_actor(tmp)  # the one start_ray started: its call counts
            warm(ray_url)
            before = ray.get(actor.stats.remote()).get("get", 0)
            res[name] = summary(run_load({**base, "url": ray_url}))
            res[name]["registry_reads_per_request"] = round(
                (ray.get(actor.stats.remote()).get("get", 0) - before) / max(1, res[name]["answered"]), 3)
            print(name, res[name], flush=True)
            serve.delete("hmi")
        reg, name = RemoteRegistry(), names[0]
        t = time.perf_counter()
        for _ in range(2000):
            reg.get("tenants", name)
        actor_get_us = round((time.perf_counter() - t) / 2000 * 1e6, 1)
        stop_registry_actor()
        start_ray(ReplicaServer(cfg, str(tmp)), port=port, replicas=2, env=env)  # two fresh replicas
        cold = run_load({**base, "url": ray_url, "sequential": True, "zipf": False, "max_requests": TENANTS,
                         "seconds": 600})
        res["Ray Serve, 2 replicas, every tenant once (cold)"] = summary(cold)
        res["Ray Serve, 2 replicas"] = summary(run_load({**base, "url": ray_url}))
        print("ray 2", res["Ray Serve, 2 replicas"], flush=True)
        kill = replica_kill(ray_url, tmp, token, {**base, "reference": reference}, 40 if args.quick else 90)
        print("replica kill", kill, flush=True)
        stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    single, ray2 = res["single process"], res["Ray Serve, 2 replicas"]
    ray1_proxy = res["Ray Serve, 1 replica, Python proxy"]
    out = {"ray_over_single_1replica": float(np.median(ratios)), "ray_over_single_1replica_rounds": ratios,
           "ray_over_single_1replica_proxy": round(ray1_proxy["rps"] / single["rps"], 3),
           "ray_over_single_1replica_registry_actor": round(res[ACTOR]["rps"] / single["rps"], 3),
           "ray_over_single_1replica_registry_actor_cached": round(res[ACTOR_CACHED]["rps"] / single["rps"], 3),
           "registry_actor_get_us": actor_get_us,
           "affinity_hit_rate_2replicas": ray2["affinity_hit_rate"],
           "lost_jobs_on_replica_kill": kill["lost_jobs"], "wrong_answers_on_replica_kill": kill["wrong"],
           "replica_kill": kill, "runs": res, "tenants": TENANTS, "clients": CLIENTS, "seconds": seconds}
    rows = [(k, v["answered"], v["errors"], f"{v['rps']:.1f}", v["p50_ms"], v["p99_ms"],
             "" if v["affinity_hit_rate"] is None else f"{v['affinity_hit_rate']:.3f}", v["per_replica"] or "")
            for k, v in res.items() if isinstance(v, dict)]
    text = table(rows, ("path", "answered", "errors", "requests / s", "p50 ms", "p99 ms", "affinity hits",
                        "requests per replica"))
    text += (f"\n\n{TENANTS:,} registered tenants (bottleneck adapters on the current root), tenants drawn Zipf-skewed "
             f"(p(rank k) ~ 1/k) by {CLIENTS} closed-loop clients in a separate process, {args.inputs} real BBC text(s) (up to 64 "
             f"tokens each) per request, {seconds} s per measured run, each after every tenant was requested once (the "
             "steady state of a server that has served its tenants) and 3 s of the load. ray_over_single_1replica = "
             f"{out['ray_over_single_1replica']} through the HAProxy ingress (the default; the median of {rounds} "
             f"rounds' ratios {ratios}, each round the single process then Ray, Ray stopped between rounds; "
             f"single process {res['single process']['rps_rounds']} requests/s, Ray "
             f"{res['Ray Serve, 1 replica, HAProxy ingress']['rps_rounds']}; the rows above show the median runs; the "
             f"pass that first requested every tenant, one request after another: single process "
             f"{[p[0]['cold_rps'] for p in pairs]} requests/s, Ray {[p[1]['cold_rps'] for p in pairs]}), "
             f"{out['ray_over_single_1replica_proxy']} through Ray Serve's Python proxy, "
             f"{out['ray_over_single_1replica_registry_actor']} through the HAProxy ingress with the registry actor (every "
             f"request reads its tenant's record from the actor, one Ray call; {actor_get_us} us per read, one after another, "
             f"from this process; {res[ACTOR]['registry_reads_per_request']} registry reads per request), "
             f"{out['ray_over_single_1replica_registry_actor_cached']} with the records cached {CACHE_S} s "
             f"(--registry-cache-s; {res[ACTOR_CACHED]['registry_reads_per_request']} reads per request); "
             "2 replicas: the HAProxy ingress, the home's registry; "
             f"affinity_hit_rate_2replicas = {out['affinity_hit_rate_2replicas']} "
             f"(after every tenant was requested once). Ray Serve took {res['ray start s (haproxy)']} s to start with one replica. "
             "\n\nReplica killed under load (2 replicas, the same clients, each request two fixed texts for one of "
             f"40 tenants, checked against the single process's answers): {kill['answered']:,} requests, "
             f"{kill['wrong']} wrong answers, {kill['errors_after_kill']} errors after the kill (the last "
             f"{kill['last_error_after_kill_s']} s after it; codes {kill['error_codes']}); the replica Ray Serve started in its "
             f"place answered {kill['replacement_replica_answered_s']} s after the kill. {kill['jobs']} fine-tune jobs accepted, "
             f"{kill['lost_jobs']} lost; the killed replica's job ran again (attempt {kill['killed_job_attempt']}) and "
             f"all ended {kill['jobs_done_after_kill_s']} s after the kill.")
    out["inputs_per_request"] = args.inputs
    finish("bench_scale", text, out, "python benchmarks/bench_scale.py" + (" --quick" if args.quick else "")
           + (f" --inputs {args.inputs}" if args.inputs != 1 else "") + (f" --rounds {args.rounds}" if args.rounds else ""))


if __name__ == "__main__":
    main()
