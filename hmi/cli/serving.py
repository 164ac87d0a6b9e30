"""``hmi serve``: the HTTP server, in one process or on Ray Serve."""

from __future__ import annotations

import argparse
import sys

from hmi.bootstrap import quiet_transformers
from hmi.cli.common import add_root_options
from hmi.dispatcher.gate import GateError
from hmi.dispatcher.serve import serve
from hmi.model.decoder import DecoderNotFoundError, packaged_decoder_file
from hmi.plot.kept import DEFAULT_BUDGET_MB
from hmi.scaleout.ray_serve import serve as serve_ray
from hmi.scheduler.pipeline import check_precision, pick_device
from hmi.services.server import ServerConfig, ServerConfigError
from hmi.training.serving import AUTO_RULE, SERVING_MODES


def cmd_serve(args) -> int:
    quiet_transformers()

    try:
        check_precision(args.upper_precision, pick_device(args.device))
        if not 8 <= args.max_len <= 512:  # the position limit of both packaged roots; the server checks its own
            raise ValueError(f"--max-len {args.max_len} is outside [8, 512]")
    except ValueError as exc:
        print(f"hmi serve: {exc}", file=sys.stderr)
        return 2
    if args.hgpt:
        try:
            packaged_decoder_file()
        except DecoderNotFoundError as exc:
            print(f"hmi serve --hgpt: {exc} (make setup installs it; make setup-serve leaves it out)", file=sys.stderr)
            return 2
    if not args.plot_keep_mb > 0:
        print(f"hmi serve: --plot-keep-mb must be above 0, got {args.plot_keep_mb}", file=sys.stderr)
        return 2
    if not args.plot_hot_mb >= 0:
        print(f"hmi serve: --plot-hot-mb must be 0 or more, got {args.plot_hot_mb}", file=sys.stderr)
        return 2
    if args.jobs < 1 or not args.job_memory_mb >= 0:
        print(f"hmi serve: --jobs must be at least 1 and --job-memory-mb 0 or more, got {args.jobs} and "
              f"{args.job_memory_mb}", file=sys.stderr)
        return 2
    cfg = ServerConfig(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, pool_slots=args.pool_slots,
                       miss_policy=args.miss_policy, plot_keep_mb=args.plot_keep_mb, device=args.device,
                       max_len=args.max_len,
                       plot_hot_mb=args.plot_hot_mb, upper_precision=args.upper_precision,
                       job_concurrency=args.jobs, job_memory_mb=args.job_memory_mb, distil=args.distil,
                       serving=args.serving)
    try:
        if args.ray:
            if args.hgpt:
                print("hmi serve: --hgpt is not served through --ray yet", file=sys.stderr)
                return 2
            if args.replicas < 1:
                print(f"hmi serve: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
                return 2
            if not args.registry_cache_s >= 0:
                print(f"hmi serve: --registry-cache-s must be 0 or more, got {args.registry_cache_s}", file=sys.stderr)
                return 2
            if not args.job_cpus > 0:
                print(f"hmi serve: --job-cpus must be above 0, got {args.job_cpus}", file=sys.stderr)
                return 2

            return serve_ray(args.host, args.port, not args.no_demo, cfg, args.replicas, args.tenants_per_replica,
                             root=args.root, l_low=args.l_low, ingress=args.ingress, job_cpus=args.job_cpus,
                             registry=args.registry, registry_cache_s=args.registry_cache_s, gate=args.gate)
        return serve(args.host, args.port, not args.no_demo, cfg, hgpt=args.hgpt, root=args.root, l_low=args.l_low,
                     gate=args.gate)
    except (ServerConfigError, GateError) as exc:
        print(f"hmi serve: {exc}", file=sys.stderr)
        return 2


def arguments(command: str, srv) -> None:
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--no-demo", action="store_true", help="do not create the demo tenants")
    add_root_options(srv)
    srv.add_argument("--max-batch", type=int, default=32)
    srv.add_argument("--max-wait-ms", type=float, default=5.0)
    srv.add_argument("--pool-slots", type=int, default=64)
    srv.add_argument("--max-len", type=int, default=128,
                     help="tokens of a text the encoder tenants read (up to the root's position limit, 512 for both "
                          "roots); longer texts are refused or, for tenants that truncate, cut (docs/results/bench_limits.md "
                          "measures the cost)")
    srv.add_argument("--miss-policy", default="auto",
                     choices=["auto", "backoff", "compute", "compute+insert", "learned", "learned+compute"],
                     help="auto (the default: where the root PLOT has a learned back-off, as the default root has, "
                          "shipped with hmi, the root's choice on its front: learned on the default root, learned+compute on "
                          "mpnet-base; else backoff: "
                          "docs/front.md), backoff (fast, the paper's), compute "
                          "(exact windowed layers on misses), compute+insert "
                          "(computed once, then kept in the domain's PLOT, bounded by --plot-keep-mb: the next text "
                          "holding the window hits; a tenant's training texts are kept by its fine-tune) or learned "
                          "(the back-off turned into an estimate of the missed window by a small model trained on the "
                          "root PLOT: `hmi plot learn-backoff`) or learned+compute (learned, with the misses whose "
                          "back-off would reach the uni-gram computed exactly)")
    srv.add_argument("--plot-keep-mb", type=float, default=DEFAULT_BUDGET_MB,
                     help="compute+insert: MB of kept windows each PLOT may hold; past it the least used go "
                          f"(default {DEFAULT_BUDGET_MB:g})")
    srv.add_argument("--distil", action=argparse.BooleanOptionalAction, default=ServerConfig.distil,
                     help="encoder fine-tunes train a full-context teacher first and the served adapter on its answers "
                          "too, unless a request says otherwise (\"distil\"): more accurate as served, several times "
                          f"the fine-tune's time (default {'on' if ServerConfig.distil else 'off'}; docs/front.md)")
    srv.add_argument("--serving", choices=SERVING_MODES, default=ServerConfig.serving,
                     help="how fine-tuned encoder tenants are served unless a request says (\"serving\"): windows (the "
                          "PLOT and the adapter in the upper layers), whole (the distilled fine-tune's teacher: the full "
                          f"root with the adapter in every layer), auto ({AUTO_RULE}) (default {ServerConfig.serving}; "
                          "docs/front.md)")
    srv.add_argument("--hgpt", action="store_true",
                     help="also serve decoder tenants (SmolLM2-135M; builds its causal PLOT on first start)")
    srv.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="where the upper layers, adapter pools and KV cache run (auto: cuda when torch sees a GPU)")
    srv.add_argument("--plot-hot-mb", type=float, default=0.0,
                     help="MB of the root PLOT's most read entries held as tensors on the serving device, in front of "
                          "LMDB (built in the background after start; 0, the default: LMDB alone, which on a CPU with "
                          "a warm page cache is as fast: docs/results/bench_plot.md)")
    srv.add_argument("--upper-precision", default="fp32", choices=["fp32", "bf16"],
                     help="the shared upper layers' linear products: fp32 (the default), or bf16 with fp32 "
                          "accumulation on a CPU that multiplies bf16 natively (avx512_bf16 or amx_bf16; refused "
                          "elsewhere): about 1.4x the rows/s, scores within about 5e-3 of fp32 "
                          "(docs/results/bench_precision.md)")
    srv.add_argument("--gate", action="store_true",
                     help="put HAProxy in front of the server: a tenant the server keeps refusing over its share "
                          "is then held to its fair rate (its share of the answered requests per second) by HAProxy, "
                          "which refuses the rest before it reaches Python, so the flood's refusals cost the server "
                          "nothing and what is admitted comes evenly (needs the haproxy of the ray extra or on the "
                          "PATH; docs/results/bench_overload.md); with --ray in front of Ray Serve's ingress, marked by the "
                          "replicas on its host")
    _ray_args(srv)
    srv.set_defaults(func=cmd_serve)


