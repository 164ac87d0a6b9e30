"""What a server holds to serve decoder tenants: the decoder root, its causal root PLOT, the
generation engine in its own thread, and what fine-tune workers need to train decoder tenants."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from hmi.hgpt.generation import EngineConfig, GenerationEngine, GenerationService
from hmi.model.decoder import CausalLower, DecoderRoot
from hmi.model.root import weights_fingerprint
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.paths import open_root_store
from hmi.plot.pending import serving_store
from hmi.plot.store import PlotMeta, PlotStore

DEFAULT_RANK = 8


@dataclass
class WorkerDecoder:
    """A fine-tune worker's view of the decoder: the model and its calibrated windows in shared
    memory, and where its PLOT is (read as the server reads it, also while it is built)."""

    model: object
    tokenizer: object
    l_low: int
    windowed: object  # the calibrated window layers (nn.ModuleList)
    name: str
    plot_path: str
    plot_meta: PlotMeta
    miss_policy: str

    def root(self) -> DecoderRoot:
        return DecoderRoot(self.model, self.tokenizer, self.l_low, self.name, self.windowed)

    def lookup(self) -> PlotLookup:
        lower = CausalLower(self.root())
        store = serving_store(PlotStore(self.plot_path, readonly=True, expect=self.plot_meta), lower)
        return PlotLookup([PlotVersion("root", store, lower)], policy=self.miss_policy)


class HgptRuntime:
    """The decoder side of a server. ``load_tenant(name) -> (AdapterSpec, weights)`` reads the adapter store."""

    def __init__(self, root: DecoderRoot, store: PlotStore, load_tenant, miss_policy: str = "compute",
                 cfg: EngineConfig | None = None):
        self.root, self.store, self.miss_policy = root, store, miss_policy
        self.lookup = PlotLookup([PlotVersion("root", store, CausalLower(root))], policy=miss_policy)
        self.engine = GenerationEngine(root, self.lookup, load_tenant, cfg or EngineConfig(rank=DEFAULT_RANK))
        self.service = GenerationService(self.engine)

    @classmethod
    def open(cls, root: DecoderRoot, home: Path, load_tenant, device: str = "cpu") -> "HgptRuntime":
        """The runtime of a calibrated decoder root (``hmi.bootstrap.prepare_decoder``) over its
        causal root PLOT, complete or being built (then served as it will be, ``hmi.plot.pending``)."""
        store = serving_store(open_root_store(root, home), CausalLower(root))
        return cls(root, store, load_tenant, cfg=EngineConfig(rank=DEFAULT_RANK, device=device))

    @functools.cached_property
    def fingerprint(self) -> str:
        """The decoder's weights fingerprint (``hmi.model.root.weights_fingerprint``; about a second)."""
        return weights_fingerprint(self.root.model)

    @property
    def rank(self) -> int:
        return self.engine.cfg.rank

    def worker_view(self) -> WorkerDecoder:
        self.root.model.share_memory()
        self.root.window_layers.share_memory()
        return WorkerDecoder(self.root.model, self.root.tokenizer, self.root.l_low, self.root.window_layers,
                             self.root.name, str(self.store.path), self.store.meta, self.miss_policy)

    def forget(self, tenant: str) -> None:
        self.engine.pool.evict(tenant)

    def shutdown(self) -> None:
        self.service.shutdown()
