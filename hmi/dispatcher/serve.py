"""``hmi serve``: prepare what is missing, start the server, create the demo tenants."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from pathlib import Path

from aiohttp import web

from hmi.adapters.spec import AdapterSpec
from hmi.bootstrap import prepare_in_child
from hmi.data import task_labels
from hmi.dispatcher.app import make_app
from hmi.dispatcher.server import Server, ServerConfig
from hmi.home import hmi_home
from hmi.io import atomic_write_text
from hmi.model.aliases import DEFAULT_ROOT
from hmi.model.artifact import calibration_shortfall, load_root
from hmi.plot.lookup import PlotLookup
from hmi.plot.paths import open_root_version, plot_meta, root_plot_path
from hmi.scheduler.decoder_runtime import HgptRuntime

DEMO_DECODER_TENANTS = [{"name": "demo-legal-gpt", "corpus": "legal", "max_train": 160, "epochs": 1}]

DEMO_TENANTS = [
    # Sentiment on PLOT representations reads the token mean better than [CLS] (docs/decisions.md).
    # 200 dev and test texts each (for early stopping and the job's metrics): the first start's
    # demo tenant serves sooner than with the default 500.
    {"name": "demo-news", "dataset": "news-topic", "max_train": 800, "epochs": 3, "pooling": "cls", "max_eval": 200},
    {"name": "demo-reviews", "dataset": "review-sentiment", "max_train": 1500, "epochs": 3, "pooling": "mean",
     "max_eval": 200},
]


def build_server(cfg: ServerConfig, home: Path | None = None, root=None, job_launcher=None, registry=None) -> Server:
    """Loads the current root and its root PLOT (which must exist) into a Server (whose jobs run
    where ``job_launcher`` starts them; default: processes of the server's), keeping its state in
    ``registry`` (default: the home's own)."""
    home = home or hmi_home()
    root = root or load_root(home=home)
    version = open_root_version(root, home)
    lookup = PlotLookup([version], policy=cfg.miss_policy)
    return Server(home, root, lookup, cfg, root_plot_path(root, home), plot_meta(root), job_launcher, registry)


def start_demo_tenants(server: Server) -> dict[str, str]:
    """Creates the demo tenants that do not exist yet; returns the new tokens."""
    tokens = {}
    for d in DEMO_TENANTS:
        if server.registry.get("tenants", d["name"]) is not None:
            continue
        spec = AdapterSpec(labels=tuple(task_labels(d["dataset"])), pooling=d["pooling"])
        # News articles and reviews run past the token limit: the demo tenants cut them (in
        # training and inference alike) rather than refuse them.
        tokens[d["name"]], _ = server.tenants.create(d["name"], {"domain": "root", "spec": spec.to_dict(), "truncate": True},
                                                    {"dataset": d["dataset"], "max_train": d["max_train"],
                                                     "max_eval": d["max_eval"]},
                                                    epochs=d["epochs"], truncate=True, max_len=server.cfg.max_len)
    return tokens


def start_demo_decoder_tenants(server: Server) -> dict[str, str]:
    """Creates the demo decoder tenants that do not exist yet; returns the new tokens."""
    tokens = {}
    for d in DEMO_DECODER_TENANTS:
        if server.registry.get("tenants", d["name"]) is not None:
            continue
        spec = server.decoders.runtime.default_spec()
        tokens[d["name"]], _ = server.tenants.create(d["name"], {"model": "decoder", "domain": "root", "spec": spec.to_dict()},
                                                    {"corpus": d["corpus"], "max_train": d["max_train"]},
                                                    epochs=d["epochs"], model="decoder")
    return tokens


def enable_hgpt(server: Server, home: Path) -> None:
    """Loads the decoder root and its causal PLOT (built on first start) into the server."""
    print("loading the decoder root (SmolLM2-135M) and its causal PLOT")
    server.enable_hgpt(HgptRuntime.load_default(home, server.transfer.load_decoder_tenant, device=str(server.device)))


def serve(host: str, port: int, demo: bool, cfg: ServerConfig, hgpt: bool = False, root: str = DEFAULT_ROOT,
          l_low: int | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    home = hmi_home()
    server = build_server(cfg, home, prepare_in_child(home, root, l_low))
    if shortfall := calibration_shortfall(server.root.meta):
        print(f"warning: root artifact {server.root.artifact_id}: {shortfall}")
    if server.recovered:
        print(f"marked {len(server.recovered)} interrupted job(s) as failed")
    if server.resumed:
        print(f"running {len(server.resumed)} interrupted job(s) again from their start: {', '.join(server.resumed)}")
    token_file = home / "admin_token"
    if server.admin_token_new:
        print(f"admin token (printed once, also in {token_file}, mode 0600): {server.admin_token}")
    else:
        print("admin token: " + ("from HMI_ADMIN_TOKEN" if not token_file.exists() else f"in {token_file}"))
    if hgpt:
        enable_hgpt(server, home)
    if demo:
        tokens = start_demo_tenants(server)
        if hgpt:
            tokens.update(start_demo_decoder_tenants(server))
        if tokens:
            demo_file = home / "demo_tokens.json"
            existing = json.loads(demo_file.read_text()) if demo_file.exists() else {}
            atomic_write_text(demo_file, json.dumps({**existing, **tokens}, indent=1), mode=0o600)
            print(f"demo tenants training in the background: {', '.join(tokens)} (tokens in {demo_file})")
    base = f"http://{host}:{port}"
    print(f"""
HMI serving on {base}
  curl {base}/healthz
  ADMIN=$(cat {token_file})
  curl -H "Authorization: Bearer $ADMIN" {base}/v1/tenants
  curl -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \\
       -d '{{"inputs": ["Shares rose after the bank beat forecasts."]}}' {base}/v1/tenants/demo-news/infer
  hmi infer demo-news "The striker scored twice in the final."   (uses $HMI_HOME/admin_token)
""" + ("""  hmi generate demo-legal-gpt "Permission is hereby granted"       (decoder tenant, streams tokens)
""" if hgpt and demo else ""), flush=True)
    web.run_app(make_app(server), host=host, port=port, print=None, handle_signals=True)
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
