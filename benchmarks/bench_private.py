"""Private tenants (split execution) against hosted tenants, side by side on loopback, in one run.

Usage: python benchmarks/bench_private.py [--quick] [--processes 4] [--texts 8]

One server process (the prepared default root) serves N tenants at once, each a client thread
sending requests of ``--texts`` real texts (cut to 64 tokens) one after another:
- hosted: the tenant's adapter on the server, ``POST /v1/tenants/{t}/infer``;
- private: the same adapter on the client (``hmi.split.PrivateModel``, noise on), the server's
  base executor batching the frozen projections of every client;
- private, unbatched: the same with the executor's cross-client batching off.
The clients run in ``--processes`` processes of their own (one torch thread each); the server and
every client share the machine's cores, so a private request's client work is paid on them too.
Reported: requests/s, p50/p99 latency, round trips and bytes per request, at 1, 8 and 32 clients.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

from common import adapter_variants, finish, machine, start, table

CLIENTS = (1, 8, 32)


def _client_process(mode, url, jobs, texts, requests, ready, go, results):
    """Runs one client thread per (tenant, token, adapter zip) of ``jobs`` and reports
    (latencies, round trips, bytes) per thread."""
    import threading

    import torch

    torch.set_num_threads(1)
    from hmi.client import Client
    from hmi.model.root import default_spec
    from hmi.split.client import BaseClient
    from hmi.split.model import Noise, PrivateModel

    models = []
    for tenant, token, archive in jobs:
        if mode == "hosted":
            models.append((tenant, Client(url, token), None))
        else:
            base = BaseClient(url, token)
            models.append((tenant, base, PrivateModel(base, default_spec().model_dir, 3, PrivateModel.files_of(archive),
                                                      noise=Noise(base), max_len=64)))
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

    if mode != "hosted":  # the noise's effects are asked once per client, before the clock starts
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
    procs = [ctx.Process(target=_client_process, args=(mode, url, p, texts, requests, ready, go, results))
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


def main() -> None:
    args = start(__doc__, lambda ap: (ap.add_argument("--processes", type=int, default=4),
                                     ap.add_argument("--texts", type=int, default=8)))
    from hmi.adapters.portable import RootShape, write_encoder
    from hmi.adapters.spec import AdapterSpec
    from hmi.archive import zip_files
    from hmi.bootstrap import prepare_default
    from hmi.data import held_out_texts
    from hmi.dispatcher.serve import build_server, run_in_thread
    from hmi.dispatcher.server import ServerConfig
    from hmi.home import hmi_home
    from hmi.split.client import BaseClient
    from hmi.split.model import PrivateModel

    requests = 3 if args.quick else 10
    prepare_default(hmi_home())  # the default root and its root PLOT, when missing
    server = build_server(ServerConfig(max_len=64, max_inputs=64))
    root = server.root
    url, stop = run_in_thread(server)
    texts = held_out_texts(args.texts)
    c = root.bert.config
    shape = RootShape(c.model_type, c.hidden_size, c.num_hidden_layers, root.l_low, c.hidden_size, root.spec.name)
    spec = AdapterSpec(labels=("neg", "pos"))
    n_max = max(CLIENTS)
    weights = adapter_variants(root.bert, root.l_low, spec, n_max)
    hosted, private = [], []
    for name, rec in server.registry.items("tenants"):  # a run stopped before it cleaned up
        if name.startswith("bench-"):
            server.tenants.delete(name, rec)
    for i, w in enumerate(weights):
        token = server.transfer.import_adapter(f"bench-hosted-{i}", "encoder", spec, w)
        archive = zip_files(write_encoder(spec, w, shape, f"bench-{i}"), f"bench-{i}")
        hosted.append((f"bench-hosted-{i}", token, archive))
        private.append((f"bench-private-{i}", server.tenants.create_private(f"bench-private-{i}"), archive))
    # The answers of one tenant both ways: how far apart they are.
    base = BaseClient(url, private[0][1])
    got = PrivateModel(base, root.spec.model_dir, root.l_low, PrivateModel.files_of(private[0][2]), max_len=64)
    from hmi.client import Client

    want = Client(url, hosted[0][1]).infer(hosted[0][0], texts, truncate=True)
    mine = got.infer(texts, truncate=True)
    diff = max(abs(a["scores"][k] - b["scores"][k]) for a, b in zip(want, mine) for k in a["scores"])

    rows, res = [], {"max_abs_diff_vs_hosted": round(diff, 8), "requests_per_client": requests, "texts": args.texts,
                     "processes": args.processes}
    for n in CLIENTS:
        for mode, tenants, batching in (("hosted", hosted, True), ("private", private, True),
                                        ("private, unbatched", private, False)):
            server.executor.batching = batching
            before = dict(server.executor.stats)
            rps, p50, p99, trips, nbytes = measure(mode, url, tenants[:n], texts, requests, args.processes)
            gemm_rows = (server.executor.stats["rows"] - before["rows"]) / max(1, server.executor.stats["batches"]
                                                                              - before["batches"])
            rows.append((n, mode, f"{rps:.2f}", f"{p50:.0f}", f"{p99:.0f}", f"{trips:.1f}", f"{nbytes / 2**20:.2f}",
                         f"{gemm_rows:.0f}" if mode != "hosted" else "-"))
            res[f"{mode.replace(', ', '_')}_{n}_rps"] = round(rps, 3)
            print(rows[-1], flush=True)
    server.executor.batching = True
    for name, rec in server.registry.items("tenants"):
        if name.startswith("bench-"):
            server.tenants.delete(name, rec)
    stop()
    res["private_over_hosted_32"] = round(res["private_32_rps"] / res["hosted_32_rps"], 3)
    res["batched_over_unbatched_32"] = round(res["private_32_rps"] / res["private_unbatched_32_rps"], 3)
    res["extraction_error_without_noise"] = None  # the attackers are not built yet (docs/private.md)
    res["extraction_error_with_noise"] = None
    text = (f"{args.texts} texts of held-out real text a request (cut to 64 tokens), {requests} requests a client in "
            f"a row, clients in {args.processes} processes (one torch thread each); the server and every client share "
            f"the machine's cores ({machine()}). Private tenants with noise; the noise's effects are asked before "
            "the clock starts.\n\n"
            + table(rows, ("clients", "tenants", "requests/s", "p50 ms", "p99 ms", "round trips / request",
                           "MiB / request", "rows / executor GEMM"))
            + f"\n\nprivate / hosted at 32 clients: {res['private_over_hosted_32']}; cross-client batching / none at "
              f"32 clients: {res['batched_over_unbatched_32']}; largest score difference private vs hosted: {diff:.2e}.")
    finish("bench_private", text, res, "python benchmarks/bench_private.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
