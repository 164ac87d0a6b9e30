"""What every way of starting a server does around it (``hmi serve`` in one process,
``hmi serve --ray`` on Ray Serve): the startup report (warnings about the root artifact,
interrupted jobs, the admin token), the demo tenants and the banner.  The demo tenants are
created from the same API bodies either way: through the route's own code in one process,
over HTTP on a cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from hmi.adapters.shipped import ShippedAdapterError, shipped_for, trained_on
from hmi.io import atomic_write_text
from hmi.model.artifact import calibration_shortfall
from hmi.training.demo import DEMO_DECODER_TENANTS, DEMO_TENANTS, demo_body


def demo_bodies(hgpt: bool = False) -> list[dict]:
    """The ``POST /v1/tenants`` bodies of the demo tenants (with ``hgpt``, the decoder one too)."""
    return [demo_body(d) for d in DEMO_TENANTS] + (list(DEMO_DECODER_TENANTS) if hgpt else [])


def create_demo_tenants(home: Path, exists: Callable[[str], bool], create: Callable[[dict], dict],
                        hgpt: bool = False) -> dict[str, str]:
    """Creates the demo tenants that do not exist yet with ``create(body)`` (which answers as
    ``POST /v1/tenants`` does: the new tenant's ``token`` and its ``job``, None when it is ready
    at once); keeps their tokens in ``<home>/demo_tokens.json`` (mode 0600) and says so."""
    made = {b["name"]: create(b) for b in demo_bodies(hgpt) if not exists(b["name"])}
    tokens = {name: out["token"] for name, out in made.items()}
    if tokens:
        demo_file = home / "demo_tokens.json"
        existing = json.loads(demo_file.read_text()) if demo_file.exists() else {}
        atomic_write_text(demo_file, json.dumps({**existing, **tokens}, indent=1), mode=0o600)
        ready = [n for n, out in made.items() if out.get("job") is None]
        training = [n for n in made if n not in ready]
        if ready:
            print(f"demo tenants ready (their adapters ship with hmi): {', '.join(ready)} (tokens in {demo_file})")
        if training:
            print(f"demo tenants training in the background: {', '.join(training)} (tokens in {demo_file})")
    return tokens


def shipped_identity(server, model: str = "encoder") -> dict | None:
    """What a shipped adapter of a ``model`` tenant must have been trained on to serve here: the
    root artifact, the root's weights, the root PLOT's build and the miss policy (``hmi.adapters.shipped``); None
    for a decoder tenant on a server without decoder tenants."""
    if model == "decoder":
        runtime = server.decoders.runtime
        if runtime is None:
            return None
        lookup, artifact, fingerprint = runtime.lookup, runtime.root.artifact_id, runtime.fingerprint
    else:
        lookup, artifact, fingerprint = server.lookup, server.root.artifact_id, server.served.root_fingerprint
    return trained_on(artifact, fingerprint, lookup.chain[0].store, lookup.policy)


def import_shipped_demo(server, name: str, model: str = "encoder") -> dict | None:
    """Serves demo tenant ``name`` (a ``model`` tenant) from the adapter shipped with the package
    (``hmi.adapters.shipped``) when it was trained on this server's root artifact, root and root
    PLOT; returns the answer ``POST /v1/tenants`` would give (``job`` None: ready at once), or None."""
    identity = shipped_identity(server, model)
    if identity is None:
        return None
    try:
        shipped = shipped_for(name, **identity)
    except ShippedAdapterError as exc:
        print(f"warning: {exc}; its fine-tune job trains it instead")
        return None
    if shipped is None:
        return None
    token = server.transfer.import_adapter(name, model, shipped.spec, shipped.weights, truncate=model == "encoder",
                                           metrics={**shipped.meta.get("metrics", {}), "shipped": True,
                                                    "miss_policy": identity["miss_policy"]})
    return {"tenant": name, "token": token, "job": None}


def over_http(client) -> tuple[Callable[[str], bool], Callable[[dict], str]]:
    """(exists, create) for ``create_demo_tenants`` through a running server's API (``client``
    holds the admin token): how ``hmi serve --ray`` creates them once its replicas are up."""
    return (lambda name: any(t["name"] == name for t in client.tenants()),
            lambda body: client.request("POST", "/v1/tenants", body))


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


def banner(base: str, home: Path, hgpt_demo: bool = False, how: str = "", demo: bool = True) -> str:
    """What a server prints once it serves: where, and ready-to-paste requests (to the demo tenants,
    or, on a server without them, to a tenant the first command creates)."""
    tenant = "demo-news" if demo else "my-news"
    text = f"""
HMI serving on {base}{how}
  curl {base}/healthz
  ADMIN=$(cat {home / "admin_token"})
  curl -H "Authorization: Bearer $ADMIN" {base}/v1/tenants
"""
    if not demo:
        text += f"""  hmi tenant create {tenant} --dataset news-topic --max-train 640 --url {base} --wait   (minutes: a teacher first)
"""
    text += f"""  curl -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \\
       -d '{{"inputs": ["Shares rose after the bank beat forecasts."]}}' {base}/v1/tenants/{tenant}/infer
  hmi infer {tenant} "The striker scored twice in the final." --url {base}   (uses $HMI_HOME/admin_token)
"""
    if hgpt_demo:
        text += """  hmi generate demo-legal-gpt "Permission is hereby granted"       (decoder tenant, streams tokens)
"""
    return text
