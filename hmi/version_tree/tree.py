"""Domain nodes, persisted atomically, with their weights, corpus and PLOT.

Layout under ``$HMI_HOME/domains/<root artifact>/``: ``tree.json`` (every node record, replaced
atomically) and per branch one folder per version, ``<name>/<version>/`` (``windowed.safetensors``,
``corpus.txt``, ``plot/``).  A version is built in a hidden ``.building-*`` folder, renamed into
place when complete, and served once ``tree.json`` names it: creating or replacing a branch is
one atomic rename of ``tree.json``, so a crash leaves the old version or the new, never neither.
``tree.json`` is changed read-modify-write under an exclusive file lock, shared by the server and
its worker processes, so a concurrent delete is never undone by an update that read before it.
Opened PLOTs are never closed under readers: a replaced version's store is dropped from the cache
and closes when the last lookup that holds it is gone (its files may be unlinked before that).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save

from hmi.home import hmi_home
from hmi.io import atomic_write_json, fsync_dir, write_durable
from hmi.model.artifact import Root
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import weights_fingerprint
from hmi.names import is_valid_name
from hmi.plot.build import Selection, build, count_ngrams, plan_keys, tokenize_corpus
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.paths import open_root_version, plot_meta
from hmi.plot.store import PlotStore
from hmi.training.further_pretrain import FPTConfig, further_pretrain

MIN_CORPUS_TOKENS = 20_000  # below this, neither FPT nor tri-gram frequencies are meaningful


class DomainError(ValueError):
    """A domain operation that cannot be done, with the reason."""


@dataclass
class DomainNode:
    name: str
    parent: str
    root_artifact: str
    alpha: float
    corpus: dict = field(default_factory=dict)  # lines, tokens, trigram occurrences, distinct trigrams
    plot: dict = field(default_factory=dict)  # PLOT statistics
    fpt: dict = field(default_factory=dict)  # objective, its measures before/after (further_pretrain.summary), steps, seconds
    created: float = 0.0
    updated: float = 0.0
    version: str = ""  # the folder under <name>/ served now ("" : the files lie in <name>/ itself)


class VersionTree:
    def __init__(self, root: Root, home: Path | None = None, root_version: PlotVersion | None = None,
                 writable: bool = False):
        """``writable``: the branches' PLOTs are opened writable, for the miss policy
        ``compute+insert`` (it keeps misses in them: ``hmi.plot.kept``)."""
        self.root = root
        self.writable = writable
        self.home = home or hmi_home()
        self.dir = self.home / "domains" / root.artifact_id
        self.dir.mkdir(parents=True, exist_ok=True)
        # LMDB allows one open environment per file and process: each version is opened once here,
        # keyed by name and version folder so that a replaced version is never served from cache.
        self._versions: dict[tuple[str, str], PlotVersion] = {("root", ""): root_version} if root_version else {}
        self._clean()

    # -- persistence ---------------------------------------------------------------------------
    def nodes(self) -> dict[str, DomainNode]:
        p = self.dir / "tree.json"
        raw = json.loads(p.read_text()) if p.exists() else {}
        return {k: DomainNode(**v) for k, v in raw.items()}

    def node_dir(self, node: DomainNode) -> Path:
        return self.dir / node.name / node.version if node.version else self.dir / node.name

    def _locked(self):
        """An exclusive lock on the tree's records, across threads and processes (flock)."""
        return _FileLock(self.dir / "tree.lock")

    def _save(self, nodes: dict[str, DomainNode]) -> None:
        atomic_write_json(self.dir / "tree.json", {k: asdict(v) for k, v in nodes.items()})

    def _clean(self) -> None:
        """Removes what crashed builds left: ``.building-*`` folders of processes that are gone,
        ``.old-*`` folders, and branch or version folders that no record names (older than a
        minute, so a build between its rename and its record is left alone)."""
        with self._locked():
            nodes = self.nodes()
            for p in self.dir.iterdir():
                if not p.is_dir():
                    continue
                if p.name.startswith(".building-"):
                    if not _pid_alive(p.name.rsplit("-", 2)[-2]):
                        shutil.rmtree(p, ignore_errors=True)
                elif p.name.startswith(".old-"):
                    shutil.rmtree(p, ignore_errors=True)
                elif p.name not in nodes:
                    if _stale(p):
                        shutil.rmtree(p, ignore_errors=True)
                else:
                    for v in p.iterdir():
                        if v.is_dir() and v.name not in (nodes[p.name].version, "plot") and _stale(v):
                            shutil.rmtree(v, ignore_errors=True)

    # -- queries -------------------------------------------------------------------------------
    def chain(self, name: str) -> list[str]:
        """``[name, parent, ..., "root"]``."""
        nodes, out = self.nodes(), []
        while name != "root":
            if name not in nodes:
                raise DomainError(f"unknown domain {name!r}")
            out.append(name)
            name = nodes[name].parent
        return out + ["root"]

    def encoder(self, name: str) -> WindowedEncoder:
        if name == "root":
            return self.root.windowed
        node = self.nodes().get(name)
        if node is None:
            raise DomainError(f"unknown domain {name!r}")
        enc = WindowedEncoder(self.root.bert, self.root.spec.l_low)
        enc.load_state_dict(load_file(str(self.node_dir(node) / "windowed.safetensors")))
        enc.eval()
        for p in enc.parameters():
            p.requires_grad_(False)
        return enc

    def version(self, name: str) -> PlotVersion:
        """The opened PLOT version of a node's current version (opened once per tree)."""
        if name == "root":
            if ("root", "") not in self._versions:
                self._versions[("root", "")] = open_root_version(self.root, self.home)
            return self._versions[("root", "")]
        node = self.nodes().get(name)
        if node is None:
            raise DomainError(f"unknown domain {name!r}")
        key = (name, node.version)
        if key not in self._versions:
            self.forget(name)
            store = PlotStore(self.node_dir(node) / "plot", readonly=not self.writable, expect=plot_meta(self.root))
            self._versions[key] = PlotVersion(name, store, self.encoder(name))
        return self._versions[key]

    def forget(self, name: str) -> None:
        """Drops a branch's opened PLOT versions from the cache (after an update or delete).  They are
        not closed here: a lookup still reading one keeps it open, and it closes with the last one."""
        if name != "root":
            for key in [k for k in self._versions if k[0] == name]:
                del self._versions[key]

    def close(self) -> None:
        """Closes every opened PLOT version (the server's shutdown)."""
        for version in self._versions.values():
            version.store.close()
        self._versions.clear()

    def lookup(self, name: str, policy: str = "backoff", keeper=None) -> PlotLookup:
        """Lookup along the domain's chain: the branch, its ancestors, the root, then back-off
        (``keeper``: ``PlotLookup``'s)."""
        return PlotLookup([self.version(n) for n in self.chain(name)], policy=policy, keeper=keeper)

    def listing(self) -> list[dict]:
        nodes = self.nodes()
        out = [{"name": "root", "parent": None, "depth": 0}]

        def walk(parent, depth):
            for n in sorted(k for k, v in nodes.items() if v.parent == parent):
                d = asdict(nodes[n])
                d["depth"] = depth
                d["bytes"] = sum(f.stat().st_size for f in self.node_dir(nodes[n]).rglob("*") if f.is_file())
                out.append(d)
                walk(n, depth + 1)

        walk("root", 1)
        return out

    # -- changes -------------------------------------------------------------------------------
    def create(self, name: str, parent: str, lines: list[str], alpha: float = 0.5, fpt: FPTConfig | None = None,
               progress: bool = True, should_stop=None, on_progress=None, checkpoint: Path | None = None) -> DomainNode:
        """A new branch under ``parent``: its lower side further pretrained on ``lines`` (continued
        from ``checkpoint`` when an earlier, stopped call of the same job left one there), its PLOT
        built, then published."""
        if not is_valid_name(name) or name == "root":
            raise DomainError(f"invalid domain name {name!r}: 1-63 characters a-z, 0-9, '_' or '-' (not 'root')")
        if name in self.nodes():
            raise DomainError(f"domain {name!r} already exists")
        if parent != "root" and parent not in self.nodes():
            raise DomainError(f"unknown parent domain {parent!r}")
        if not 0.0 <= alpha <= 1.0:
            raise DomainError(f"alpha must lie in [0, 1], got {alpha}")
        work = self._work_dir(name)
        try:
            encoder = copy.deepcopy(self.encoder(parent))
            node = build_branch(self.root, work, name, parent, encoder, lines, alpha, fpt or FPTConfig(), progress, should_stop,
                               on_progress=on_progress, checkpoint=checkpoint)
            self._place(work, node)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        with self._locked():
            nodes = self.nodes()
            if name in nodes or (parent != "root" and parent not in nodes):
                self._discard(node)
                why = "was created meanwhile" if name in nodes else f"lost its parent {parent!r} meanwhile"
                raise DomainError(f"domain {name!r} {why}")
            nodes[name] = node
            self._save(nodes)
        return node

    def update(self, name: str, lines: list[str], fpt: FPTConfig | None = None, progress: bool = True,
               should_stop=None, on_progress=None, checkpoint: Path | None = None) -> DomainNode:
        """Continues FPT on more corpus, re-counts over all of the domain's corpus, refreshes the PLOT
        (``checkpoint`` as for ``create``)."""
        nodes = self.nodes()
        if name not in nodes:
            raise DomainError(f"unknown domain {name!r}")
        node = nodes[name]
        old = (self.node_dir(node) / "corpus.txt").read_text().splitlines()
        work = self._work_dir(name)
        try:
            new = build_branch(self.root, work, name, node.parent, self.encoder(name), old + list(lines), node.alpha,
                              fpt or FPTConfig(), progress, should_stop, fpt_lines=list(lines),
                              on_progress=on_progress, checkpoint=checkpoint)
            new.created = node.created
            self._place(work, new)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        with self._locked():
            nodes = self.nodes()
            if name not in nodes:  # deleted while this update ran: the delete stands
                self._discard(new)
                raise DomainError(f"domain {name!r} was deleted while it was being updated")
            previous = nodes[name]
            nodes[name] = new
            self._save(nodes)
        self.forget(name)
        self._drop_version(previous)
        return new

    def delete(self, name: str, in_use: set[str] = frozenset()) -> None:
        with self._locked():
            nodes = self.nodes()
            if name not in nodes:
                raise DomainError(f"unknown domain {name!r}")
            children = [k for k, v in nodes.items() if v.parent == name]
            if children:
                raise DomainError(f"domain {name!r} has child domains {children}; delete them first")
            if name in in_use:
                raise DomainError(f"domain {name!r} is used by tenants; delete or move them first")
            del nodes[name]
            self._save(nodes)
            trash = self.dir / f".old-{name}-{uuid.uuid4().hex[:8]}"
            if (self.dir / name).exists():
                os.rename(self.dir / name, trash)
        self.forget(name)
        shutil.rmtree(trash, ignore_errors=True)

    def _place(self, work: Path, node: DomainNode) -> None:
        """Moves a finished build to its version folder (flushed), not yet named by any record."""
        node.version = f"v{uuid.uuid4().hex[:12]}"
        (self.dir / node.name).mkdir(exist_ok=True)
        fsync_dir(work)
        os.rename(work, self.node_dir(node))
        fsync_dir(self.dir / node.name)

    def _discard(self, node: DomainNode) -> None:
        """Removes a placed version that will never be named (and its branch folder if now empty)."""
        shutil.rmtree(self.node_dir(node), ignore_errors=True)
        base = self.dir / node.name
        if base.exists() and not any(base.iterdir()):
            base.rmdir()

    def _drop_version(self, node: DomainNode) -> None:
        """Removes a version that no record names any more."""
        if node.version:
            shutil.rmtree(self.node_dir(node), ignore_errors=True)
        else:  # a branch stored before versions existed: its files lie in <name>/ itself
            base = self.dir / node.name
            for f in ("windowed.safetensors", "corpus.txt"):
                (base / f).unlink(missing_ok=True)
            shutil.rmtree(base / "plot", ignore_errors=True)

    def resume_checkpoint(self, verb: str, name: str) -> Path:
        """Where a local ``verb`` ("create", "update") of ``name`` (``hmi domain``) keeps its
        distillation checkpoint and, beside it, its PLOT build until it ends (``create``'s
        ``checkpoint``): under ``calibration/``, the resumable work that backups leave out."""
        return self.home / "calibration" / "domains" / self.root.artifact_id / f"{verb}-{name}.ckpt"

    def _work_dir(self, name: str) -> Path:
        work = self.dir / f".building-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        work.mkdir()
        return work



