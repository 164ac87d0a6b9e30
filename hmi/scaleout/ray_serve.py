"""HMI on Ray Serve (``hmi serve --ray``): replicas that each run the whole single-process server
behind an ingress that routes a tenant's requests to a replica that already holds it.

- **One implementation.** A replica builds the same ``Server`` and aiohttp application as
  ``hmi serve`` (routes, auth, errors, batcher, scheduler, jobs) and serves it on a loopback
  port; it forwards each request it is handed there unchanged.  Ray Serve only routes.
- **Affinity.** A request names its tenant as its multiplexed model id in the
  ``serve_multiplexed_model_id`` header (``hmi.client.Client`` sends it on every tenant route).
  Two ingresses (``INGRESSES``): ``haproxy`` (the default), Ray Serve's HAProxy ingress, which
  sends a request straight to a replica's own HTTP port and picks the replica by a hash of that
  header (``balance hdr(...)``), so a tenant stays on one replica while the replicas stay the same;
  ``proxy``, Ray Serve's Python HTTP proxy, which routes by the replicas' multiplexed LRUs
  (``@serve.multiplexed``); behind HAProxy a replica keeps its own LRU of the tenants it holds
  (``ReplicaCore.hold``: HAProxy does not route by what replicas hold, and Ray Serve's multiplexed
  LRU costs a replica upkeep per tenant held).  Either way loading a tenant warms its adapter into
  the replica's host cache.  A request without the header is answered by any replica, as correctly; a gateway in front
  can add the header from the path (``/v1/tenants/{tenant}/...``).  The replicas are the ingress:
  no hop is added between Ray Serve's ingress and the server.
  ``@serve.batch`` is not used: it splits batches by model id, and cross-tenant batching is what
  each replica's own batcher does, so ``max_ongoing_requests`` is high enough for it to mix tenants.
- **Shared state.** Replicas share one ``HMI_HOME``: the registry (one LMDB environment, whose
  write lock makes every change one transaction from any process on its host; with
  ``registry="actor"`` a Ray actor owning it, ``hmi.scaleout.ray_registry``, which replicas on any
  node reach), the adapter store (immutable published versions) and the PLOTs (read-only).  Each replica's server runs with
  ``ServerConfig.shared_home``: a tenant is brought up to its registry record whenever it is used,
  so one created, retrained or deleted through another replica is served, re-read or dropped.
- **Jobs.** A replica's fine-tune and domain jobs run as Ray tasks reserving their own CPUs
  (``hmi.scaleout.ray_jobs``), placed by Ray where the cluster has them free.

- **The gate** (``gate=True``, ``hmi serve --ray --gate``): HAProxy in front of Ray Serve's
  ingress (``hmi.dispatcher.gate``), which the replicas on its host mark as the single-process
  server does (its admin socket in their environment, ``GATE_SOCKET_ENV``): a tenant they keep
  refusing over its share is then held to its fair rate at the gate, and the rest of its flood
  never reaches Ray Serve's ingress or a replica's Python front.

Every answer says which replica served it (``X-HMI-Replica``) and whether that replica already
held the tenant (``X-HMI-Affinity: hit|miss``), which ``benchmarks/bench_scale.py`` counts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from hmi.bootstrap import prepare_in_child
from hmi.client import ROUTING_HEADER, Client, tenant_of
from hmi.dispatcher.gate import GATE_SOCKET_ENV, Gate, GateMarks, free_port
from hmi.dispatcher.launch import banner, create_demo_tenants, over_http, startup_report
from hmi.dispatcher.serve import build_server, start_app
from hmi.home import hmi_home
from hmi.model.aliases import DEFAULT_ROOT
from hmi.model.artifact import load_root
from hmi.model.catalog import root_spec
from hmi.scaleout.ray_jobs import RayLauncher
from hmi.scaleout.ray_registry import RemoteRegistry, start_registry_actor, stop_registry_actor
from hmi.services.auth import admin_token
from hmi.services.server import Server, ServerConfig

INGRESSES = ("haproxy", "proxy")
# HAProxy's layer-7 retries (ingress_env): what it sends again to another replica, and how often.
HAPROXY_RETRY_ON = "conn-failure empty-response junk-response 502 503 504"
HAPROXY_RETRIES = 3
DRAIN_S = 3  # seconds a stopping replica stays reachable behind the local cluster's HAProxy (ingress_env)
# Where the replicas keep the registry: the home's LMDB (replicas on one host) or a Ray actor
# owning it (replicas on any node of the cluster, the home on a shared file system).
REGISTRIES = ("home", "actor")


def ingress_env(ingress: str) -> dict[str, str]:
    """The environment a Ray cluster's Serve controller and replicas need for ``ingress`` (read
    when the cluster starts: ``ray start`` for a cluster of its own, ``start`` for a local one).
    The HAProxy ingress comes with Ray Serve's high-throughput mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``,
    Ray's documented pairing): among others a replica then runs its requests on the event loop
    that receives them instead of handing each to a second thread's loop, which is what HMI's
    replica wants (its own application runs on that loop; the computing is in the scheduler's
    threads).  ``benchmarks/bench_scale.py`` measured it at +7% requests/s for one replica.

    A request that a replica cannot answer because it died (the connection refused or closed
    without an answer, or a gateway error) is sent again to another replica by HAProxy
    (``HAPROXY_RETRY_ON``, up to ``HAPROXY_RETRIES`` times; a request whose answer had begun, a
    stream's, is not).  Inference is idempotent; the requests that create or change state answer
    a replay with what they find (``409 tenant_exists``, ``tenant_busy``), never doing it twice.

    A replica that stops stays reachable for ``DRAIN_S`` (Ray's default: 30 s, for a load balancer
    in front that must deregister it) before it refuses new connections and finishes those in
    flight.  In front of a local cluster there is only Ray's HAProxy, which retries a refused
    connection on another replica, so its replicas wait a few seconds, not 30: stopping
    ``hmi serve --ray`` (``serve.shutdown``) took 32 s for two idle replicas."""
    if ingress not in INGRESSES:
        raise ValueError(f"unknown ingress {ingress!r}; use one of {', '.join(INGRESSES)}")
    if ingress == "proxy":  # every variable named, so that a later local cluster does not inherit an earlier one's
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": f"hdr({ROUTING_HEADER})",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_HAPROXY_RETRY_ON": HAPROXY_RETRY_ON,
            "RAY_SERVE_HAPROXY_RETRIES": str(HAPROXY_RETRIES), "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAIN_S)}


# Hop-by-hop and framing headers: the proxy on each side sets its own.
DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
                   "proxy-connection", "te", "trailer"}


@dataclass
class Forwarded:
    """An HTTP request or response as it crosses between the ingress and a replica."""

    status: int  # 0 for a request
    method: str
    target: str  # path and query string
    headers: list[tuple[str, str]]
    body: bytes


def kept_headers(headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in DROPPED_HEADERS]


@dataclass
class ReplicaServer:
    """Builds a replica's server: the root named by ``root``/``l_low`` (prepared beforehand by
    the driver) and its root PLOT from the shared home, with ``shared_home`` on; its jobs run as
    Ray tasks reserving ``job_cpus`` CPUs each (``hmi.scaleout.ray_jobs``); its registry is the
    home's or the registry actor (``registry``, one of ``REGISTRIES``; a tenant's record read from
    the actor is kept ``registry_cache_s`` seconds, see ``RemoteRegistry``)."""

    cfg: ServerConfig
    home: str
    root: str | None = None
    l_low: int | None = None
    job_cpus: float = 1.0
    registry: str = "home"
    registry_cache_s: float = 0.0

    def __post_init__(self):
        if self.registry not in REGISTRIES:
            raise ValueError(f"unknown registry {self.registry!r}; use one of {', '.join(REGISTRIES)}")
        if not self.registry_cache_s >= 0:
            raise ValueError(f"registry_cache_s must be 0 or more, got {self.registry_cache_s}")

    def __call__(self) -> Server:
        home = Path(self.home)
        spec = root_spec(self.root, self.l_low, home) if self.root else None
        return build_server(replace(self.cfg, shared_home=True), home, load_root(home=home, spec=spec),
                            job_launcher=RayLauncher(self.job_cpus),
                            registry=RemoteRegistry(cache_s=self.registry_cache_s) if self.registry == "actor" else None)


class HeldTenant:
    """A tenant in a replica's multiplexed LRU; Ray Serve drops it to evict the tenant."""

    def __init__(self, core: "ReplicaCore", tenant: str):
        self.core, self.tenant = core, tenant

    def __del__(self):
        self.core.held.discard(self.tenant)


