"""CPU kernels: fp32 linear layers through oneDNN instead of MKL, forward and backward.

ATen runs an fp32 ``nn.Linear`` on the CPU through MKL's SGEMM, which on AMD EPYC does not pick
its widest kernels: the upper layers' GEMM (1,024 x 384 by 384 x 1,536) runs at about 185 GFLOP/s
on two cores there, and at about 410 GFLOP/s through oneDNN's inner product, which torch ships
and dispatches by the CPU's instruction set (``benchmarks/bench_adapters.py`` measures both).
Results equal MKL's to fp32 rounding (about 2e-6 on these layers). The backward pass runs the
same kernel on the transposed operands, so fine-tune jobs and calibration gain as much as serving.

Other devices and dtypes run ``F.linear``; ``HMI_ONEDNN_LINEAR=0`` turns the reroute off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _inner_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product: x @ weight.T + bias. Shapes: x (..., in); weight (out, in) -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_available() -> bool:
    if os.environ.get("HMI_ONEDNN_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        # Fixed operands: the check must not draw from torch's global generator at import time.
        x = torch.linspace(-1.0, 1.0, 16).reshape(2, 8)
        w, b = torch.linspace(-0.5, 0.5, 32).reshape(4, 8), torch.linspace(0.0, 0.3, 4)
        y = _inner_product(x, w, b)
    except (AttributeError, RuntimeError):  # a torch built without the op
        return False
    return bool(torch.allclose(y, F.linear(x, w, b), atol=1e-5))


ONEDNN_LINEAR = _onednn_available()


class _OneDnnLinearFn(torch.autograd.Function):
    """y = x @ W.T + b with both passes on oneDNN: dx = dy @ W, dW = dy.T @ x, db = sum of dy."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _inner_product(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _inner_product(dy, weight.t(), None)
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = _inner_product(dy2.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with fp32 CPU tensors through oneDNN (differentiable once).

    Semantics: y = x @ weight.T + bias.
    Shapes: x (..., in); weight (out, in); bias (out,) or None -> (..., out).
    """
    if ONEDNN_LINEAR and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _OneDnnLinearFn.apply(x, weight, bias)
        return _inner_product(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDnnLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn_linear(model: nn.Module) -> nn.Module:
    """Switches every plain ``nn.Linear`` of ``model`` to :class:`OneDnnLinear`, in place.

    Subclasses (the ``adapters`` library's LoRA and IA3 layers) keep their own forward.
    Returns ``model``.
    """
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = OneDnnLinear
    return model
