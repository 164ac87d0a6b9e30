"""What every way of starting a server does around it (``hmi serve`` in one process,
``hmi serve --ray`` on Ray Serve): the startup report (warnings about the root artifact,
interrupted jobs, the admin token), the demo tenants and the banner.  The demo tenants are
created from the same API bodies either way: through the route's own code in one process,
over HTTP on a cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from hmi.data import task_labels
from hmi.io import atomic_write_text
from hmi.model.artifact import calibration_shortfall

# Sentiment on PLOT representations reads the token mean better than [CLS] (docs/decisions.md).
# 200 dev and test texts each (for early stopping and the job's metrics): the first start's demo
# tenant serves sooner than with the default 500.  News articles and reviews run past the token
# limit: the demo tenants cut them (in training and inference alike) rather than refuse them.
DEMO_TENANTS = [
    {"name": "demo-news", "dataset": "news-topic", "pooling": "cls", "max_train": 800, "max_eval": 200, "epochs": 3},
    {"name": "demo-reviews", "dataset": "review-sentiment", "pooling": "mean", "max_train": 1500, "max_eval": 200,
     "epochs": 3},
]
DEMO_DECODER_TENANTS = [{"name": "demo-legal-gpt", "model": "decoder", "corpus": "legal", "max_train": 160, "epochs": 1}]


def demo_bodies(hgpt: bool = False) -> list[dict]:
    """The ``POST /v1/tenants`` bodies of the demo tenants (with ``hgpt``, the decoder one too)."""
    out = [{"name": d["name"], "task": {"type": "classification", "labels": list(task_labels(d["dataset"])),
                                        "pooling": d["pooling"]},
            "dataset": d["dataset"], "max_train": d["max_train"], "max_eval": d["max_eval"], "epochs": d["epochs"],
            "truncate": True} for d in DEMO_TENANTS]
    return out + (list(DEMO_DECODER_TENANTS) if hgpt else [])


def create_demo_tenants(home: Path, exists: Callable[[str], bool], create: Callable[[dict], str],
                        hgpt: bool = False) -> dict[str, str]:
    """Creates the demo tenants that do not exist yet with ``create(body)`` (which returns the new
    tenant's token); keeps their tokens in ``<home>/demo_tokens.json`` (mode 0600) and says so."""
    tokens = {b["name"]: create(b) for b in demo_bodies(hgpt) if not exists(b["name"])}
    if tokens:
        demo_file = home / "demo_tokens.json"
        existing = json.loads(demo_file.read_text()) if demo_file.exists() else {}
        atomic_write_text(demo_file, json.dumps({**existing, **tokens}, indent=1), mode=0o600)
        print(f"demo tenants training in the background: {', '.join(tokens)} (tokens in {demo_file})")
    return tokens


def over_http(client) -> tuple[Callable[[str], bool], Callable[[dict], str]]:
    """(exists, create) for ``create_demo_tenants`` through a running server's API (``client``
    holds the admin token): how ``hmi serve --ray`` creates them once its replicas are up."""
    return (lambda name: any(t["name"] == name for t in client.tenants()),
            lambda body: client.request("POST", "/v1/tenants", body)["token"])


def startup_report(home: Path, root_meta: dict, artifact_id: str, admin_token: str, admin_token_new: bool,
                   recovered: list[str] = (), resumed: list[str] = ()) -> list[str]:
    """The lines a starting server prints before it serves: a calibration cut short and what it
    costs, jobs a stop interrupted, and where the admin token is."""
    lines = []
    if shortfall := calibration_shortfall(root_meta):
        lines.append(f"warning: root artifact {artifact_id}: {shortfall}")
    if recovered:
        lines.append(f"marked {len(recovered)} interrupted job(s) as failed")
    if resumed:
        lines.append(f"running {len(resumed)} interrupted job(s) again from their start: {', '.join(resumed)}")
    token_file = home / "admin_token"
    if admin_token_new:
        lines.append(f"admin token (printed once, also in {token_file}, mode 0600): {admin_token}")
    else:
        lines.append("admin token: " + ("from HMI_ADMIN_TOKEN" if not token_file.exists() else f"in {token_file}"))
    for line in lines:
        print(line)
    return lines


def banner(base: str, home: Path, hgpt_demo: bool = False, how: str = "") -> str:
    """What a server prints once it serves: where, and ready-to-paste requests."""
    text = f"""
HMI serving on {base}{how}
  curl {base}/healthz
  ADMIN=$(cat {home / "admin_token"})
  curl -H "Authorization: Bearer $ADMIN" {base}/v1/tenants
  curl -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \\
       -d '{{"inputs": ["Shares rose after the bank beat forecasts."]}}' {base}/v1/tenants/demo-news/infer
  hmi infer demo-news "The striker scored twice in the final."   (uses $HMI_HOME/admin_token)
"""
    if hgpt_demo:
        text += """  hmi generate demo-legal-gpt "Permission is hereby granted"       (decoder tenant, streams tokens)
"""
    return text
