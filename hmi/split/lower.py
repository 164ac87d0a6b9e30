"""The lower layers on a private tenant's own side, so that no token id leaves it.

The server's PLOT holds, for each tri-gram window, what the root artifact's windowed lower
layers give it, stored as float16 (``hmi.plot.build``); a miss the server computes (its
``compute`` policy) is rounded the same way.  ``LocalLower`` computes every window of a batch
that way here, from the public root and its calibrated artifact (the package ships the default
root's), and merges them as the server's lookup does (``Merge.forward_unique``).  So the upper
layers' input equals what a server answering every window exactly would send; against a server
that backs off on misses (``backoff``, ``learned``), it is the exact windows' input instead,
which the accuracy pages measure as the better one.

Cost: every distinct window of a request runs through the ``l_low`` lower layers on three
tokens, here, on each request: no PLOT is kept on this side.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hmi.model.artifact import ArtifactMissingError, find_shipped, load_windowed
from hmi.model.hplm import WindowedEncoder
from hmi.model.root import load_bert
from hmi.model.windows import encoder_windows, unique_windows


class LocalLower:
    """The upper layers' input computed here: ``merged(ids, mask)``, as ``PlotLookup.merged``
    reads it, for a PLOT lookup that computes every window (``compute``)."""

    def __init__(self, windowed: WindowedEncoder):
        self.windowed = windowed.eval()

    @classmethod
    def load(cls, model_dir: str | Path, l_low: int, artifact: str | Path | None = None) -> LocalLower:
        """The windowed lower layers of the root checkpoint in ``model_dir`` split at ``l_low``,
        calibrated by the artifact folder ``artifact`` (``config.json`` and
        ``windowed.safetensors``, as ``hmi calibrate`` writes under ``HMI_HOME/roots``); by
        default the one the package ships for that root."""
        bert = load_bert(str(model_dir))
        folder = Path(artifact) if artifact is not None else find_shipped(bert, l_low)
        if folder is None:
            raise ArtifactMissingError(f"no calibrated artifact ships for the root in {model_dir} split at {l_low}: "
                                       "give the artifact folder the server serves (HMI_HOME/roots/<id>)")
        config = json.loads((folder / "config.json").read_text())
        if config.get("l_low", l_low) != l_low:
            raise ValueError(f"the artifact {folder.name} splits at {config['l_low']}, not {l_low}")
        return cls(load_windowed(folder, config, bert, l_low))

    @torch.no_grad()
    def merged(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """The upper layers' input for a batch: each distinct window's states (float16, as a
        PLOT stores them), merged.  Shapes: ids, mask (B, T) -> (B, T, H) float32."""
        ids, mask = np.asarray(ids), np.asarray(mask)
        uniq, inverse = unique_windows(encoder_windows(ids, mask), mask)
        reps = self.windowed.lower(torch.from_numpy(uniq)).to(torch.float16)
        return self.windowed.merge.forward_unique(reps, torch.from_numpy(inverse))
