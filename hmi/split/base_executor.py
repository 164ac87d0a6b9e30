"""The base executor of split execution (Symbiosis): the root's frozen linear projections of
the upper layers, run for many private tenants at once.

Each call names an upper layer, a projection and an operation; calls for the same (layer,
projection, operation) from all clients are gathered while the executor is busy (or for a
bounded wait) and run as one GEMM over their rows (every client's batch x sequence flattened,
no padding), then split back.  Calls
batched together at one layer need not meet again at the next.  Nothing is kept between calls.
Inference calls go before training calls.  The GEMMs run on one thread of their own, off the
event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hmi.model.encoder_layers import fused_projection

PROJECTIONS = ("qkv", "attn_out", "ffn_in", "ffn_out")
# forward: y = x W^T + b;  nobias: y = x W^T (a noise's effect);  backward: grad_x = grad_y W
OPERATIONS = ("forward", "nobias", "backward")
INFERENCE, TRAINING = 0, 1


class FrozenLinears:
    """The frozen linear projections of a root's upper layers (absolute layer indices
    ``l_low .. L-1``): ``qkv`` (query, key and value fused: D_out = 3H), ``attn_out`` (H -> H),
    ``ffn_in`` (H -> I) and ``ffn_out`` (I -> H).  On the CPU the weights are the root's own
    tensors (shared, not copied); on a GPU (``device``) a copy lives there, and each call's rows go
    there and come back (calls arrive and leave as CPU tensors)."""

    def __init__(self, bert, l_low: int, device: str | torch.device = "cpu"):
        self.l_low, self.layers, self.device = l_low, len(bert.encoder.layer), torch.device(device)
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(l_low, self.layers):
            layer = bert.encoder.layer[i]
            att = layer.attention.self
            self.weights[i, "qkv"] = fused_projection((att.query, att.key, att.value))  # hosted serving's own
            for name, lin in (("attn_out", layer.attention.output.dense), ("ffn_in", layer.intermediate.dense),
                              ("ffn_out", layer.output.dense)):
                self.weights[i, name] = (lin.weight.detach(), lin.bias.detach())
        if self.device.type != "cpu":
            self.weights = {k: (w.to(self.device), b.to(self.device)) for k, (w, b) in self.weights.items()}

    def width(self, layer: int, projection: str, operation: str) -> int:
        """The last dimension a call's tensor must have (D_in; D_out for ``backward``)."""
        w = self.weights[layer, projection][0]
        return w.shape[0] if operation == "backward" else w.shape[1]

    def run(self, layer: int, projection: str, operation: str, x: torch.Tensor) -> torch.Tensor:
        """Semantics: forward x W^T + b; nobias x W^T; backward x W (x a gradient of the output).
        Shapes: x (N, D_in) or, for backward, (N, D_out) -> (N, D_out) or (N, D_in)."""
        w, b = self.weights[layer, projection]
        x = x.to(self.device, non_blocking=True)
        y = x @ w if operation == "backward" else F.linear(x, w, b if operation == "forward" else None)
        return y.cpu()


@dataclass
class _Call:
    rows: torch.Tensor  # (n, D)
    future: asyncio.Future
    priority: int
    arrived: float  # time.monotonic()


class BaseExecutor:
    """Runs ``FrozenLinears`` for many clients, batched per (layer, projection, operation) across
    them, on one thread of its own.  Work-conserving: whenever the thread is free it runs, as one
    GEMM, every call of one key that arrived meanwhile (up to ``max_rows`` rows; inference keys
    before training keys, then the key waiting longest), so calls gather while a GEMM runs and an
    idle executor never waits.  ``max_wait_s`` > 0 holds a batch that long after its first call
    for more calls (the fixed wait of Symbiosis's opportunistic batching); ``batching=False`` runs
    every call alone (the ablation).

    ``stats``: calls, batches (GEMMs), rows, and seconds the thread spent running them.

    ``observers``: callables told of every call the routes accept, ``(caller, call, tensor)``
    with ``call`` = ``("lower",)`` (the token ids and mask stacked, (2, B, T)) or ``(layer, projection, operation)`` (the
    rows): the provider's view of a private tenant, for audits of what it reveals
    (``hmi.split.attack``).  None by default."""

    def __init__(self, linears: FrozenLinears, max_wait_s: float = 0.0, max_rows: int = 8192,
                 batching: bool = True):
        self.observers: list = []
        self.linears, self.max_wait_s, self.max_rows, self.batching = linears, max_wait_s, max_rows, batching
        self._open: dict[tuple[int, str, str], list[_Call]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self.stats = {"calls": 0, "batches": 0, "rows": 0, "seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="base-executor", daemon=True)
        self._thread.start()

    def observe(self, caller: str, call: tuple, tensor: torch.Tensor) -> None:
        for observer in self.observers:
            observer(caller, call, tensor)

    async def call(self, layer: int, projection: str, operation: str, rows: torch.Tensor,
                   priority: int = INFERENCE) -> torch.Tensor:
        """The result of one call (its own rows, in order).  Shapes: rows (n, D) -> (n, D')."""
        c = _Call(rows, asyncio.get_running_loop().create_future(), priority, time.monotonic())
        with self._cond:
            self.stats["calls"] += 1
            self._open.setdefault((layer, projection, operation), []).append(c)
            self._cond.notify()
        return await c.future

    def _next(self) -> tuple[tuple[int, str, str], list[_Call]] | None:
        """The key and calls to run next (None: shutting down); waits for calls, and, with
        ``max_wait_s``, for a batch's wait to pass.  Holds the lock."""
        while not self._stopping:
            if not self._open:
                self._cond.wait()
                continue
            key = min(self._open, key=lambda k: (min(c.priority for c in self._open[k]), self._open[k][0].arrived))
            calls = self._open[key]
            if not self.batching:
                take = 1
            else:
                take, rows = 0, 0
                while take < len(calls) and (take == 0 or rows + len(calls[take].rows) <= self.max_rows):
                    rows += len(calls[take].rows)
                    take += 1
                left = self.max_wait_s - (time.monotonic() - calls[0].arrived)
                if take == len(calls) and rows < self.max_rows and left > 0:
                    self._cond.wait(left)
                    continue
            batch, rest = calls[:take], calls[take:]
            if rest:
                self._open[key] = rest
            else:
                del self._open[key]
            return key, batch
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                got = self._next()
            if got is None:
                return
            key, calls = got
            t = time.perf_counter()
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
            self.stats["seconds"] += time.perf_counter() - t

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(5)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
