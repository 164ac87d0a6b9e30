"""OpenAI-compatible routes of encoder models: ``POST /v1/embeddings`` and ``GET /v1/models``.

An embedding is the root's own sentence embedding (its sentence-transformers pooling, normalized
as the root's pipeline does) of the upper layers' output, computed through the PLOT path like
every other request and batched with them: for ``model`` = ``root`` the upper layers run without
an adapter; for a tenant they run with its adapter (its domain's PLOT below), so a tenant's
embeddings carry what it was fine-tuned on.
"""

from __future__ import annotations

import base64

import numpy as np
from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.routes_tenants import run_requests, servable_entry
from hmi.dispatcher.schemas import ROOT_MODEL, models_of, parse
from hmi.dispatcher.validation import ApiError, bearer, json_body
from hmi.scheduler.types import InferRequest
from hmi.services.server import Server


async def embeddings(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    who = await s.auth.caller(bearer(request))  # authenticate before the body is read or parsed
    body = parse(models_of(s)["EmbeddingBody"], await json_body(request))
    if s.embedding_error is not None:
        raise ApiError(501, "embeddings_unavailable", f"this root's sentence pooling is not served: {s.embedding_error}")
    width = s.root.bert.config.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise ApiError(422, "dimensions_unsupported", f"model {body.model!r} embeds in {width} dimensions; it cannot "
                       f"shorten them to {body.dimensions} (leave 'dimensions' out or send {width})")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if body.model == ROOT_MODEL:
        tenant, default_truncate = None, False
    else:
        tenant = body.model
        s.auth.may_act(who, tenant)
        default_truncate = (await servable_entry(s, tenant)).truncate
    truncate = body.truncate if body.truncate is not None else default_truncate
    outputs = await run_requests(s, [InferRequest(tenant, x, truncate=truncate, embed=True) for x in texts])
    data = [{"object": "embedding", "index": i, "embedding": _encoded(o["embedding"], body.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = sum(o["tokens"] for o in outputs)
    return web.json_response({"object": "list", "data": data, "model": body.model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector: np.ndarray, encoding_format: str):
    """One embedding as OpenAI's API sends it: a list of floats, or base64 of its float32 values in
    little-endian order (what the ``openai`` client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def list_models(request: web.Request) -> web.Response:
    """The models the caller may use: the root (embeddings), and its own tenant (a tenant's token)
    or every servable tenant (the admin's), each with what it serves."""
    s: Server = request.app[SERVER]
    who = await s.auth.caller(bearer(request))
    created = int(s.started)
    models = [{"id": ROOT_MODEL, "object": "model", "created": created, "owned_by": "hmi",
               "root": s.root.spec.name, "serves": ["embeddings"]}]
    names = s.served.names() if who == "admin" else [who]
    for name in sorted(names):
        kind = s.served.kind(name)
        if kind is not None:
            serves = ["completions", "generate"] if kind == "decoder" else ["embeddings", "infer"]
            models.append({"id": name, "object": "model", "created": created, "owned_by": name, "serves": serves})
    return web.json_response({"object": "list", "data": models})
