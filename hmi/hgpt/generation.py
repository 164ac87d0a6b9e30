"""Batched multi-tenant generation on a windowed decoder (hGPT).

One decoding step runs every active request (each of its own tenant) through the shared upper
layers at once: the new token's lower-side state is one PLOT lookup of its causal window, each
request's LoRA is applied with its weights gathered from the stacked pool (``segment_bmm``), and
keys/values of earlier tokens come from a KV cache of the upper layers only.  Requests join
between steps as rows free up and leave when they finish (continuous batching).  Greedy decoding
or sampling (temperature, top-p, a per-request seed), ``max_new_tokens`` and stop strings.
"""

from __future__ import annotations

import copy
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from hmi.adapters.batched import batched_lora, segment_plan
from hmi.adapters.pool import SlotPool
from hmi.adapters.spec import SpecError
from hmi.errors import Kind, Refusal
from hmi.hgpt.sampling import GREEDY_BELOW, next_token, streamable
from hmi.model import decoder_layers
from hmi.model.decoder import DecoderRoot, additive_mask
from hmi.model.decoder_layers import KVCache, Step
from hmi.plot.lookup import PlotLookup
from hmi.scheduler.fair import FairQueue, TenantQueueFullError
from hmi.textlimit import words_exceed

log = logging.getLogger("hmi.generation")


SEED_LIMIT = 2**63  # torch.Generator seeds are signed 64-bit


class GenerationError(Refusal, ValueError):
    """A generation request that is refused (``Kind.INVALID`` unless said) or failed alone;
    ``code`` names the problem for the API."""

    def __init__(self, code: str, message: str, kind: Kind = Kind.INVALID):
        super().__init__(kind, code, message)


@dataclass
class GenRequest:
    tenant: str
    prompt: str
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], None] | None = None  # streaming: each new piece of text, in order
    future: Future = field(default_factory=Future)
    prompt_ids: list[int] | None = field(default=None, init=False)  # set once the request is validated
    created: float = field(default_factory=time.monotonic, init=False)

    def cancel(self) -> None:
        """The client is gone: the engine drops the request at its next step and frees its slot."""
        self.future.cancel()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class _Active:
    req: GenRequest
    ids: list[int]  # prompt + generated tokens
    n_prompt: int
    row: int  # KV-cache row
    slot: int  # LoRA pool slot
    gen: torch.Generator | None
    pos: int = 0  # tokens already in the KV cache
    emitted: int = 0  # characters of the completion already streamed
    finish: str | None = None


@dataclass
class EngineConfig:
    max_active: int = 32  # requests decoded together (KV-cache rows)
    max_len: int = 512  # prompt + completion tokens per request
    lora_slots: int = 64
    rank: int = 8
    max_new_tokens_limit: int = 1024
    device: str = "cpu"  # where the upper layers, the KV cache and the LoRA pool live


