"""``hmi serve``: prepare what is missing, start the server, create the demo tenants."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

from aiohttp import web

from hmi.allocator import release_heap
from hmi.bootstrap import (
    build_root_plot_in_background,
    keep_building,
    prepare_decoder,
    prepare_in_child,
    start_root_plot_build,
)
from hmi.dispatcher.app import make_app
from hmi.dispatcher.gate import HOLD_S, Gate
from hmi.dispatcher.launch import banner, create_demo_tenants, import_shipped_demo, startup_report
from hmi.dispatcher.routes_tenants import create_from_body
from hmi.hgpt.runtime import HgptRuntime
from hmi.home import hmi_home
from hmi.model.aliases import DEFAULT_ROOT, auto_miss_policy
from hmi.model.artifact import load_root
from hmi.plot.kept import Keeper
from hmi.plot.learned import LearnedBackoffMissingError, resolve_policy
from hmi.plot.lookup import PlotLookup
from hmi.plot.paths import open_root_version, plot_meta, root_plot_path
from hmi.plot.pending import serving_store
from hmi.services.server import Server, ServerConfig, ServerConfigError


def build_server(cfg: ServerConfig, home: Path | None = None, root=None, job_launcher=None, registry=None) -> Server:
    """Loads the current root and its root PLOT (which must exist) into a Server (whose jobs run
    where ``job_launcher`` starts them; default: processes of the server's), keeping its state in
    ``registry`` (default: the home's own)."""
    home = home or hmi_home()
    root = root or load_root(home=home)
    keeps = cfg.miss_policy == "compute+insert"
    version = open_root_version(root, home, writable=keeps)
    version.store = serving_store(version.store, version.encoder)  # a build in progress: served as it will be
    policy = resolve_policy(cfg.miss_policy, version, root)
    try:
        lookup = PlotLookup([version], policy=policy, keeper=Keeper(cfg.plot_keep_mb) if keeps else None)
    except LearnedBackoffMissingError as exc:
        raise ServerConfigError(str(exc)) from exc
    return Server(home, root, lookup, cfg, root_plot_path(root, home), plot_meta(root), job_launcher, registry)


def in_process(server: Server) -> tuple[Callable[[str], bool], Callable[[dict], dict]]:
    """(exists, create) for ``create_demo_tenants`` through the route's own code, before the
    server listens: how ``hmi serve`` creates them (from their shipped adapters where those fit
    this server's root, else by their fine-tune jobs)."""
    return (lambda name: server.registry.get("tenants", name) is not None,
            lambda body: import_shipped_demo(server, body["name"], body.get("model", "encoder"))
            or asyncio.run(create_from_body(server, body)))


def enable_hgpt(server: Server, home: Path) -> None:
    """Loads the decoder root (its calibrated windows shipped, installed or calibrated in a child
    process) into the server, serving its causal PLOT at once: when the PLOT is not complete yet,
    it is built in a child process beside the server, and what it lacks meanwhile is computed."""
    print("loading the decoder root (SmolLM2-135M) and its causal PLOT")
    root = prepare_decoder(home)
    builder = build_root_plot_in_background(home, root.artifact_id, decoder=True)
    server.enable_hgpt(HgptRuntime.open(root, home, server.transfer.load_decoder_tenant, device=str(server.device)))
    if builder is not None:
        print("the decoder's causal PLOT is being built in the background (GET /healthz says how far): until it is "
              "done, the values it does not hold yet are computed on demand, and the answers are the ones it will give")
        restart = lambda: start_root_plot_build(home, decoder=True)  # noqa: E731
        threading.Thread(target=keep_building, args=(restart, builder, server.closing),
                         kwargs={"what": "the decoder's causal PLOT"}, name="decoder-plot-build-watch",
                         daemon=True).start()


def serve(host: str, port: int, demo: bool, cfg: ServerConfig, hgpt: bool = False, root: str = DEFAULT_ROOT,
          l_low: int | None = None, gate: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    home = hmi_home()
    prepared = prepare_in_child(home, root, l_low, plot=False)
    builder = build_root_plot_in_background(home, prepared.artifact_id, root, l_low)
    server = build_server(cfg, home, prepared)
    startup_report(home, server.root.meta, server.root.artifact_id, server.admin_token, server.admin_token_new,
                   server.recovered, server.resumed)
    choice = auto_miss_policy(server.root.spec.source, server.root.spec.l_low)
    if cfg.miss_policy == "auto" and server.lookup.policy != choice:
        flags = (f" --root {root}" if root != DEFAULT_ROOT else "") + (f" --l-low {l_low}" if l_low else "")
        print(f"miss policy: {server.lookup.policy}; this root's choice, {choice}, serves the root PLOT's learned "
              f"back-off, which `hmi prepare{flags}` trains (then start again; docs/front.md)")
    if other := server.tenants.trained_with_another_policy(server.lookup.policy):
        print(f"{len(other)} tenant(s) were trained on windows read with another miss policy than this server's "
              f"{server.lookup.policy} ({', '.join(other[:5])}{', ...' if len(other) > 5 else ''}): their answers may "
              "differ from the accuracy their fine-tune measured until POST /v1/tenants/{tenant}/update trains them "
              "again (GET /v1/tenants/{tenant}: metrics.miss_policy)")
    if builder is not None:
        print("the root PLOT is being built in the background (GET /healthz says how far): until it is done, the "
              "values it does not hold yet are computed on demand, and the answers are the ones it will give")
        restart = lambda: start_root_plot_build(home, root, l_low)  # noqa: E731
        threading.Thread(target=keep_building, args=(restart, builder, server.closing), name="plot-build-watch",
                         daemon=True).start()
    if hgpt:
        enable_hgpt(server, home)
    if demo:
        create_demo_tenants(home, *in_process(server), hgpt=hgpt)
    print(banner(f"http://{host}:{port}", home, hgpt and demo, demo=demo), flush=True)
    release_heap()  # what loading the roots left freed (the decoder's dequantized weights: about 1 GB)
    if not gate:
        web.run_app(make_app(server), host=host, port=port, print=None, handle_signals=True)
        return 0
    return run_behind_gate(server, host, port)


def run_behind_gate(server: Server, host: str, port: int, hold_s: float = HOLD_S) -> int:
    """Serves the app on a free loopback port behind the gate on ``host:port``
    (hmi.dispatcher.gate); the gate stops with the server."""
    inner = socket.socket()
    inner.bind(("127.0.0.1", 0))
    server.gate = Gate.start(host, port, f"127.0.0.1:{inner.getsockname()[1]}", hold_s=hold_s)
    print(f"the gate (HAProxy) listens on {host}:{port}: a tenant the server keeps refusing over its share is held "
          f"there to its fair rate until it has sent within that rate for {hold_s:g} s", flush=True)
    try:
        web.run_app(make_app(server), sock=inner, print=None, handle_signals=True)
    finally:
        server.gate.close()
    return 0


async def start_app(server: Server, host: str = "127.0.0.1", port: int = 0, **runner_options) -> tuple[web.AppRunner, str]:
    """Serves the app on the running event loop (``port`` 0: a free one); returns (runner, base_url)."""
    runner = web.AppRunner(make_app(server), **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, f"http://{host}:{site._server.sockets[0].getsockname()[1]}"


def run_in_thread(server: Server, host: str = "127.0.0.1", port: int = 0):
    """Starts the app on a background event loop (tests, benchmarks); returns (base_url, stop)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box = {}

    def run():
        asyncio.set_event_loop(loop)
        box["runner"], box["url"] = loop.run_until_complete(start_app(server, host, port))
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(30)

    def stop():
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)

    return box["url"], stop