def _ray_args(srv) -> None:
    srv.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: replicas of this server sharing HMI_HOME, requests routed to the "
                          "replica that holds their tenant (needs the ray extra: pip install -e '.[ray]'; RAY_ADDRESS "
                          "names a running cluster, else a local one is started)")
    srv.add_argument("--replicas", type=int, default=2, help="with --ray: serving replicas (default 2)")
    srv.add_argument("--tenants-per-replica", type=int, default=1000,
                     help="with --ray: tenants a replica holds before Ray Serve's LRU lets one go (default 1000)")
    srv.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                     help="with --ray, for the local cluster it starts: Ray Serve's HAProxy ingress, straight to the "
                          "replicas with a tenant kept on one replica by a hash of its routing header (default), or "
                          "its Python HTTP proxy, routing by the replicas' multiplexed LRUs")
    srv.add_argument("--jobs", type=int, default=1,
                     help="fine-tune and domain jobs run at once, each in its own worker process (default 1)")
    srv.add_argument("--job-memory-mb", type=float, default=0.0,
                     help="memory the running jobs may take together: a job starts when its expected peak (the "
                          "largest of the last jobs of its kind here; 1.5 GB for an encoder fine-tune, 4.5 GB for a "
                          "decoder's, 9 GB for a domain before one ran) fits beside the running ones', and waits with "
                          "the reason in GET /v1/jobs/{id} until then (default 0: no bound)")
    srv.add_argument("--job-cpus", type=float, default=1.0,
                     help="with --ray: CPUs a fine-tune or domain job's Ray task reserves; jobs run on whichever node "
                          "has them free (default 1)")
    srv.add_argument("--registry", choices=["home", "actor"], default="home",
                     help="with --ray: the registry the replicas share: HMI_HOME's own LMDB (replicas on one machine; "
                          "default) or a Ray actor owning it on this node (replicas on several machines, HMI_HOME on a "
                          "shared file system)")
    srv.add_argument("--registry-cache-s", type=float, default=0.0,
                     help="with --registry actor: seconds a replica keeps a tenant's record (a change made through "
                          "another replica is then seen within this; 0, the default: at once, one actor call per request)")