class GenerationEngine:
    """Continuous batching over one decoder root. ``step`` is not thread-safe: one thread drives it
    (``GenerationService`` runs one)."""

    def __init__(self, root: DecoderRoot, lookup: PlotLookup, load_tenant: Callable[[str], tuple],
                 cfg: EngineConfig | None = None):
        self.root, self.lookup, self.load_tenant = root, lookup, load_tenant
        self.cfg = cfg or EngineConfig()
        c = root.model.config
        self.device = torch.device(self.cfg.device)
        # The upper layers, final norm, LM head and rotary embedding run on the engine's device; on
        # the CPU they are the root's own modules (shared with fine-tune workers), elsewhere copies.
        m = root.model
        on_device = (lambda mod: mod) if self.device.type == "cpu" else (lambda mod: copy.deepcopy(mod).to(self.device))
        self.upper = on_device(root.layers[root.l_low:])
        self.norm, self.lm_head, self.rotary = on_device(m.model.norm), on_device(m.lm_head), on_device(m.model.rotary_emb)
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        n_up = len(self.upper)
        shape = (self.cfg.max_active, self.nkv, self.cfg.max_len, self.hd)
        self.kv = KVCache([torch.zeros(shape, device=self.device) for _ in range(n_up)],
                          [torch.zeros(shape, device=self.device) for _ in range(n_up)])
        self.pool = SlotPool(("lora", self.cfg.rank), self.cfg.lora_slots, n_up, c.hidden_size, c.intermediate_size,
                             max_labels=0, device=self.device, value_width=self.nkv * self.hd)
        self.waiting: list[GenRequest] = []
        self.active: list[_Active] = []
        tok = root.tokenizer
        self.stop_ids = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")) if i is not None}
        self.stats = {"steps": 0, "tokens": 0, "prefills": 0}

    # -- requests --------------------------------------------------------------------------------
    def validate(self, req: GenRequest) -> list[int]:
        if not isinstance(req.prompt, str) or not req.prompt:
            raise GenerationError("bad_prompt", "prompt must be a non-empty string")
        if not (isinstance(req.max_new_tokens, int) and 1 <= req.max_new_tokens <= self.cfg.max_new_tokens_limit):
            raise GenerationError("bad_max_new_tokens", f"max_new_tokens must be an integer in [1, {self.cfg.max_new_tokens_limit}]")
        if not (_number(req.temperature) and 0 <= req.temperature <= 10):
            raise GenerationError("bad_temperature", f"temperature must be a number in [0, 10] (below {GREEDY_BELOW}: greedy)")
        if not (_number(req.top_p) and 0 < req.top_p <= 1):
            raise GenerationError("bad_top_p", "top_p must be a number in (0, 1]")
        if req.seed is not None and not (isinstance(req.seed, int) and not isinstance(req.seed, bool)
                                         and 0 <= req.seed < SEED_LIMIT):
            raise GenerationError("bad_seed", "seed must be an integer in [0, 2**63 - 1]")
        if not (isinstance(req.stop, (list, tuple)) and len(req.stop) <= 8 and all(isinstance(s, str) and s for s in req.stop)):
            raise GenerationError("bad_stop", "stop must be a list of up to 8 non-empty strings")
        limit = self.cfg.max_len - 1
        if words_exceed(req.prompt, limit):  # refused before any tokenization work
            raise GenerationError("input_too_long", f"the prompt has more than {limit} tokens; the limit is {limit}", Kind.TOO_LARGE)
        ids = self.root.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
        if len(ids) > limit:
            raise GenerationError("input_too_long", f"the prompt has {len(ids)} tokens; the limit is {limit}", Kind.TOO_LARGE)
        req.prompt_ids = ids
        return ids

    def submit(self, req: GenRequest) -> Future:
        self.validate(req)
        self.waiting.append(req)
        return req.future

    def generate(self, requests: list[GenRequest]) -> list[dict]:
        """Runs the requests to completion (continuous batching); returns their results in order."""
        for r in requests:
            self.submit(r)
        while self.waiting or self.active:
            self.step()
        return [r.future.result() for r in requests]

    # -- one step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Admits waiting requests (prefill, first token) and decodes one token of the others.

        A request's own failure (its adapter, its sampling, its stream) fails that request alone;
        requests whose client went away (``GenRequest.cancel``) leave here and free their row and slot."""
        for a in [a for a in self.active if a.req.future.cancelled()]:
            self._drop(a)
        running = list(self.active)
        new = self._admit()
        if new:
            self._prefill(new)
        if running:
            self._decode(running)
        self.stats["steps"] += 1
        for a in [a for a in self.active if a.finish]:
            self._finish(a)

    def _acquire(self, tenant: str) -> int:
        """The tenant's pinned LoRA slot, its weights written there on a miss (``load_tenant``); a
        tenant whose weights cannot be read or do not fit fails alone and leaves its slot free."""
        slots, missing = self.pool.acquire([tenant])
        slot = slots[tenant]
        if missing:
            try:
                spec, w = self.load_tenant(tenant)
                if spec.rank != self.cfg.rank:
                    raise SpecError(f"tenant {tenant!r} has rank {spec.rank}; this server batches rank {self.cfg.rank}")
                self.pool.check(w, 0)
                self.pool.write(slot, w, scaling=spec.scaling)
            except Exception:
                self.pool.evict(tenant)
                self.pool.release(slots)
                raise
        return slot

    def _admit(self) -> list[_Active]:
        free = sorted(set(range(self.cfg.max_active)) - {a.row for a in self.active})
        new = []
        while self.waiting and free:
            req = self.waiting.pop(0)
            if req.future.done():
                continue
            slot = None
            try:
                ids = req.prompt_ids if req.prompt_ids is not None else self.validate(req)
                slot = self._acquire(req.tenant)
                gen = None
                if not req.greedy:
                    seed = req.seed if req.seed is not None else int(np.random.SeedSequence().entropy % SEED_LIMIT)
                    gen = torch.Generator().manual_seed(seed)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                if slot is not None:
                    self.pool.release({req.tenant: slot})
                _fail(req, exc)
                continue
            a = _Active(req, list(ids), len(ids), free.pop(0), slot, gen)
            self.active.append(a)
            new.append(a)
        return new

    def _prefill(self, new: list[_Active]) -> None:
        lens = [len(a.ids) for a in new]
        T = max(lens)
        ids = np.zeros((len(new), T), dtype=np.int64)
        mask = np.zeros((len(new), T), dtype=np.int64)
        for i, a in enumerate(new):
            ids[i, :lens[i]] = a.ids
            mask[i, :lens[i]] = 1
        h = self.lookup.merged(ids, mask).float().to(self.device)
        n_new = torch.tensor(lens, device=self.device)
        out = self._upper(h, new, torch.zeros(len(new), dtype=torch.long, device=self.device), n_new)
        last = out[torch.arange(len(new), device=self.device), n_new - 1]
        for a, n in zip(new, lens):
            a.pos = n
        self.stats["prefills"] += len(new)
        self._sample(new, self._logits(last))

    def _decode(self, running: list[_Active]) -> None:
        running = [a for a in running if not a.finish]
        if not running:
            return
        win = np.zeros((len(running), 3), dtype=np.int64)
        for i, a in enumerate(running):
            tail = a.ids[-3:]
            win[i, 3 - len(tail):] = tail
        uniq, inv = np.unique(win, axis=0, return_inverse=True)
        reps, hits = self.lookup.window_reps(uniq)
        self.lookup.record(hits)
        merged = self.lookup.merge(torch.from_numpy(reps.astype(np.float32))[None])[0]
        h = merged[torch.from_numpy(inv.reshape(-1))].unsqueeze(1).to(self.device)
        starts = torch.tensor([a.pos for a in running], device=self.device)
        out = self._upper(h, running, starts, torch.ones(len(running), dtype=torch.long, device=self.device))
        for a in running:
            a.pos += 1
        self._sample(running, self._logits(out[:, 0]))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token scores (B, V), on the host: sampling uses per-request CPU generators."""
        return self.lm_head(self.norm(h)).float().cpu()

    def _upper(self, h: torch.Tensor, reqs: list[_Active], starts: torch.Tensor, q_lens: torch.Tensor) -> torch.Tensor:
        """The upper layers for new tokens of several requests, with their KV cache and LoRA.

        Semantics: token j of request b sits at position starts[b] + j; it attends to the cached
        keys/values of positions < starts[b] and to new tokens up to itself; the new keys/values
        (j < q_lens[b]) are written to the cache row of b.
        Shapes: h (B, Tq, H); starts, q_lens (B,) -> (B, Tq, H) (before the final norm).
        """
        B, Tq, _ = h.shape
        dev = self.device
        rows = torch.tensor([a.row for a in reqs], device=dev)
        slots = torch.tensor([a.slot for a in reqs], device=dev)
        plan = segment_plan([a.slot for a in reqs])
        scale = self.pool.scales.index_select(0, slots)[:, None, None]
        pos = starts[:, None] + torch.arange(Tq, device=dev)[None]
        cos, sin = self.rotary(h, pos)
        ends = starts + q_lens
        Lk = int(ends.max())
        kpos = torch.arange(Lk, device=dev)
        allowed = (kpos[None, None, :] <= pos[:, :, None]) & (kpos[None, None, :] < ends[:, None, None])
        mask = additive_mask(allowed, h.dtype)
        step = Step(rows, starts, q_lens, mask, cos, sin)

        def lora(li: int, site: str, x: torch.Tensor) -> torch.Tensor:
            lw = self.pool.layer(li)
            return scale * batched_lora(x, slots, lw[f"{site}_A"], lw[f"{site}_B"], 1.0, plan)

        return decoder_layers.upper_forward(self.upper, h, step, self.kv, self.nh, self.nkv, self.hd, lora)

    def _sample(self, reqs: list[_Active], logits: torch.Tensor) -> None:
        for a, lg in zip(reqs, logits):
            try:
                self._next_token(a, lg)
            except Exception as exc:  # noqa: BLE001 - this request fails alone; the others go on
                a.finish = "error"
                _fail(a.req, exc)

    def _next_token(self, a: _Active, lg: torch.Tensor) -> None:
        """Samples request ``a``'s next token from its logits (V,) and streams the new text."""
        r = a.req
        if not bool(torch.isfinite(lg).all()):
            raise GenerationError("generation_failed", "the model produced non-finite scores for this request", Kind.FAILED)
        t = next_token(lg, r.temperature, r.top_p, None if r.greedy else a.gen)
        self.stats["tokens"] += 1
        if t in self.stop_ids:
            a.finish = "stop"
            return
        a.ids.append(t)
        text = self._completion(a)
        hit = min((i for i in (text.find(s) for s in r.stop) if i >= 0), default=-1)
        if hit >= 0:
            a.finish = "stop"
        elif len(a.ids) - a.n_prompt >= r.max_new_tokens:
            a.finish = "length"
        elif len(a.ids) >= self.cfg.max_len:
            a.finish = "length"
        self._stream(a, text if hit < 0 else text[:hit], final=a.finish is not None)

    def _completion(self, a: _Active) -> str:
        return self.root.tokenizer.decode(a.ids[a.n_prompt:], skip_special_tokens=True)

    def _stream(self, a: _Active, text: str, final: bool) -> None:
        """Emits new text, holding back a tail that could still become a stop string."""
        if a.req.on_text is None:
            return
        upto = streamable(text, a.emitted, a.req.stop, final)
        if upto > a.emitted:
            piece, a.emitted = text[a.emitted:upto], upto
            a.req.on_text(piece)

    def _drop(self, a: _Active) -> None:
        """Frees a request's row and slot without an answer (its client left, or it failed)."""
        self.active.remove(a)
        self.pool.release({a.req.tenant: a.slot})
        self.stats["dropped"] = self.stats.get("dropped", 0) + 1

    def _finish(self, a: _Active) -> None:
        if a.req.future.done():  # failed or cancelled on the way
            self._drop(a)
            return
        text = self._completion(a)
        for s in a.req.stop:
            i = text.find(s)
            if i >= 0:
                text = text[:i]
        self._stream(a, text, final=True)
        self.active.remove(a)
        self.pool.release({a.req.tenant: a.slot})
        if not a.req.future.done():
            a.req.future.set_result({"text": text, "tokens": len(a.ids) - a.n_prompt, "finish_reason": a.finish,
                                     "prompt_tokens": a.n_prompt})


