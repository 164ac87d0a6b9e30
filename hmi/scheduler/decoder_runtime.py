"""What a server holds to serve decoder tenants: the decoder root, its causal root PLOT, the
generation engine in its own thread, and what fine-tune workers need to train decoder tenants."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hmi.model.decoder import CausalLower, DecoderRoot
from hmi.plot.lookup import PlotLookup, PlotVersion
from hmi.plot.paths import ensure_root_plot, open_root_store
from hmi.plot.store import PlotMeta, PlotStore
from hmi.scheduler.generation import EngineConfig, GenerationEngine, GenerationService
from hmi.training.calibrate_decoder import DecoderCalibrationConfig, calibrate_and_save, load_calibrated_decoder

DEFAULT_L_LOW = 2
DEFAULT_RANK = 8


@dataclass
class WorkerDecoder:
    """A fine-tune worker's view of the decoder: the model in shared memory and where its PLOT is."""

    model: object
    tokenizer: object
    l_low: int
    plot_path: str
    plot_meta: PlotMeta
    miss_policy: str

    def root(self) -> DecoderRoot:
        return DecoderRoot(self.model, self.tokenizer, self.l_low)

    def lookup(self) -> PlotLookup:
        root = self.root()
        store = PlotStore(self.plot_path, readonly=True, expect=self.plot_meta)
        return PlotLookup([PlotVersion("root", store, CausalLower(root))], policy=self.miss_policy)


class HgptRuntime:
    """The decoder side of a server. ``load_tenant(name) -> (AdapterSpec, weights)`` reads the adapter store."""

    def __init__(self, root: DecoderRoot, store: PlotStore, load_tenant, miss_policy: str = "compute",
                 cfg: EngineConfig | None = None):
        self.root, self.store, self.miss_policy = root, store, miss_policy
        self.lookup = PlotLookup([PlotVersion("root", store, CausalLower(root))], policy=miss_policy)
        self.engine = GenerationEngine(root, self.lookup, load_tenant, cfg or EngineConfig(rank=DEFAULT_RANK))
        self.service = GenerationService(self.engine)

    @classmethod
    def load_default(cls, home: Path, load_tenant, l_low: int = DEFAULT_L_LOW, progress: bool = True,
                     device: str = "cpu") -> "HgptRuntime":
        root = load_calibrated_decoder(home)
        if root is None:
            print(f"calibrating the decoder's windowed lower layers (L_low = {l_low}; first start only, a few minutes)")
            root, _ = calibrate_and_save(home, l_low, DecoderCalibrationConfig(), progress=progress)
        ensure_root_plot(root, home=home, progress=progress)
        store = open_root_store(root, home)
        return cls(root, store, load_tenant, cfg=EngineConfig(rank=DEFAULT_RANK, device=device))

    @property
    def rank(self) -> int:
        return self.engine.cfg.rank

    def worker_view(self) -> WorkerDecoder:
        self.root.model.share_memory()
        return WorkerDecoder(self.root.model, self.root.tokenizer, self.root.l_low, str(self.store.path), self.store.meta,
                             self.miss_policy)

    def forget(self, tenant: str) -> None:
        self.engine.pool.evict(tenant)

    def shutdown(self) -> None:
        self.service.shutdown()
