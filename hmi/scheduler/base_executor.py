"""The base executor of split execution (Symbiosis): the root's frozen linear projections of
the upper layers, run for many private tenants at once.

Each call names an upper layer, a projection and an operation; calls for the same (layer,
projection, operation) from all clients are gathered for a bounded wait and run as one GEMM over
their rows (every client's batch x sequence flattened, no padding), then split back.  Calls
batched together at one layer need not meet again at the next.  Nothing is kept between calls.
Inference calls go before training calls.  The GEMMs run on one thread of their own, off the
event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

PROJECTIONS = ("qkv", "attn_out", "ffn_in", "ffn_out")
# forward: y = x W^T + b;  nobias: y = x W^T (a noise's effect);  backward: grad_x = grad_y W
OPERATIONS = ("forward", "nobias", "backward")
INFERENCE, TRAINING = 0, 1


class FrozenLinears:
    """The frozen linear projections of a root's upper layers (absolute layer indices
    ``l_low .. L-1``): ``qkv`` (query, key and value fused: D_out = 3H), ``attn_out`` (H -> H),
    ``ffn_in`` (H -> I) and ``ffn_out`` (I -> H).  Weights are the root's own tensors (shared,
    not copied)."""

    def __init__(self, bert, l_low: int):
        self.l_low, self.layers = l_low, len(bert.encoder.layer)
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(l_low, self.layers):
            layer = bert.encoder.layer[i]
            att = layer.attention.self
            self.weights[i, "qkv"] = (torch.cat([att.query.weight, att.key.weight, att.value.weight]).detach(),
                                      torch.cat([att.query.bias, att.key.bias, att.value.bias]).detach())
            for name, lin in (("attn_out", layer.attention.output.dense), ("ffn_in", layer.intermediate.dense),
                              ("ffn_out", layer.output.dense)):
                self.weights[i, name] = (lin.weight.detach(), lin.bias.detach())

    def width(self, layer: int, projection: str, operation: str) -> int:
        """The last dimension a call's tensor must have (D_in; D_out for ``backward``)."""
        w = self.weights[layer, projection][0]
        return w.shape[0] if operation == "backward" else w.shape[1]

    def run(self, layer: int, projection: str, operation: str, x: torch.Tensor) -> torch.Tensor:
        """Semantics: forward x W^T + b; nobias x W^T; backward x W (x a gradient of the output).
        Shapes: x (N, D_in) or, for backward, (N, D_out) -> (N, D_out) or (N, D_in)."""
        w, b = self.weights[layer, projection]
        if operation == "backward":
            return x @ w
        return F.linear(x, w, b if operation == "forward" else None)


@dataclass
class _Call:
    rows: torch.Tensor  # (n, D)
    future: asyncio.Future
    priority: int


@dataclass
class _Pending:
    calls: list[_Call] = field(default_factory=list)
    rows: int = 0
    timer: asyncio.TimerHandle | None = None


class BaseExecutor:
    """Runs ``FrozenLinears`` for many clients, batched per (layer, projection, operation) across
    them: a call joins the open batch of its key; the batch closes when it holds ``max_rows`` rows
    or ``max_wait_s`` after its first call (``batching=False``: every call runs alone, at once).
    Closed batches run on one thread, inference before training."""

    def __init__(self, linears: FrozenLinears, max_wait_s: float = 0.002, max_rows: int = 8192,
                 batching: bool = True):
        self.linears, self.max_wait_s, self.max_rows, self.batching = linears, max_wait_s, max_rows, batching
        self._open: dict[tuple[int, str, str], _Pending] = {}
        self._ready: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self.stats = {"calls": 0, "batches": 0, "rows": 0}
        self._thread = threading.Thread(target=self._run, name="base-executor", daemon=True)
        self._thread.start()

    async def call(self, layer: int, projection: str, operation: str, rows: torch.Tensor,
                   priority: int = INFERENCE) -> torch.Tensor:
        """The result of one call (its own rows, in order).  Shapes: rows (n, D) -> (n, D')."""
        loop = asyncio.get_running_loop()
        c = _Call(rows, loop.create_future(), priority)
        key = (layer, projection, operation)
        self.stats["calls"] += 1
        if not self.batching:
            self._close(key, _Pending([c], len(rows)))
            return await c.future
        p = self._open.setdefault(key, _Pending())
        p.calls.append(c)
        p.rows += len(rows)
        if p.rows >= self.max_rows:
            self._close(key, self._open.pop(key))
        elif p.timer is None:
            p.timer = loop.call_later(self.max_wait_s, lambda: self._close(key, self._open.pop(key, None)))
        return await c.future

    def _close(self, key, pending: _Pending | None) -> None:
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        priority = min(c.priority for c in pending.calls)
        self._ready.put((priority, next(self._seq), key, pending.calls))

    def _run(self) -> None:
        while True:
            _, _, key, calls = self._ready.get()
            if key is None:
                return
            try:
                with torch.no_grad():
                    out = self.linears.run(*key, torch.cat([c.rows for c in calls]) if len(calls) > 1 else calls[0].rows)
                results = out.split([len(c.rows) for c in calls])
                self.stats["batches"] += 1
                self.stats["rows"] += len(out)
                for c, r in zip(calls, results):
                    c.future.get_loop().call_soon_threadsafe(_settle, c.future, r, None)
            except Exception as exc:  # noqa: BLE001 - each caller gets the error
                for c in calls:
                    c.future.get_loop().call_soon_threadsafe(_settle, c.future, None, exc)

    def shutdown(self) -> None:
        self._ready.put((-1, -1, None, None))
        self._thread.join(5)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