class ServiceClosedError(RuntimeError):
    """The generation service is shutting down."""


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fail(req: GenRequest, exc: BaseException) -> None:
    if not req.future.done():
        req.future.set_exception(exc)


class GenerationService:
    """Runs a GenerationEngine in its own thread; requests from any thread join between steps.

    Requests wait in their tenant's queue and take the engine's free rows by start-time fair
    queuing (``hmi.scheduler.fair``, ``weight(tenant)`` its share): a tenant that floods the
    server waits behind itself.  Bounded: ``submit`` refuses past ``tenant_queue`` waiting for
    the tenant (TenantQueueFullError) or ``max_waiting`` in all (queue.Full); the HTTP layer
    answers 429."""

    def __init__(self, engine: GenerationEngine, max_waiting: int = 256, tenant_queue: int = 64,
                 weight: Callable[[str], float] | None = None):
        self.engine = engine
        self.max_waiting, self.tenant_queue = max_waiting, tenant_queue
        self._fair = FairQueue(weight)
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hgpt", daemon=True)
        self._thread.start()

    def submit(self, req: GenRequest) -> Future:
        """Validates and queues a request. Raises GenerationError (invalid), TenantQueueFullError
        (its tenant has ``tenant_queue`` waiting), queue.Full (``max_waiting`` wait) or
        ServiceClosedError."""
        if self._closed:
            raise ServiceClosedError("the generation service is shut down")
        self.engine.validate(req)
        with self._cv:
            mine = self._fair.waiting(req.tenant)
            if mine >= self.tenant_queue:
                raise TenantQueueFullError(req.tenant, mine)
            if len(self._fair) >= self.max_waiting:
                raise queue.Full(f"{len(self._fair)} generation requests are waiting")
            self._fair.push(req.tenant, [req])
            self._cv.notify()
        return req.future

    def set_weight(self, weight: Callable[[str], float]) -> None:
        """``weight(tenant)``: a tenant's share of the rows relative to the others' (read when its
        requests are queued)."""
        with self._cv:
            self._fair.weight = weight

    def waiting(self) -> int:
        return len(self._fair) + len(self.engine.waiting)

    def _loop(self) -> None:
        e = self.engine
        while True:
            with self._cv:
                if self._closed and not self._fair and not e.waiting and not e.active:
                    return
                if not (self._fair or e.waiting or e.active):
                    self._cv.wait(0.1)
                while self._fair and len(e.waiting) < e.cfg.max_active - len(e.active):
                    e.waiting.append(self._fair.pop())
            if e.waiting or e.active:
                try:
                    e.step()
                except Exception as exc:  # noqa: BLE001 - a batched kernel failed: fail the step's requests, keep serving
                    log.exception("generation step failed; failing its %d requests", len(e.active))
                    for a in list(e.active):
                        e._drop(a)
                        _fail(a.req, exc)

    def shutdown(self, timeout: float = 60.0) -> None:
        self._closed = True
        self._thread.join(timeout)
