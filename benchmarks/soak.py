"""A soak: the real server (``hmi serve --hgpt``, its own process) under a mixed workload for a
given time, sampled for growth.

Usage: python benchmarks/soak.py --minutes 120 [--tenants 1000] [--quick]

The server runs on a temporary home that shares the prepared root artifact and PLOTs (as
``bench_latency`` does) with ``--tenants`` ready encoder tenants, plus the demo tenants (their
shipped adapters: ``demo-news``, ``demo-reviews`` and the decoder tenant ``demo-legal-gpt``).
With ``--no-demo`` the server starts without them (``hmi serve --no-demo``): the soak trains a
decoder tenant of its own (``soak-gpt``, a short job) and churns one of its encoder tenants'
adapters; this is how the test suite runs it, on a home whose root PLOTs are built from a slice
of the general corpus, which the shipped demo adapters were not trained on.
Meanwhile, from this process's threads, each with its own ``hmi.client.Client``:

- **inference**: 3 clients, back to back, each request 1-4 held-out texts for a tenant drawn with
  Zipf popularity (p(rank k) ~ 1/k) over the tenants;
- **streaming generation**: 1 client streaming 24 tokens from the decoder tenant; every third
  stream is dropped by the client after its first pieces (a client that disconnects mid-stream);
- **fine-tune jobs**: every ``--job-every`` seconds a new tenant is trained (news topics, 40
  texts, 1 epoch), must succeed, and is deleted;
- **domain updates**: a domain created and updated at the start, then updated every
  ``--domain-every`` seconds, from 600 lines of the legal corpus (10 distillation steps, 4 with
  ``--quick``); every job must succeed;
- **churn**: every 20 s one of the tenants is deleted and uploaded again (the adapter API); an
  inference that meets it gone or importing meanwhile (404, 409) is counted as ``infer_churned``.

Every ``--sample`` seconds it records the server process's RSS, open file descriptors and
threads, its live child processes, the LMDB reader slots in use (registry and both root PLOTs) and
the number of series ``/metrics`` exposes (and the adapters' host cache, which a first request
for every tenant fills before the clock starts).  After ``--warmup`` minutes, the median of the last
quarter of the samples is compared with the median of the first quarter after warm-up: RSS may
grow by at most 10 %, file descriptors by at most 8 (sockets come and go), threads, child
processes, reader slots and metric series not at all.  Any server error (5xx, a dropped
connection, a stream that ends without its final message when the client did not drop it), a job
that does not succeed, or a server that does not stop cleanly on SIGTERM fails the soak (exit 1).
``--quick`` (CI: 100 tenants, jobs every 45 s, the domain created once, its decoder tenant trained
on four short lines with ``--no-demo``) judges those alone:
growth over two minutes is warm-up, so it is reported there, not judged.
Results: ``docs/results/soak.md`` and ``docs/results/soak.png`` (``HMI_BENCH_DOCS`` elsewhere).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_latency import bench_home  # noqa: E402
from benchmarks.common import DOCS, finish, start, table  # noqa: E402
from hmi.dispatcher.gate import free_port  # noqa: E402

RSS_GROWTH = 0.10
FD_SLACK = 8
NEWS_LABELS = ["business", "entertainment", "politics", "sport", "tech"]


def options(ap) -> None:
    ap.add_argument("--minutes", type=float, default=120.0, help="how long the workload runs (default 120)")
    ap.add_argument("--tenants", type=int, default=None, help="ready encoder tenants (default 1000; 100 with --quick)")
    ap.add_argument("--sample", type=float, default=None, help="seconds between samples (default 30; 10 with --quick)")
    ap.add_argument("--warmup", type=float, default=None, help="minutes before growth counts (default 10; 0.5 quick)")
    ap.add_argument("--job-every", type=float, default=None, help="seconds between fine-tune jobs (default 300; 45)")
    ap.add_argument("--domain-every", type=float, default=None, help="seconds between domain jobs (default 1200; 60)")
    ap.add_argument("--no-demo", action="store_true",
                    help="serve without the demo tenants; the soak trains its own decoder tenant instead")


# -- the server's process, as the soak sees it ------------------------------------------------------
def proc_status(pid: int) -> dict:
    """RSS (MB; and its parts: private heap ``anon``, mapped files such as the PLOTs' LMDB pages
    ``file``, shared memory ``shmem``), open file descriptors, threads and live children of ``pid``."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    mb = lambda key: round(int(status[key].split()[0]) / 1024, 1)  # noqa: E731
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {"rss_mb": mb("VmRSS"), "anon_mb": mb("RssAnon"), "file_mb": mb("RssFile"), "shmem_mb": mb("RssShmem"),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(status["Threads"]), "children": len(children)}


