"""The hPLM of docs/design.md, section 1: windowed lower layers, gate, merge, shared upper layers."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from transformers import BertModel

from hmi.model.root import attention_mask
from hmi.model.windows import encoder_windows, present_groups, unique_windows


class WindowedLower(nn.Module):
    """The root's embeddings and lower ``L_low`` layers run on length-3 windows, then gated.

    Each window is its own sequence with local positions 0, 1, 2, token type 0 and the
    attention mask ``id > 0`` (the centre always attended).  Output row k of a window is
    ``h_k * sigmoid(gate(h_k)) * mask_k``: the ``(3, H)`` block the PLOT stores.
    """

    def __init__(self, bert: BertModel, l_low: int):
        super().__init__()
        self.embeddings = copy.deepcopy(bert.embeddings)
        self.layers = nn.ModuleList(copy.deepcopy(bert.encoder.layer[i]) for i in range(l_low))
        hidden = bert.config.hidden_size
        self.gate = nn.Linear(hidden, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, 2.0)
        # An MPNet root's relative position bias, over the window's local positions (trained with the windows).
        self.relative_bias = copy.deepcopy(getattr(bert, "relative_bias", None))
        self.register_buffer("local_positions", torch.arange(3).unsqueeze(0), persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.gate.in_features

    def window_mask(self, windows: torch.Tensor) -> torch.Tensor:
        """Which tokens of each window exist (id > 0; the centre always). Shapes: (N, 3) -> (N, 3) bool."""
        mask = windows > 0
        mask[:, 1] = True
        return mask

    def states(self, windows: torch.Tensor, masked: bool | None = None) -> torch.Tensor:
        """The lower layers' output on each window as its own sequence (before the gate): what the
        full root computes for those three tokens alone.  Rows of absent tokens are not meaningful
        (:meth:`forward` zeroes them).

        Unless ``masked``, each window runs on its present tokens alone, at their local positions:
        without gradients the rows of :meth:`masked_states` up to the GEMM library's order of sums
        (the masked token's attention weight is exactly 0; the same bits with some kernels, as close
        to the fp64 result with all: tested), in about 0.84 of
        its time on a root PLOT's mix of tri-, bi- and uni-grams (``benchmarks/bench_plot_build.py``),
        about half on a calibration batch read with back-off (most windows are bi- and uni-grams).
        ``masked`` defaults to whether gradients are on: calibration recipes without
        ``present_tokens`` train on :meth:`masked_states`, whose sums the shipped artifacts hold.
        Shapes: windows (N, 3) int64 -> (N, 3, H).
        """
        if torch.is_grad_enabled() if masked is None else masked:
            return self.masked_states(windows)
        present = self.window_mask(windows)
        out = torch.zeros(windows.shape + (self.hidden_size,), dtype=self.gate.weight.dtype, device=windows.device)
        for rows, cols in present_groups(present.cpu().numpy()):
            rows, cols = torch.from_numpy(rows).to(windows.device), torch.from_numpy(cols).to(windows.device)
            sub = windows[rows][:, cols]
            positions = self.local_positions[:, cols].expand(len(rows), len(cols))
            out[rows[:, None], cols] = self._run(sub, positions, torch.ones_like(sub, dtype=torch.bool))
        return out

    def masked_states(self, windows: torch.Tensor) -> torch.Tensor:
        """Reference: every window as a length-3 sequence whose absent tokens are masked out of
        the attention. Shapes: windows (N, 3) int64 -> (N, 3, H)."""
        return self._run(windows, self.local_positions.expand(windows.shape[0], 3), self.window_mask(windows))

    def _run(self, windows: torch.Tensor, positions: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """Embeddings and layers on (N, k) tokens at ``positions`` (N, k), attending to the
        ``present`` (N, k) ones -> (N, k, H)."""
        h = self.embeddings(input_ids=windows, token_type_ids=torch.zeros_like(windows), position_ids=positions)
        ext = attention_mask(present.long(), h.dtype, self.relative_bias)
        for layer in self.layers:
            h = layer(h, attention_mask=ext)[0]
        return h

    def forward(self, windows: torch.Tensor, masked: bool | None = None) -> torch.Tensor:
        """Representations of windows (``masked``: as :meth:`states`).

        Semantics: rep[n] = gated lower-layer output of the sequence windows[n] (3 tokens), +0.0
        at absent tokens.
        Shapes: windows (N, 3) int64 -> rep (N, 3, H) float.
        """
        h = self.states(windows, masked)
        present = self.window_mask(windows).unsqueeze(-1)
        return torch.where(present, h * torch.sigmoid(self.gate(h)), 0.0)


class Merge(nn.Module):
    """Adds the three rows that describe each token, a global position and type embedding, then LayerNorm."""

    def __init__(self, bert: BertModel):
        super().__init__()
        emb = bert.embeddings
        self.position_embeddings = copy.deepcopy(emb.position_embeddings)
        self.token_type_embeddings = copy.deepcopy(emb.token_type_embeddings)
        self.LayerNorm = copy.deepcopy(emb.LayerNorm)

    def forward(self, reps: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Merge window representations into token inputs of the upper layers.

        Semantics: out[b, j] = LN(reps[b, j, 1] + reps[b, j+1, 0] + reps[b, j-1, 2]
                                  + pos[j] + type[token_type[b, j]]), out-of-range terms 0.
        Shapes: reps (B, T, 3, H) (zeros at padding) -> out (B, T, H) float32 (summed in float32).
        """
        s = reps[:, :, 1].to(torch.float32, copy=True)
        s[:, :-1] += reps[:, 1:, 0]
        s[:, 1:] += reps[:, :-1, 2]
        return self._finish(s, token_type_ids)

    def forward_unique(self, reps: torch.Tensor, inverse: torch.Tensor,
                       token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` fed with the distinct windows of a batch, without building the (B, T, 3, H)
        tensor: each of the three rows is gathered straight into place (the same sums in the same
        order, so the result is bitwise that of ``forward(reps[inverse])``).

        Shapes: reps (U, 3, H) (fp16 or fp32); inverse (B, T) int64, -1 at padding -> out (B, T, H) float32.
        The rows are gathered in the stored precision (``index_select``, far cheaper here than
        advanced indexing) and widened as they are added: a float16 value is exact in float32.
        """
        if reps.shape[0] == 0:  # a batch of padding alone
            reps = reps.new_zeros((1,) + reps.shape[1:])
        pad = inverse < 0
        idx = inverse.clamp(min=0)  # padding gathers row 0, then reads as zeros

        def rows(slot: int, at: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
            got = torch.index_select(reps[:, slot], 0, at.reshape(-1))
            got.index_fill_(0, padded.reshape(-1).nonzero().squeeze(1), 0)  # masked_fill_ is slow in fp16
            return got.view(at.shape + reps.shape[2:])

        s = rows(1, idx, pad).to(torch.float32)
        s[:, :-1] += rows(0, idx[:, 1:], pad[:, 1:])
        s[:, 1:] += rows(2, idx[:, :-1], pad[:, :-1])
        return self._finish(s, token_type_ids)

    def _finish(self, s: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """LN(s + pos[j] + type[token_type[b, j]]), adding in place into ``s`` (the caller's own
        sums); without ``token_type_ids`` every token's type is 0 (its row added as is, no lookup).
        Shapes: s (B, T, H) float32 -> (B, T, H)."""
        T = s.shape[1]
        s += self.position_embeddings.weight[:T].unsqueeze(0)
        s += self.token_type_embeddings.weight[0] if token_type_ids is None else self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(s)


class UpperLayers(nn.Module):
    """The root's upper layers, shared (the very same modules as the root's, not copies)."""

    def __init__(self, bert: BertModel, l_low: int):
        super().__init__()
        self.layers = nn.ModuleList(bert.encoder.layer[i] for i in range(l_low, bert.config.num_hidden_layers))
        self.relative_bias = getattr(bert, "relative_bias", None)  # the root's own (MPNet), shared

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Shapes: hidden (B, T, H); mask (B, T) {0,1} -> (B, T, H)."""
        ext = attention_mask(mask, hidden.dtype, self.relative_bias)
        for layer in self.layers:
            hidden = layer(hidden, ext)[0]  # positional: the adapters library hooks read args[1]
        return hidden


class WindowedEncoder(nn.Module):
    """The calibrated part of the root: windowed lower layers, gate and merge."""

    def __init__(self, bert: BertModel, l_low: int):
        super().__init__()
        self.l_low = l_low
        self.lower = WindowedLower(bert, l_low)
        self.merge = Merge(bert)

    def represent_batch(self, ids: torch.Tensor, mask: torch.Tensor, masked: bool | None = None) -> torch.Tensor:
        """Window representations of a padded batch, each distinct window computed once
        (``masked``: as :meth:`WindowedLower.states`).

        Shapes: ids (B, T); mask (B, T) -> reps (B, T, 3, H), zeros at padding.
        """
        win = encoder_windows(ids.cpu().numpy(), mask.cpu().numpy())
        uniq, inverse = unique_windows(win, mask.cpu().numpy())
        rep = self.lower(torch.from_numpy(uniq).to(ids.device), masked)
        out = rep.new_zeros(ids.shape + rep.shape[1:])
        real = torch.from_numpy(inverse >= 0).to(ids.device)
        out[real] = rep[torch.from_numpy(inverse[inverse >= 0]).to(ids.device)]
        return out

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, serve=None, served_once: bool = False,
                masked: bool | None = None) -> torch.Tensor:
        """Merged lower-layer output. Shapes: ids (B, T); mask (B, T) -> (B, T, H).

        ``serve`` (optional) maps the batch's distinct windows, (U, 3) int64, to the windows whose
        representation stands in for them, (U, 3): a PLOT's back-off (``hmi.plot.keys.served_keys``)
        computed directly, with gradients, for training on what serving reads.  With
        ``served_once`` each distinct served window is computed once (back-off maps many windows
        to one bi- or uni-gram): the same values, their gradients summed in one row.
        ``masked``: as :meth:`WindowedLower.states`."""
        if serve is None:
            return self.merge(self.represent_batch(ids, mask, masked))
        uniq, inverse = unique_windows(encoder_windows(ids.cpu().numpy(), mask.cpu().numpy()), mask.cpu().numpy())
        served = serve(uniq)
        if served_once:
            served, back = unique_windows(served[None], np.ones((1, len(served)), dtype=bool))
            inverse = np.where(inverse >= 0, back[0][inverse], -1)
        rep = self.lower(torch.from_numpy(served).to(ids.device), masked)
        return self.merge.forward_unique(rep, torch.from_numpy(inverse).to(ids.device))


class HPLM(nn.Module):
    """Root hPLM: windowed lower path (computed directly) + shared upper layers, no adapters."""

    def __init__(self, bert: BertModel, windowed: WindowedEncoder):
        super().__init__()
        self.windowed = windowed
        self.upper = UpperLayers(bert, windowed.l_low)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (merged lower output, final hidden states), each (B, T, H)."""
        merged = self.windowed(ids, mask)
        return merged, self.upper(merged, mask)


def as_numpy_ids(texts_ids: list[list[int]], max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pads lists of token ids into (ids, mask) arrays of shape (B, T)."""
    T = max(len(t) for t in texts_ids) if texts_ids else 0
    if max_len is not None:
        T = min(T, max_len)
    ids = np.zeros((len(texts_ids), T), dtype=np.int64)
    mask = np.zeros((len(texts_ids), T), dtype=np.int64)
    for b, t in enumerate(texts_ids):
        t = t[:T]
        ids[b, : len(t)] = t
        mask[b, : len(t)] = 1
    return ids, mask