def routes_by_header() -> bool:
    """Whether this process's Ray Serve ingress is HAProxy (``RAY_SERVE_ENABLE_HA_PROXY``), which
    picks a replica by a hash of the routing header, not by the tenants the replicas hold."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0").strip().lower() in ("1", "true")


class ReplicaCore:
    """What a replica does, apart from Ray: owns a ``Server`` built by ``factory``, serves its
    application on a loopback port and forwards requests to it; holds up to ``tenants`` tenants."""

    def __init__(self, factory: Callable[[], Server], threads: int | None = None, tenants: int = 1000):
        import torch

        # Ray gives a worker that reserves no CPUs one OpenMP thread; the replica's share of the
        # node's cores is set here instead.
        if threads:
            torch.set_num_threads(threads)
        self.replica_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.server = factory()
        gate = os.environ.get(GATE_SOCKET_ENV)
        if gate and Path(gate).exists():  # a gate runs on this host in front of the ingress
            self.server.gate = GateMarks(Path(gate))
        # The application is served on the event loop that runs the replica's requests (started by
        # the first one): the hop into it stays on one loop, one thread.
        self.url: str | None = None
        self._runner = None
        self._loop = None
        self._starting = asyncio.Lock()
        self._session = None
        self.tenants = tenants
        self.loads: dict[str, int] = {}  # tenant -> times it was loaded here
        self.held: set[str] = set()  # tenants in the multiplexed LRU now (Python proxy ingress)
        self._lru: OrderedDict[str, None] = OrderedDict()  # tenants held, least recently used first (HAProxy)
        self._loading: dict[str, asyncio.Future] = {}  # tenant -> its load in progress (HAProxy)

    async def load_tenant(self, tenant: str) -> "HeldTenant":
        """Brings a tenant into this replica (its registry record, its adapter into the host
        cache) for the multiplexed LRU; a tenant that cannot be loaded is left for the routes to
        answer (404, 409)."""
        self.loads[tenant] = self.loads.get(tenant, 0) + 1

        def warm() -> None:
            try:
                self.server.store.load(tenant)
            except Exception:  # noqa: BLE001 - the request itself gets the route's answer
                pass

        try:
            await self.server.tenants.resolve(tenant)
        except Exception:  # noqa: BLE001 - the request itself gets the route's answer
            pass
        await asyncio.get_running_loop().run_in_executor(None, warm)
        self.held.add(tenant)
        return HeldTenant(self, tenant)

    async def hold(self, tenant: str) -> None:
        """Holds ``tenant`` in this replica's own LRU of ``tenants``, for the HAProxy ingress: a
        tenant not held is loaded (once, however many of its requests wait for it), the least
        recently used beyond ``tenants`` is let go.  Ray Serve's multiplexed LRU is what the Python
        proxy routes by; HAProxy routes by the header's hash, and the multiplexed LRU would cost a
        replica its upkeep (every 0.1 s a gauge set per tenant held) for nothing."""
        if tenant in self._lru:
            self._lru.move_to_end(tenant)
            return
        loading = self._loading.get(tenant)
        if loading is None:
            loading = self._loading[tenant] = asyncio.ensure_future(self._load(tenant))
        await asyncio.shield(loading)  # a request that goes away does not stop the load the others wait for

    async def _load(self, tenant: str) -> None:
        try:
            await self.load_tenant(tenant)
            self._lru[tenant] = None
            while len(self._lru) > self.tenants:
                self._lru.popitem(last=False)
        finally:
            del self._loading[tenant]

    async def forward(self, req: Forwarded, tenant: str, held: Callable) -> Forwarded:
        """Answers ``req`` through this replica's application; ``held(tenant)`` is the multiplexed
        loader (awaited first, so that a hit or a miss is known)."""
        import aiohttp

        affinity = ""
        if tenant:
            before = self.loads.get(tenant, 0)
            await held(tenant)
            affinity = "hit" if self.loads.get(tenant, 0) == before else "miss"
        if self.url is None:
            await self._serve_here()
        if self._session is None:
            # No connection limit: every request Ray hands the replica reaches the server's own
            # admission (fair shares, 429 at once), never a first-come queue in front of it.
            self._session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None),
                                                  connector=aiohttp.TCPConnector(limit=0))
        async with self._session.request(req.method, self.url + req.target, headers=kept_headers(req.headers),
                                         data=req.body, allow_redirects=False) as r:
            body = await r.read()
            headers = kept_headers(r.headers.items()) + [("X-HMI-Replica", self.replica_id)]
            if affinity:
                headers.append(("X-HMI-Affinity", affinity))
            return Forwarded(r.status, "", "", headers, body)

    async def _serve_here(self) -> None:
        """Starts this replica's application on a loopback port of the running event loop."""
        async with self._starting:
            if self.url is None:
                self._runner, url = await start_app(self.server, access_log=None)
                self._loop, self.url = asyncio.get_running_loop(), url

    def close(self) -> None:
        """Stops the application (and with it the server's scheduler and jobs)."""
        if self.server.gate is not None:
            self.server.gate.close()
        if self._runner is None or not self._loop.is_running():
            self.server.shutdown()
            return
        done = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is not self._loop:  # waiting on the loop's own thread would block the cleanup
            done.result(120)