def lmdb_readers(paths: list[Path]) -> int:
    """Reader slots in use in the LMDB environments at ``paths`` (of every process), read from
    their lock files without opening a transaction."""
    import lmdb

    total = 0
    for path in paths:
        if not (path / "lock.mdb").exists():
            continue
        env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=64, subdir=True)
        try:
            total += sum(1 for line in env.readers().splitlines()[1:] if line.strip())
        finally:
            env.close()
    return total


def metrics(url: str) -> dict:
    """How many series ``/metrics`` exposes, and the adapters' host cache (MB)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        lines = [line for line in r.read().decode().splitlines() if line and not line.startswith("#")]
    cache = next((float(line.split()[-1]) for line in lines if line.startswith("hmi_adapter_host_cache_bytes")), 0.0)
    return {"metric_series": len(lines), "host_cache_mb": round(cache / 2**20, 1)}


# -- the workload ----------------------------------------------------------------------------------
class Tally:
    """What the workload saw, by kind of work (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []
        self.job_seconds: dict[str, list[float]] = {}  # kind -> each finished job's run time, start to end

    def job(self, kind: str, job: dict) -> None:
        if job.get("started") and job.get("finished"):
            with self.lock:
                self.job_seconds.setdefault(kind, []).append(round(job["finished"] - job["started"], 1))

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def error(self, what: str) -> None:
        with self.lock:
            self.counts["errors"] = self.counts.get("errors", 0) + 1
            if len(self.errors) < 50:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {what}")


def guarded(tally: Tally, kind: str, fn) -> None:
    """Runs one unit of work; an HTTP 429 is counted as shed, anything else that fails as an error."""
    from hmi.client import ApiError

    try:
        fn()
        tally.add(kind)
    except ApiError as exc:
        if exc.status == 429:
            tally.add(f"{kind}_shed")
        else:
            tally.error(f"{kind}: {exc.status} {exc.code}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a dropped connection is a server error too
        tally.error(f"{kind}: {type(exc).__name__}: {exc}")


def workload(url: str, token: str, names: list[str], gpt: str, texts: list[str], corpus: list[str],
             adapter_zip: bytes, args, stop: threading.Event, tally: Tally) -> list[threading.Thread]:
    """The workload's threads, started (``gpt``: the decoder tenant the streams read)."""
    from hmi.client import ApiError, Client

    weights = [1.0 / k for k in range(1, len(names) + 1)]
    churned: dict[str, float] = {}  # tenant -> when its deletion and re-upload ended (inf while under way)

    def loop(every: float, body) -> None:
        while not stop.is_set():
            t = time.monotonic()
            body()
            stop.wait(max(0.0, every - (time.monotonic() - t)))

    def infer_client(seed: int) -> None:
        rng, client = random.Random(seed), Client(url, token)

        def one():
            tenant = rng.choices(names, weights)[0]
            try:
                out = client.infer(tenant, rng.sample(texts, rng.randint(1, 4)), truncate=True)
            except ApiError as exc:  # the churn took the tenant away meanwhile: its answer says so
                if exc.code in ("unknown_tenant", "tenant_not_ready") and time.monotonic() - churned.get(tenant, -9) < 5:
                    tally.add("infer_churned")
                    return
                raise
            if not all("label" in o for o in out):
                raise AssertionError(f"an answer without a label: {out}")

        while not stop.is_set():
            guarded(tally, "infer", one)

    def stream_client() -> None:
        client, n = Client(url, token), 0
        while not stop.is_set():
            n += 1
            drop = n % 3 == 0

            def one(drop=drop):
                pieces, done = 0, False
                for msg in client.generate_stream(gpt, {"prompt": random.choice(corpus)[:80], "max_new_tokens": 24}):
                    if msg.get("done"):
                        done = True
                    elif "error" in msg:
                        raise RuntimeError(f"in-band error: {msg}")
                    pieces += 1
                    if drop and pieces == 2:
                        tally.add("streams_dropped")
                        return  # the generator is closed: the connection goes mid-stream
                if not done:
                    raise RuntimeError("the stream ended without its final message")

            guarded(tally, "streams", one)

    def job_round() -> None:
        client, k = Client(url, token), tally.counts.get("jobs", 0) + tally.counts.get("errors", 0)
        name = f"soak-job-{k}-{os.getpid()}"

        def one():
            out = client.create_tenant(name, NEWS_LABELS, dataset="news-topic", max_train=40, max_eval=20, epochs=1,
                                       truncate=True)
            job = client.wait_job(out["job"], timeout=1800)
            if job["state"] != "succeeded":
                raise RuntimeError(f"job {job['id']} {job['state']}: {job.get('error')}")
            tally.job("fine-tune", job)
            client.infer(name, texts[:2])
            client.delete_tenant(name)

        guarded(tally, "jobs", one)

    def domain_round() -> None:
        client = Client(url, token)

        def one():
            rng = random.Random(tally.counts.get("domain_jobs", 0))
            exists = any(d["name"] == "soak-domain" for d in client.domains())
            # The first round creates the domain and updates it at once: every route the soak calls is
            # called within the warm-up (a route's first call adds its metric series).  A quick run,
            # which judges no growth, only creates it.
            steps = 4 if args.quick else 10
            calls = [] if exists else [lambda lines: client.create_domain("soak-domain", corpus=lines, steps=steps)]
            if exists or not args.quick:
                calls.append(lambda lines: client.update_domain("soak-domain", corpus=lines, steps=steps))
            for call in calls:
                job = client.wait_job(call(rng.sample(corpus, 600))["job"], timeout=1800)
                if job["state"] != "succeeded":
                    raise RuntimeError(f"domain job {job['id']} {job['state']}: {job.get('error')}")
                tally.job("domain", job)

        guarded(tally, "domain_jobs", one)

    def churn_round() -> None:
        client, rng = Client(url, token), random.Random()
        name = rng.choice(names[len(names) // 2:])  # from the less popular half: its requests keep going meanwhile

        def one():
            churned[name] = float("inf")
            try:
                client.delete_tenant(name)
                client.import_adapter(name, adapter_zip, truncate=True)
            finally:
                churned[name] = time.monotonic()

        guarded(tally, "churn", one)

    threads = [threading.Thread(target=infer_client, args=(i,), name=f"infer-{i}") for i in range(3)]
    threads += [threading.Thread(target=stream_client, name="stream"),
                threading.Thread(target=loop, args=(args.job_every, job_round), name="jobs"),
                threading.Thread(target=loop, args=(args.domain_every, domain_round), name="domains"),
                threading.Thread(target=loop, args=(20.0, churn_round), name="churn")]
    for t in threads:
        t.start()
    return threads


def own_decoder_tenant(client, corpus: list[str]) -> str:
    """``soak-gpt``, a decoder tenant trained here (four short lines of ``corpus``, one epoch), ready:
    a stream needs a trained adapter, not a good one."""
    out = client.create_decoder_tenant("soak-gpt", training_text=[t for t in corpus if len(t) <= 300][:4], epochs=1)
    job = client.wait_job(out["job"], timeout=900)
    if job["state"] != "succeeded":
        raise SystemExit(f"the soak's decoder tenant did not train: {job.get('error')}")
    return "soak-gpt"


def warm(client, names: list[str], texts: list[str]) -> None:
    """One request for every tenant before the clock starts: the adapters' host cache (bounded by
    ``host_cache_mb``) is full from the first sample on, so what grows afterwards is not it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda name: client.infer(name, texts[:1], truncate=True), names))


# -- verdict and report ----------------------------------------------------------------------------
def verdict(samples: list[dict], warmup_s: float) -> dict:
    """Growth of each sampled quantity: the median of the last quarter of the samples after
    warm-up over (or minus) the median of their first quarter."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 4:
        return {"ok": False, "why": f"only {len(after)} samples after warm-up: run longer"}
    q = max(1, len(after) // 4)
    first, last = after[:q], after[-q:]
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {"samples_after_warmup": len(after), "rss_growth": round(med(last, "rss_mb") / med(first, "rss_mb") - 1, 4)}
    bounds = {"fds": FD_SLACK, "threads": 0, "children": 0, "lmdb_readers": 0, "metric_series": 0}
    for k in bounds:
        out[f"{k}_growth"] = med(last, k) - med(first, k)
    failed = [f"rss grew {out['rss_growth']:.1%}"] if out["rss_growth"] > RSS_GROWTH else []
    failed += [f"{k} grew by {out[f'{k}_growth']}" for k, b in bounds.items() if out[f"{k}_growth"] > b]
    out["ok"], out["failed"] = not failed, failed
    return out


def plot(samples: list[dict], warmup_s: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("rss_mb", "RSS (MB)"), ("fds", "open file descriptors"), ("threads", "threads"),
            ("metric_series", "/metrics series"), ("lmdb_readers", "LMDB reader slots"), ("children", "child processes")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6), sharex=True)
    t = [s["t"] / 60 for s in samples]
    for ax, (k, label) in zip(axes.flat, keys):
        ax.plot(t, [s[k] for s in samples], marker=".", label="RSS" if k == "rss_mb" else None)
        if k == "rss_mb":  # its parts: the private heap, mapped files (the PLOTs' pages), the adapters' host cache
            for part, name in (("anon_mb", "private (anon)"), ("file_mb", "mapped files"),
                               ("host_cache_mb", "adapter host cache")):
                ax.plot(t, [s.get(part, 0) for s in samples], label=name)
            ax.legend(fontsize=7)
        ax.axvline(warmup_s / 60, color="grey", linestyle=":")
        ax.set_title(label)
        ax.set_xlabel("minutes")
        ax.set_ylim(bottom=0)
    fig.suptitle("hmi serve --hgpt under the soak's mixed workload (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """SIGTERM, then how long the server took to exit, with which code, and whether its children went too."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        return {"exit_code": code, "stop_s": None, "children_left": len(children)}
    time.sleep(2)
    left = [c for c in children if Path(f"/proc/{c}").exists() and "zombie" not in Path(f"/proc/{c}/status").read_text()]
    return {"exit_code": code, "stop_s": round(time.monotonic() - t, 1), "children_left": len(left)}


def main() -> None:
    args = start(__doc__, options)
    quick = args.quick
    args.tenants = args.tenants or (100 if quick else 1000)
    args.sample = args.sample or (10.0 if quick else 30.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if quick else 10.0)
    args.job_every = args.job_every or (45.0 if quick else 300.0)
    args.domain_every = args.domain_every or (60.0 if quick else 1200.0)
    from hmi.bootstrap import prepare_decoder, prepare_default
    from hmi.client import Client
    from hmi.data import held_out_texts, load_corpus
    from hmi.home import hmi_home

    prepare_default(hmi_home(), plot=False)  # the default root (its shipped artifact); bench_home: its root PLOT
    prepare_decoder(hmi_home())  # the decoder's calibrated windows (the shipped ones); its PLOT the server builds
    home, token, root, names = bench_home("hmi-soak-", args.tenants)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(home / "server.log", "w")
    env = {**os.environ, "HMI_HOME": str(home), "HMI_ADMIN_TOKEN": token, "HF_HUB_OFFLINE": "1"}
    demo = ["--no-demo"] if args.no_demo else []
    proc = subprocess.Popen([str(Path(sys.executable).parent / "hmi"), "serve", "--hgpt", "--port", str(port), *demo],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tally, samples, stop = Tally(), [], threading.Event()
    began, timeline = time.monotonic(), {}  # seconds since the server's start at which each phase ended

    def phase(name: str) -> None:
        timeline[name] = round(time.monotonic() - began, 1)

    try:
        client = Client(url, token, timeout=30)
        deadline = time.monotonic() + 900
        ready = {names[0]} if args.no_demo else {"demo-news", "demo-legal-gpt"}
        while True:
            try:
                if ready <= {t["name"] for t in client.tenants() if t["state"] == "ready"}:
                    break
            except (ConnectionError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up: {(home / 'server.log').read_text()[-3000:]}")
            time.sleep(1)
        phase("server_ready")
        corpus = load_corpus("legal", 2000)
        gpt = own_decoder_tenant(client, corpus) if args.no_demo else "demo-legal-gpt"
        buf = io.BytesIO(client.export_adapter(names[0] if args.no_demo else "demo-news"))
        zipfile.ZipFile(buf).testzip()
        texts = [t for t in held_out_texts(400) if len(t) <= 4000][:200]
        plots = sorted((home / "plots").glob("*/root"))
        warm(client, names, texts)
        phase("prepared")  # the decoder tenant, the adapter to churn, every tenant's adapter warm
        readers_of = [home / "registry", *plots]
        served = names + ([] if args.no_demo else ["demo-news", "demo-reviews"])
        threads = workload(url, token, served, gpt, texts, corpus, buf.getvalue(), args, stop, tally)
        t0, end = time.monotonic(), time.monotonic() + args.minutes * 60
        print(f"soak: {args.minutes:g} minutes against {url} (server pid {proc.pid}, home {home})", flush=True)
        while True:
            now = time.monotonic()
            s = {"t": round(now - t0, 1), **proc_status(proc.pid), "lmdb_readers": lmdb_readers(readers_of),
                 **metrics(url), **{k: v for k, v in tally.counts.items()}}
            samples.append(s)
            print(json.dumps(s), flush=True)
            if now >= end or proc.poll() is not None:
                break
            time.sleep(min(args.sample, max(0.0, end - time.monotonic())))
        phase("workload")
        stop.set()
        for t in threads:
            t.join(1900)
        phase("jobs_drained")  # the jobs in flight when the workload stopped, finished
        stopped = stop_server(proc)
        phase("stopped")
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    v = verdict(samples, args.warmup * 60)
    counts = dict(tally.counts)
    # A quick run checks the workload end to end (errors, jobs, a clean stop); minutes say nothing of growth.
    failed = [] if quick else list(v.get("failed", [v.get("why")] if not v["ok"] else []))
    if counts.get("errors"):
        failed.append(f"{counts['errors']} errors: {tally.errors[:5]}")
    if stopped["exit_code"] != 0 or stopped["children_left"]:
        failed.append(f"the server did not stop cleanly: {stopped}")
    for kind in ("infer", "streams", "jobs", "domain_jobs", "churn"):
        if not counts.get(kind):
            failed.append(f"no {kind} completed: run longer")
    ok = not failed
    name = "soak_quick" if quick else "soak"
    plot(samples, args.warmup * 60, DOCS / f"{name}.png")
    first = next((s for s in samples if s["t"] >= args.warmup * 60), samples[0])
    rows = [(f"{s['t'] / 60:.1f}", s["rss_mb"], s["anon_mb"], s["file_mb"], s.get("host_cache_mb", "-"), s["fds"],
             s["threads"], s["children"], s["lmdb_readers"], s["metric_series"], s.get("infer", 0), s.get("streams", 0),
             s.get("jobs", 0))
            for s in samples[:: max(1, len(samples) // 24)] + [samples[-1]]]
    text = (f"{args.minutes:g} minutes, {args.tenants} tenants (+ {'a decoder tenant' if args.no_demo else 'the demo tenants'}), "
            f"a sample every {args.sample:g} s, "
            f"warm-up {args.warmup:g} minutes; RSS at the end of warm-up {first['rss_mb']} MB.\n\n"
            f"Verdict: **{'passed' if ok else 'failed'}**" + ("" if ok else f": {'; '.join(failed)}") + "\n\n"
            f"Work done: {json.dumps(counts)}; server stop on SIGTERM: {json.dumps(stopped)}\n\n"
            f"Seconds from the server's start at which each phase ended: {json.dumps(timeline)}; each job's run "
            f"time in s: {json.dumps(tally.job_seconds)}\n\n"
            + table(rows, ("minute", "RSS MB", "anon MB", "file MB", "host cache MB", "fds", "threads", "children",
                           "LMDB readers", "metric series", "infer", "streams", "jobs"))
            + f"\n\n![soak]({name}.png)")
    result = {**v, "ok": ok, "failed": failed, "minutes": args.minutes, "tenants": args.tenants, "counts": counts,
              "stop": stopped, "timeline_s": timeline, "job_seconds": tally.job_seconds, "errors": tally.errors}
    finish(name, text, result, "python benchmarks/soak.py " + " ".join(sys.argv[1:]))
    if ok:
        shutil.rmtree(home, ignore_errors=True)
    else:
        print(f"the server's home and log are kept for a look: {home}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