def build_branch(root: Root, work: Path, name: str, parent: str, encoder: WindowedEncoder, lines: list[str],
                 alpha: float, fpt: FPTConfig, progress: bool, should_stop, fpt_lines: list[str] | None = None,
                 on_progress=None, checkpoint: Path | None = None) -> DomainNode:
    """Further-pretrains ``encoder`` (a branch of ``root``) on the corpus and builds the branch's PLOT into ``work``;
    ``on_progress(fraction, info)`` hears the pretraining (``info["stage"]`` "further
    pretraining") and then the PLOT build ("building the branch's PLOT"), each from 0 to 1."""
    lines = [x.strip() for x in lines if x and x.strip()]
    tok = root.tokenizer
    token_lists = tokenize_corpus(tok, lines, fpt.max_len, progress=False)
    n_tokens = sum(len(t) - 2 for t in token_lists)
    if n_tokens < MIN_CORPUS_TOKENS:
        raise DomainError(f"the corpus has {n_tokens} tokens; a domain needs at least {MIN_CORPUS_TOKENS}")
    fpt_metrics = further_pretrain(root, encoder, fpt_lines or lines, fpt,
                                   progress=progress, should_stop=should_stop,
                                   on_progress=None if on_progress is None else
                                   lambda f, info: on_progress(f, {**info, "stage": "further pretraining"}),
                                   checkpoint=checkpoint)
    write_durable(work / "windowed.safetensors", save({k: v.contiguous() for k, v in encoder.state_dict().items()}))
    write_durable(work / "corpus.txt", ("\n".join(lines) + "\n").encode())
    keys, counts = count_ngrams(token_lists)
    # A branch stores its top tri-grams and its own back-off entries (the bi-grams of its corpus,
    # every uni-gram): a text of the domain is read by the branch's lower side alone wherever
    # the branch's corpus and back-off reach, as its further pretraining read it.
    plan = plan_keys(keys, counts, Selection("alpha", alpha=alpha), len(tok), with_backoff=True)
    # A job that keeps a checkpoint builds beside it, so that a stopped build goes on where it
    # stopped when the job runs again (the encoder's fingerprint keeps another run's values out).
    built = work / "plot" if checkpoint is None else kept_plot_dir(checkpoint)
    store = PlotStore(built, meta=plot_meta(root), readonly=False)
    try:
        summary = build(store, encoder, plan, progress=progress, desc=f"PLOT {name}",
                        on_progress=None if on_progress is None else
                        lambda f, info: on_progress(f, {**info, "stage": "building the branch's PLOT"}),
                        weights=weights_fingerprint(encoder))
        stats = store.stats()
    finally:
        store.close()
    if built != work / "plot":
        shutil.move(built, work / "plot")  # a rename where both lie on one filesystem
    covered = float(counts[np.isin(keys, plan)].sum() / max(1, counts.sum()))
    now = time.time()
    return DomainNode(name, parent, root.artifact_id, alpha,
                      corpus={"lines": len(lines), "tokens": n_tokens, "trigram_occurrences": int(counts.sum()),
                              "distinct_trigrams": int(len(keys)), "covered_occurrences": round(covered, 4)},
                      plot={**stats, "build_seconds": summary["seconds"], "resumed_from": summary["resumed_from"]},
                      fpt=fpt_metrics, created=now, updated=now)


def kept_plot_dir(checkpoint: Path) -> Path:
    """Where a branch job that keeps its distillation checkpoint at ``checkpoint`` builds its PLOT
    (beside it, outside the tree's ``.building-*`` folders that go with their process), moved into
    the new version when complete."""
    return checkpoint.with_name(checkpoint.name + ".plot")


def forget_checkpoint(checkpoint: Path) -> None:
    """Removes what a branch job kept to resume from: its distillation checkpoint and its PLOT
    build beside it (``kept_plot_dir``); either may be absent."""
    checkpoint.unlink(missing_ok=True)
    shutil.rmtree(kept_plot_dir(checkpoint), ignore_errors=True)


class _FileLock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        return False


def _stale(p: Path, age_s: float = 60.0) -> bool:
    return time.time() - p.stat().st_mtime > age_s


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