# Requests a replica takes at once: above what its server admits (ServerConfig.max_pending waiting
# plus the batches in flight, and other routes), so that its fair queue decides who waits and who
# is refused (429 at once), not a first-come queue in front of it (bench_overload.py --ray).
MAX_ONGOING_REQUESTS = 1024


def build_app(factory: Callable[[], Server], replicas: int = 2, tenants_per_replica: int = 1000,
              max_ongoing_requests: int = MAX_ONGOING_REQUESTS, threads: int | None = None):
    """The Ray Serve application: an ingress and ``replicas`` HMI replicas (each holding up to
    ``tenants_per_replica`` tenants in its multiplexed LRU, taking up to ``max_ongoing_requests``
    at once, computing with ``threads`` threads; default: this machine's cores shared among the
    replicas)."""
    threads = threads or max(1, (os.cpu_count() or 1) // replicas)
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
                      ray_actor_options={"num_cpus": 0}, health_check_period_s=5,
                      logging_config={"enable_access_log": False})  # the server logs every request itself
    class HmiReplica:
        """A replica, the deployment's ingress: Ray Serve's ingress hands it a request, on the
        replica holding its tenant when the request names the tenant in the
        ``serve_multiplexed_model_id`` header (``hmi.client`` always does), on any replica otherwise."""

        def __init__(self):
            self.core = ReplicaCore(factory, threads, tenants_per_replica)
            self.hold = self.core.hold if routes_by_header() else self.multiplexed

        @serve.multiplexed(max_num_models_per_replica=tenants_per_replica)
        async def multiplexed(self, tenant: str) -> HeldTenant:
            return await self.core.load_tenant(tenant)

        async def __call__(self, request: Request) -> Response:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            req = Forwarded(0, request.method, target, kept_headers(request.headers.items()), await request.body())
            routed = serve.get_multiplexed_model_id() or request.headers.get(ROUTING_HEADER, "")
            tenant = tenant_of(request.url.path)
            # A tenant is held (and its affinity counted) only when the ingress routed by it: the
            # header names the tenant the path names.
            out = await self.core.forward(req, tenant if routed and routed == tenant else "", self.hold)
            return Response(out.body, status_code=out.status, headers=dict(out.headers))

        def check_health(self) -> None:
            if self.core.server.scheduler.closed:
                raise RuntimeError("the scheduler has stopped")

        def __del__(self):
            core = getattr(self, "core", None)
            if core is not None:
                core.close()

    return HmiReplica.bind()


