"""A live server for the property-based fuzzer: a tiny random root with the real tokenizer, real
LMDB stores and jobs, two trained tenants (one classification, one tagging) and a decoder
tenant, so that the fuzzer's requests reach every handler.

Usage: python -m tests.fuzz.serve HOME PORT  (prints READY when it answers; HMI_ADMIN_TOKEN sets
the admin token)."""

import sys
import time
from pathlib import Path

from aiohttp import web

from hmi.dispatcher.app import make_app


def main(home: Path, port: int) -> None:
    from hmi.hgpt.generation import EngineConfig
    from hmi.hgpt.runtime import HgptRuntime
    from hmi.plot.store import PlotMeta, PlotStore
    from tests.helpers.decoders import TEXTS, tiny_decoder_root
    from tests.helpers.servers import TAGS, TRAIN, tiny_server

    server = tiny_server(home, max_inputs=8, max_input_chars=2000, max_body_mb=1, max_examples=200, job_time_limit_s=60)
    root = tiny_decoder_root()
    meta = PlotMeta(root.artifact_id, 2, 32, n=1, kind="causal")
    if not (home / "gpt-plot").exists():
        PlotStore(home / "gpt-plot", meta=meta, readonly=False).close()
    server.enable_hgpt(HgptRuntime(root, PlotStore(home / "gpt-plot", readonly=True, expect=meta), server.transfer.load_decoder_tenant,
                                   miss_policy="compute", cfg=EngineConfig(rank=4, max_len=128, max_active=4)))
    jobs = [server.tenants.create("alpha", {"domain": "root", "spec": {"labels": ["neg", "pos"]}}, {"train": TRAIN}, epochs=1)[1],
            server.tenants.create("beta", {"domain": "root", "spec": {"head": "tagging", "labels": ["D", "N", "V"]}},
                                 {"train": TAGS}, epochs=1)[1],
            server.tenants.create("writer", {"model": "decoder", "domain": "root", "spec": {"rank": 4, "alpha": 8.0}},
                                 {"texts": TEXTS}, epochs=1, model="decoder")[1]]
    while any(server.registry.get("jobs", j)["state"] in ("queued", "running") for j in jobs):
        time.sleep(0.2)
    web.run_app(make_app(server), host="127.0.0.1", port=port, print=lambda *a: print("READY", flush=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
