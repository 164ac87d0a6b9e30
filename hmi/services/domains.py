"""The domains of one serving process: the version tree's branches listed, created, updated and
deleted (their PLOTs are built by jobs), and each domain's PLOT lookup, opened once and kept
until the domain changes (the scheduler's ``hmi.scheduler.types.LookupSource``)."""

from __future__ import annotations

from hmi.errors import Kind, Refusal
from hmi.services.registry import UNFINISHED
from hmi.version_tree.tree import MIN_CORPUS_TOKENS, DomainError


class Domains:
    """``tree``: the version tree; ``root_lookup``: the root PLOT's lookup (its miss policy and
    keeper are every domain's); ``jobs``: the job manager that builds branches."""

    def __init__(self, tree, root_lookup, registry, jobs, root_artifact: str):
        self.tree, self.root_lookup, self.registry, self.jobs = tree, root_lookup, registry, jobs
        self.root_artifact = root_artifact
        self._lookups: dict[str, object] = {"root": root_lookup}

    # -- lookups ---------------------------------------------------------------------------------
    def lookup_for(self, domain: str):
        """The PLOT lookup of a domain's chain, opened once and kept until the domain changes."""
        lk = self._lookups.get(domain)
        if lk is None:
            lk = self._lookups[domain] = self.tree.lookup(domain, self.root_lookup.policy, self.root_lookup.keeper)
        return lk

    def lookups(self) -> dict:
        """The PLOT lookups opened so far, by domain (the root's always)."""
        return dict(self._lookups)

    def changed(self, name: str) -> None:
        """A domain was rebuilt or deleted: every branch's lookup is opened afresh on next use."""
        for d in list(self._lookups):
            if d != "root":
                del self._lookups[d]
        self.tree.forget(name)

    # -- the tree --------------------------------------------------------------------------------
    async def listing(self) -> list[dict]:
        """Every domain with its parent, depth, PLOT statistics and the number of its tenants."""
        counts: dict[str, int] = {}
        for _, r in await self.registry.aitems("tenants"):
            counts[r.get("domain", "root")] = counts.get(r.get("domain", "root"), 0) + 1
        out = []
        for d in self.tree.listing():
            if d["name"] == "root":
                d = {"name": "root", "parent": None, "depth": 0, "root_artifact": self.root_artifact, "alpha": 1.0,
                     "plot": self.root_lookup.chain[0].store.get_record("stats") or {}}
            out.append({**d, "tenants": counts.get(d["name"], 0)})
        return out

    async def get(self, name: str) -> dict:
        for d in await self.listing():
            if d["name"] == name:
                return d
        raise Refusal(Kind.NOT_FOUND, "unknown_domain", f"no domain {name!r}")

    @staticmethod
    def check_name(name) -> None:
        """Refuses the name of the tree's root for a new branch."""
        if name == "root":
            raise Refusal(Kind.INVALID, "invalid_name", "'root' is the root of every domain tree; choose another name")

    async def create(self, name: str, parent: str, text: dict, **job) -> str:
        """Queues the job that builds branch ``name`` under ``parent`` from ``text`` (the keywords
        of ``corpus_data``); returns its id."""
        self.check_name(name)
        if name in self.tree.nodes() or await self._pending(name):
            raise Refusal(Kind.CONFLICT, "domain_exists", f"domain {name!r} already exists or is being created")
        if parent != "root" and parent not in self.tree.nodes():
            raise Refusal(Kind.NOT_FOUND, "unknown_domain", f"no parent domain {parent!r}")
        data = corpus_data(**text)
        self.jobs.require_room()
        return self.jobs.submit("domain-create", None, None, data, domain=name, parent=parent, **job)

    async def check_updatable(self, name: str) -> None:
        """Refuses an update of a domain that does not exist (the root among them) or has a job running."""
        if name not in self.tree.nodes():
            hint = " (the root is not updated)" if name == "root" else ""
            raise Refusal(Kind.NOT_FOUND, "unknown_domain", f"no domain {name!r}{hint}")
        if await self._pending(name):
            raise Refusal(Kind.CONFLICT, "domain_busy", f"domain {name!r} has a job running")

    async def update(self, name: str, text: dict, **job) -> str:
        """Queues the job that rebuilds branch ``name`` from ``text`` (as ``create``); returns its id."""
        await self.check_updatable(name)
        data = corpus_data(**text)
        self.jobs.require_room()
        return self.jobs.submit("domain-update", None, None, data, domain=name, **job)

    async def delete(self, name: str) -> None:
        """Deletes a branch no tenant uses and that has no children."""
        if name not in self.tree.nodes():
            raise Refusal(Kind.NOT_FOUND, "unknown_domain", f"no domain {name!r}")
        in_use = {r.get("domain") for _, r in await self.registry.aitems("tenants")}
        try:
            self.tree.delete(name, in_use)
        except DomainError as exc:
            raise Refusal(Kind.CONFLICT, "domain_in_use", str(exc)) from None
        self.changed(name)

    async def _pending(self, name: str) -> bool:
        return any(j.get("domain") == name and j["kind"].startswith("domain") and j["state"] in UNFINISHED
                   for _, j in await self.registry.aitems("jobs"))


def corpus_data(corpus_name: str | None, max_lines: int | None, corpus: list[str] | None) -> dict:
    """A domain's text: a prepared corpus by name, or lines (``UNPROCESSABLE`` when too few words
    for a domain)."""
    if corpus_name is not None:
        return {"corpus_name": corpus_name, "max_lines": max_lines, "lines": None}
    lines = [x.strip() for x in corpus if x.strip()]
    words = sum(len(x.split()) for x in lines)
    if words < MIN_CORPUS_TOKENS // 2:
        raise Refusal(Kind.UNPROCESSABLE, "corpus_too_small", f"the corpus has {words} words; a domain needs about "
                      f"{MIN_CORPUS_TOKENS} tokens (see docs)")
    return {"lines": lines}