def start(factory: Callable[[], Server], host: str = "127.0.0.1", port: int = 8000, replicas: int = 2,
          tenants_per_replica: int = 1000, env: dict[str, str] | None = None, address: str | None = None,
          ingress: str = "haproxy"):
    """Connects to a Ray cluster (``address``, ``RAY_ADDRESS``, or a local one started here with
    ``ingress``; a cluster of its own runs the ingress its ``ray start`` environment chose, see
    ``ingress_env``), starts Ray Serve's HTTP ingress on ``host:port`` and deploys the HMI
    application; returns the base URL once every replica is up.  ``env``: environment variables of
    the replicas.  A ``factory`` whose registry is ``actor`` gets the registry actor started on this
    node first."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        # A local cluster's processes inherit this environment.  Ray runs its workers at niceness 15:
        # here they are the server, not background work.  On a small, busy machine Ray Serve's HTTP
        # proxy takes longer than its default 5 s readiness check to start (it is then killed and
        # restarted, over and over).
        for key, value in (("RAY_worker_niceness", "0"), ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60"),
                           ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")):
            os.environ.setdefault(key, value)
        address = address or os.environ.get("RAY_ADDRESS")
        if address is None:  # a local cluster: its workers inherit this environment (a runtime_env makes Ray set up each worker's)
            os.environ.update({**(env or {}), **ingress_env(ingress)})
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env} if address is not None and env else None)
    if getattr(factory, "registry", "home") == "actor":
        start_registry_actor(factory.home)
    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
    serve.run(build_app(factory, replicas, tenants_per_replica), name="hmi", route_prefix="/")
    return f"http://{host}:{port}"


def start_behind_gate(factory: Callable[[], Server], host: str = "127.0.0.1", port: int = 8000, replicas: int = 2,
                      tenants_per_replica: int = 1000, env: dict[str, str] | None = None, address: str | None = None,
                      ingress: str = "haproxy") -> tuple[Gate, str]:
    """The gate (HAProxy, ``hmi.dispatcher.gate``) on ``host:port`` and behind it, on a loopback
    port, Ray Serve's ingress and the replicas as ``start`` brings them up, the replicas told the
    gate's admin socket so that they mark the tenants they keep refusing over their share.
    Returns (the gate, the ingress's own URL).  Call it from the main thread (the gate's HAProxy
    dies with the thread that starts it); ``gate.close()`` after ``stop()``."""
    inner = free_port()
    gate = Gate.start(host, port, f"127.0.0.1:{inner}")
    try:
        url = start(factory, "127.0.0.1", inner, replicas, tenants_per_replica,
                    env={**(env or {}), GATE_SOCKET_ENV: str(gate.admin_socket)}, address=address, ingress=ingress)
    except BaseException:
        gate.close()
        raise
    return gate, url


def stop() -> None:
    """Removes the application and stops Ray Serve, the registry actor if one runs (after the
    replicas, which use it to the end), and the local Ray this process started."""
    import ray
    from ray import serve

    serve.shutdown()
    stop_registry_actor()
    ray.shutdown()


def serve(host: str, port: int, demo: bool, cfg: ServerConfig, replicas: int, tenants_per_replica: int,
              root: str | None = None, l_low: int | None = None, ingress: str = "haproxy", job_cpus: float = 1.0,
              registry: str = "home", registry_cache_s: float = 0.0, gate: bool = False) -> int:
    """``hmi serve --ray``: the same HTTP API from ``replicas`` replicas on Ray Serve, all sharing
    this ``HMI_HOME``, with ``gate`` behind the gate (``start_behind_gate``); blocks until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    home = hmi_home()
    prepared = prepare_in_child(home, root or DEFAULT_ROOT, l_low)  # the replicas load what is prepared here
    token, new = admin_token(home)  # made once, before any replica reads it
    env = {"HMI_HOME": str(home), **{k: os.environ[k] for k in ("HMI_ADMIN_TOKEN",) if k in os.environ}}
    print(f"starting Ray Serve: {replicas} replica(s) sharing {home}, {ingress} ingress, registry: {registry}", flush=True)
    factory = ReplicaServer(cfg, str(home), None if root in (None, DEFAULT_ROOT) else root, l_low, job_cpus, registry,
                            registry_cache_s)
    the_gate = None
    if gate:
        the_gate, inner = start_behind_gate(factory, host, port, replicas, tenants_per_replica, env=env, ingress=ingress)
        url = the_gate.url
        print(f"the gate (HAProxy) listens on {host}:{port} in front of Ray Serve's ingress ({inner}): a tenant the "
              "replicas keep refusing over its share is held to its fair rate there", flush=True)
    else:
        url = start(factory, host, port, replicas, tenants_per_replica, env=env, ingress=ingress)
    try:
        startup_report(home, prepared.meta, prepared.artifact_id, token, new)
        if demo:
            create_demo_tenants(home, *over_http(Client(url, token)))
        print(banner(url, home, how=f" through Ray Serve ({replicas} replicas); the same API as `hmi serve`"), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        stop()
        if the_gate is not None:
            the_gate.close()
    return 0


def app_builder(args: dict):
    """The application for ``serve run`` / ``serve deploy`` with a config file (``deploy/ray-serve.yaml``):
    ``args`` may name ``home`` (default ``HMI_HOME``), ``root``, ``l_low``, ``replicas`` (2),
    ``tenants_per_replica`` (1000), ``job_cpus`` (1), ``registry`` (``home``; ``actor`` starts
    the registry actor on the node that builds the application, which must hold the home) and
    ``registry_cache_s`` (0).  The home must be prepared (``hmi prepare``) beforehand."""
    home = str(args.get("home") or hmi_home())
    l_low = args.get("l_low")
    factory = ReplicaServer(ServerConfig(), home, args.get("root"), int(l_low) if l_low else None,
                            float(args.get("job_cpus", 1.0)), str(args.get("registry", "home")),
                            float(args.get("registry_cache_s", 0.0)))
    if factory.registry == "actor":
        start_registry_actor(home)
    return build_app(factory, int(args.get("replicas", 2)), int(args.get("tenants_per_replica", 1000)))
