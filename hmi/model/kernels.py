"""CPU kernels: fp32 linear layers through oneDNN instead of MKL, forward and backward.

ATen runs an fp32 ``nn.Linear`` on the CPU through MKL's SGEMM, which on AMD EPYC does not pick
its widest kernels: the upper layers' GEMM (1,024 x 384 by 384 x 1,536) runs at about 185 GFLOP/s
on two cores there, and at about 410 GFLOP/s through oneDNN's inner product, which torch ships
and dispatches by the CPU's instruction set (``benchmarks/bench_adapters.py`` measures both).
Results equal MKL's to fp32 rounding (about 2e-6 on these layers). The backward pass runs the
same kernel on the transposed operands, so fine-tune jobs and calibration gain as much as serving.

Other devices and dtypes run ``F.linear``; ``HMI_ONEDNN_LINEAR=0`` turns the reroute off.

Inside ``with bf16_matmuls():`` on a CPU that computes bf16 natively (``NATIVE_BF16``: AVX512_BF16
or AMX), the same layers multiply in bf16 with fp32 accumulation (oneDNN), forward and backward,
and return fp32: about twice the fp32 rate (``benchmarks/bench_calibration_step.py``).  Parameters,
optimizer state, the bias and everything outside the GEMMs stay fp32 (mixed precision, as
``torch.autocast`` does it).  Elsewhere the block changes nothing: bf16 emulated in fp32 units is
slower than fp32.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

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


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (the ``avx512_bf16`` or ``amx_bf16`` flag) and
    oneDNN may use it: ``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16 (as ``make test-avx2`` sets it)
    leaves oneDNN no bf16 inner product, so a small one is tried."""
    flags = cpu_flags()
    if not (ONEDNN_LINEAR and ("avx512_bf16" in flags or "amx_bf16" in flags)):
        return False
    try:
        x = torch.linspace(-1.0, 1.0, 16).reshape(2, 8).to(torch.bfloat16)
        _inner_product(x, torch.linspace(-0.5, 0.5, 32).reshape(4, 8).to(torch.bfloat16), None)
    except RuntimeError:  # "could not create a primitive descriptor": no bf16 kernel within the ISA allowed
        return False
    return True


NATIVE_BF16 = _native_bf16()


def bf16_unit(flags: set[str], native: bool, isa_cap: str | None) -> str | None:
    """Which unit multiplies the bf16 products: ``"AMX"`` (tiles: its own order of sums) where the CPU
    has AMX and oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``, ``None``: no cap) allows it, else
    ``"AVX512_BF16"`` (dot products in vector registers) where ``native``; ``None`` without native bf16.
    Runs in bf16 repeat bit for bit only on the same unit."""
    if not native:
        return None
    cap = (isa_cap or "ALL").upper()
    amx_allowed = cap in ("ALL", "DEFAULT") or "AMX" in cap
    return "AMX" if amx_allowed and {"amx_bf16", "amx_tile"} <= flags else "AVX512_BF16"


BF16_UNIT = bf16_unit(cpu_flags(), NATIVE_BF16,
                      os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"))
_BF16 = ContextVar("hmi_bf16_matmuls", default=False)


@contextmanager
def bf16_matmuls(enabled: bool = True):
    """Within the block (this thread), fp32 linear layers multiply in bf16 where ``NATIVE_BF16``.
    Yields whether they do."""
    token = _BF16.set(enabled and NATIVE_BF16)
    try:
        yield _BF16.get()
    finally:
        _BF16.reset(token)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bf16: bool) -> torch.Tensor:
    """x @ weight.T + bias in fp32, or with the GEMM in bf16 (fp32 accumulation, fp32 result, the
    bias added in fp32). Shapes: x (..., in); weight (out, in) -> (..., out)."""
    if not bf16:
        return _inner_product(x, weight, bias)
    y = _inner_product(x.to(torch.bfloat16), weight.to(torch.bfloat16), None).float()  # no copy if bf16 already
    return y if bias is None else y.add_(bias)


class _OneDnnLinearFn(torch.autograd.Function):
    """y = x @ W.T + b with both passes on oneDNN: dx = dy @ W, dW = dy.T @ x, db = sum of dy.
    With ``bf16``, x and W are rounded to bf16 once, in the forward pass, and kept so for the
    backward one (half the memory, no second rounding); dy is rounded once."""

    @staticmethod
    def forward(ctx, x, weight, bias, bf16):
        if bf16:
            x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.bf16 = bias is not None, bf16
        return _product(x, weight, bias, bf16)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        g = dy.to(torch.bfloat16) if ctx.bf16 else dy
        if ctx.needs_input_grad[0]:
            dx = _product(g, weight.t(), None, ctx.bf16)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = _product(g2.t(), x.reshape(-1, x.shape[-1]).t(), None, ctx.bf16)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dw, db, None


def _rounded(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in bf16 for products without gradients (serving): rounded once and the copy kept
    on the tensor until it changes (its storage or version), not at every call."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, "_hmi_bf16", None)
    if cached is None or cached[0] != key:
        cached = (key, weight.detach().to(torch.bfloat16))
        weight._hmi_bf16 = cached  # a Python attribute: outside any state dict
    return cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with fp32 CPU tensors through oneDNN (differentiable once; in bf16 inside
    ``bf16_matmuls()`` where the CPU has it, a weight used without gradients rounded once).

    Semantics: y = x @ weight.T + bias.
    Shapes: x (..., in); weight (out, in); bias (out,) or None -> (..., out).
    """
    if ONEDNN_LINEAR and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        bf16 = _BF16.get()
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _OneDnnLinearFn.apply(x, weight, bias, bf16)
        return _product(x, _rounded(weight) if bf16 else weight, bias, bf16)
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
