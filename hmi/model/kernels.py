"""Inference kernels: fp32 linear layers on the CPU through oneDNN instead of MKL.

ATen runs an fp32 ``nn.Linear`` on the CPU through MKL's SGEMM, which on AMD EPYC does not pick
its widest kernels: the upper layers' GEMM (1,024 x 384 by 384 x 1,536) runs at about 185 GFLOP/s
on two cores there, and at about 410 GFLOP/s through oneDNN's inner product, which torch ships
and dispatches by the CPU's instruction set (``benchmarks/bench_adapters.py`` measures both).
Results equal MKL's to fp32 rounding (about 2e-6 on these layers).

Only the inference path is rerouted: the oneDNN op has no backward, so whenever autograd records
(a fine-tune job), the layer runs ``F.linear``. ``HMI_ONEDNN_LINEAR=0`` turns the reroute off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_available() -> bool:
    if os.environ.get("HMI_ONEDNN_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except (AttributeError, RuntimeError):  # a torch built without the op
        return False
    return bool(torch.allclose(y, F.linear(x, w, b), atol=1e-5))


ONEDNN_LINEAR = _onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with fp32 CPU inference through oneDNN.

    Semantics: y = x @ weight.T + bias.
    Shapes: x (..., in); weight (out, in); bias (out,) or None -> (..., out).
    """
    if (ONEDNN_LINEAR and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class InferenceLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_inference_kernels(model: nn.Module) -> nn.Module:
    """Switches every plain ``nn.Linear`` of ``model`` to :class:`InferenceLinear`, in place.

    Subclasses (the ``adapters`` library's LoRA and IA3 layers) keep their own forward.
    Returns ``model``.
    """
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = InferenceLinear
    return model
