"""Stage R of the scheduler's pipeline (``hmi.scheduler.pipeline.Scheduler``): a batch's texts
tokenized and checked against the token limit, its tenants' adapters read from the store (checked
against their specs and the device pools), and its rows' lower representations read from their
domains' PLOT lookups and merged (the rows of ``whole`` tenants, served on the full root: the
root's embeddings instead): a ``Prepared`` batch for stage C (the upper layers, or every layer)."""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import torch

from hmi.adapters.heads import word_starts
from hmi.adapters.store import AdapterStore, TenantMissingError
from hmi.errors import Kind, Refusal
from hmi.model.hplm import as_numpy_ids
from hmi.scheduler.types import ROOT, InferRequest, LookupSource, Prepared, TenantEntry, TenantView, fail
from hmi.textlimit import TooLongError, fit_ids, words_exceed

log = logging.getLogger("hmi.scheduler")
TRUNCATE_HINT = 'send "truncate": true to cut it to the limit'


class Retrieval:
    """Stage R for one scheduler: ``tenants`` says what each request's tenant is served with,
    ``lookups`` where each domain's PLOT is, ``store`` and ``residency`` hold the adapters;
    ``hidden`` is the root's width, ``max_len`` the token limit, ``device`` stage C's (a CUDA
    device gets pinned tensors), ``tracer`` records the stage's spans, ``embeddings`` is the root's
    embedding module (the input of the rows of ``whole`` tenants)."""

    def __init__(self, tokenizer, store: AdapterStore, tenants: TenantView, lookups: LookupSource, residency,
                 hidden: int, max_len: int, device: torch.device, tracer, embeddings=None):
        self.tokenizer, self.store, self.tenants, self.lookups = tokenizer, store, tenants, lookups
        self.residency, self.hidden, self.max_len, self.device, self.tracer = residency, hidden, max_len, device, tracer
        self.embeddings = embeddings

    def prepare(self, batch_id: int, reqs: list[InferRequest]) -> Prepared | None:
        """Stage R of one batch: tokenize, check, read adapters, PLOT lookup + merge.

        Whatever belongs to one request or one tenant (a text over the limit, an unknown tenant,
        an unreadable or ill-shaped adapter file, a domain whose PLOT cannot be opened) fails
        those requests alone; the rest of the batch goes on."""
        with self.tracer.span("R:lookup", batch_id, size=len(reqs)):
            todo = [r for r in reqs if not r.future.done() and self._fits(r)]
            texts = [r.text for r in todo]
            enc = self.tokenizer(texts, truncation=False, return_offsets_mapping=True) if texts else None
            weights, bad = {}, {}
            rows = []  # (request, entry, ids, word starts, truncated?)
            for i, r in enumerate(todo):
                try:
                    entry = ROOT if r.tenant is None else self.tenants.entry(r.tenant)
                    try:
                        ids, cut = fit_ids(enc["input_ids"][i], self.max_len, r.truncate)
                    except TooLongError as exc:
                        raise Refusal(Kind.TOO_LARGE, "input_too_long", f"the input has {exc}; {TRUNCATE_HINT}") from None
                    if r.tenant in bad:
                        raise bad[r.tenant]
                    if entry.spec is not None and r.tenant not in weights:
                        weights[r.tenant] = self._load(entry)
                except Refusal as exc:
                    if exc.code in ("adapter_missing", "adapter_unreadable"):
                        bad[r.tenant] = exc  # read once per batch, not once per request
                    fail(r, exc)
                    continue
                tagging = not r.embed and entry.spec.head == "tagging"
                starts = word_starts(enc, i, texts[i]) if tagging else []
                rows.append((r, entry, ids, [s for s in starts if s[0] < len(ids) - 1], cut))
            if not rows:
                return None
            ids, mask = as_numpy_ids([x[2] for x in rows])
            hidden = torch.zeros(len(rows), ids.shape[1], self.hidden)
            ok = self._lookup_by_domain(rows, ids, mask, hidden)
            if not ok:
                return None
            if len(ok) < len(rows):
                keep = torch.tensor(ok)
                rows, hidden, mask = [rows[j] for j in ok], hidden.index_select(0, keep), mask[ok]
            mask_t = torch.from_numpy(mask)
            if self.device.type == "cuda":
                hidden, mask_t = hidden.pin_memory(), mask_t.pin_memory()
        return Prepared(batch_id, [x[0] for x in rows], [x[1] for x in rows], hidden, mask_t, [x[3] for x in rows],
                        weights, [x[4] for x in rows])

    def _fits(self, r: InferRequest) -> bool:
        """Refuses a text that certainly exceeds the limit before any tokenization work."""
        if not r.truncate and words_exceed(r.text, self.max_len - 2):
            fail(r, Refusal(Kind.TOO_LARGE, "input_too_long", f"the input has more than {self.max_len} tokens; the "
                             f"limit is {self.max_len}; {TRUNCATE_HINT}"))
            return False
        return True

    def _load(self, entry: TenantEntry) -> dict:
        """A tenant's host weights, checked against its spec and the pools when read from disk;
        a Refusal otherwise."""
        try:
            return self.store.load(entry.name, check=lambda w: self.residency.check(entry, w))
        except TenantMissingError:
            raise Refusal(Kind.NOT_FOUND, "adapter_missing", f"tenant {entry.name!r} has no stored adapter") from None
        except ValueError as exc:
            log.error("adapter of tenant %r does not fit: %s", entry.name, exc)
            raise Refusal(Kind.FAILED, "adapter_unreadable", f"the stored adapter of tenant {entry.name!r} does not "
                          f"fit its spec: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a corrupt or truncated file fails its own tenant only
            log.error("adapter of tenant %r is unreadable: %s", entry.name, exc)
            raise Refusal(Kind.FAILED, "adapter_unreadable", f"the stored adapter of tenant {entry.name!r} cannot be "
                          "read; update or re-create the tenant") from None

    def _lookup_by_domain(self, rows: list, ids: np.ndarray, mask: np.ndarray, hidden: torch.Tensor) -> list[int]:
        """Writes each row's merged lower representation into ``hidden`` (B, T, H), one PLOT chain
        lookup per domain (a ``whole`` tenant's row: the root's embeddings, positions 0..T-1 and
        token type 0 as in ``hmi.model.root.full_forward``); returns the rows that succeeded (a
        domain whose PLOT cannot be read fails its own requests only)."""
        by_domain, whole = defaultdict(list), []
        for j, (_, e, *_) in enumerate(rows):
            (whole if e.whole else by_domain[e.domain]).append(j)
        ok = []
        if whole:
            ids_t = torch.from_numpy(ids[whole]).long()
            with torch.no_grad():
                hidden[whole] = self.embeddings(input_ids=ids_t, token_type_ids=torch.zeros_like(ids_t))
            ok += whole
        for domain, js in by_domain.items():
            try:
                hidden[js] = self.lookups.lookup_for(domain).merged(ids[js], mask[js])
            except Exception as exc:  # noqa: BLE001 - one domain's store fails its own tenants only
                log.error("PLOT lookup of domain %r failed: %s", domain, exc)
                err = Refusal(Kind.UNAVAILABLE, "domain_unavailable", f"the PLOT of domain {domain!r} cannot be read")
                for j in js:
                    fail(rows[j][0], err)
                continue
            ok += js
        return sorted(ok)

    # -- stages A and C --------------------------------------------------------------------------
