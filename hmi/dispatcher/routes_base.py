"""HTTP routes of the base executor (split execution, ``hmi.split``): what a private tenant asks
of the server.  Bodies and answers are tensors in ``hmi.split.wire``'s binary format
(``application/octet-stream``); errors are JSON like everywhere else.

- ``POST /v1/base/lower``: token ids (B, T) and their mask (B, T) -> the lower layers' output as
  the PLOT serves it, merged (B, T, H).
- ``POST /v1/base/layers/{layer}/{projection}/{operation}``: a frozen linear projection of an
  upper layer on a tensor (..., D) (``hmi.split.base_executor``), batched with every other
  client's calls for the same projection; ``?priority=training`` lets inference go first.
"""

from __future__ import annotations

import asyncio

import torch
from aiohttp import web

from hmi.dispatcher.context import SERVER
from hmi.dispatcher.validation import ApiError, bearer
from hmi.services.server import Server
from hmi.split.base_executor import INFERENCE, OPERATIONS, PROJECTIONS, TRAINING
from hmi.split.wire import WireError, decode, encode

PRIORITIES = {"inference": INFERENCE, "training": TRAINING}


async def _private_caller(s: Server, request: web.Request) -> str:
    """The caller when it is a private tenant or the admin; 403 for a hosted tenant.  The record
    that confirmed the token says which (one registry read a call)."""
    who, rec = await s.auth.identify(bearer(request))
    if rec is not None and rec.get("model") != "private":
        raise ApiError(403, "forbidden", f"tenant {who!r} is hosted; the base executor serves private tenants")
    return who


async def _tensors(request: web.Request, count: int) -> list[torch.Tensor]:
    if request.content_type not in ("application/octet-stream", "application/x-hmi-tensor"):
        raise ApiError(415, "unsupported_media_type", "send tensors in hmi.split.wire's format as "
                       f"application/octet-stream, not {request.content_type}")
    try:
        tensors = decode(await request.read(), limit=count)
    except WireError as exc:
        raise ApiError(422, "malformed_tensor", str(exc)) from None
    if len(tensors) != count:
        raise ApiError(422, "malformed_tensor", f"the body holds {len(tensors)} tensor(s); this route takes {count}")
    return tensors


def _reply(*tensors: torch.Tensor) -> web.Response:
    return web.Response(body=encode(*tensors), content_type="application/octet-stream")


async def lower(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    who = await _private_caller(s, request)
    ids, mask = await _tensors(request, 2)
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
        raise ApiError(422, "wrong_tensor", f"token ids must be int32 or int64 of shape (B, T), not {ids.dtype} "
                       f"{list(ids.shape)}")
    if mask.shape != ids.shape or mask.dtype not in (torch.uint8, torch.int32, torch.int64):
        raise ApiError(422, "wrong_tensor", f"the mask must be an integer tensor of the ids' shape {list(ids.shape)}")
    b, t = ids.shape
    rows = s.cfg.max_inputs * s.cfg.max_len
    if not (0 < t <= s.cfg.max_len and 0 < b * t <= rows):
        raise ApiError(413, "too_large", f"{b} x {t} token ids; this server takes texts of up to {s.cfg.max_len} "
                       f"tokens, {rows} tokens in all")
    vocab = s.root.bert.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ApiError(422, "wrong_tensor", f"token ids must lie in [0, {vocab})")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ApiError(422, "wrong_tensor", "the mask holds 0 and 1 only")
    s.executor.observe(who, ("lower",), torch.stack([ids.long(), mask.long()]))

    def run() -> torch.Tensor:
        with torch.no_grad():
            return s.lookup.merged(ids.long().numpy(), mask.long().numpy()).float()

    return _reply(await asyncio.get_running_loop().run_in_executor(None, run))


async def linear(request: web.Request) -> web.Response:
    s: Server = request.app[SERVER]
    who = await _private_caller(s, request)
    layer, projection, operation = _call_of(s, request)
    priority = PRIORITIES.get(request.query.get("priority", "inference"))
    if priority is None:
        raise ApiError(400, "invalid_priority", f"priority is one of {', '.join(PRIORITIES)}")
    (x,) = await _tensors(request, 1)
    width = s.executor.linears.width(layer, projection, operation)
    if x.dtype != torch.float32 or x.dim() < 1 or x.shape[-1] != width or x.numel() == 0:
        raise ApiError(422, "wrong_tensor", f"{projection} {operation} of layer {layer} takes a non-empty float32 "
                       f"tensor (..., {width}), not {x.dtype} {list(x.shape)}")
    rows = x.reshape(-1, width)
    s.executor.observe(who, (layer, projection, operation), rows)
    y = await s.executor.call(layer, projection, operation, rows, priority)
    return _reply(y.reshape(*x.shape[:-1], y.shape[-1]))


def _call_of(s: Server, request: web.Request) -> tuple[int, str, str]:
    """(layer, projection, operation) of the path; 404 for a layer outside the upper layers or an
    unknown projection or operation."""
    m = request.match_info
    lo, hi = s.root.spec.l_low, s.root.bert.config.num_hidden_layers
    try:
        layer = int(m["layer"])
    except ValueError:
        layer = -1
    if not lo <= layer < hi:
        raise ApiError(404, "unknown_layer", f"layer {m['layer']!r}: the base executor serves upper layers {lo} to "
                       f"{hi - 1} (the lower ones are PLOT lookups: POST /v1/base/lower)")
    if m["projection"] not in PROJECTIONS:
        raise ApiError(404, "unknown_projection", f"projection {m['projection']!r}; one of {', '.join(PROJECTIONS)}")
    if m["operation"] not in OPERATIONS:
        raise ApiError(404, "unknown_operation", f"operation {m['operation']!r}; one of {', '.join(OPERATIONS)}")
    return layer, m["projection"], m["operation"]
