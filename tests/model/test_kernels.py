import copy
import os

import pytest
import torch
from torch import nn

from hmi.model import kernels
from hmi.model.kernels import OneDnnLinear, linear, use_onednn_linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 24), (3, 7, 24), (0, 24)])
def test_onednn_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g) if bias else None
    with torch.no_grad():
        y = linear(x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_onednn_linear_reads_non_contiguous_input():
    x = torch.randn(7, 3, 24).transpose(0, 1)
    w = torch.randn(16, 24)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w, None), x @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trainable_weight", [True, False])
def test_gradients_through_the_onednn_linear_equal_f_linear(trainable_weight):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 9, 24, generator=g)
    w0, b0 = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    dy = torch.randn(4, 9, 40, generator=g)
    grads = []
    for fn in (linear, torch.nn.functional.linear):
        x, w, b = (t.clone().requires_grad_(trainable_weight or t is x0) for t in (x0, w0, b0))
        fn(x, w, b).backward(dy)
        grads.append((x.grad, w.grad, b.grad))
    (gx, gw, gb), (rx, rw, rb) = grads
    torch.testing.assert_close(gx, rx, atol=1e-4, rtol=1e-5)
    if trainable_weight:
        torch.testing.assert_close(gw, rw, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(gb, rb, atol=1e-4, rtol=1e-5)
    else:
        assert gw is None and gb is None


def test_a_switched_model_trains_like_the_original():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    model = use_onednn_linear(copy.deepcopy(ref))
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_use_onednn_linear_switches_plain_linears_only_and_keeps_weights():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Sequential(nn.Linear(4, 2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    use_onednn_linear(model)
    assert type(model[0]) is OneDnnLinear and type(model[2][0]) is OneDnnLinear
    assert type(model[1]) is Custom
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_switching_the_kernel_off_gives_aten_results(monkeypatch):
    monkeypatch.setattr(kernels, "ONEDNN_LINEAR", False)
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(linear(x, w, None), torch.nn.functional.linear(x, w, None))


def _bf16_reference(x, w, b):
    """The slow reference of a bf16 GEMM: the operands rounded to bf16, multiplied in fp64, the
    product rounded to bf16 (oneDNN's output type), the bias added in fp32."""
    y = (x.bfloat16().double() @ w.bfloat16().double().t()).bfloat16().float()
    return y if b is None else y + b


@pytest.mark.skipif(not kernels.NATIVE_BF16, reason="the CPU has no native bf16: bf16_matmuls() changes nothing")
def test_bf16_matmuls_equal_the_rounded_reference_forward_and_backward():
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 9, 96, generator=g)
    w0, b0 = torch.randn(40, 96, generator=g) / 10, torch.randn(40, generator=g)
    dy = torch.randn(4, 9, 40, generator=g)
    x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
    with kernels.bf16_matmuls() as on:
        y = linear(x, w, b)
        assert on and y.dtype == torch.float32
        with torch.no_grad():
            assert torch.equal(linear(x0, w0, b0), y.detach())  # the inference path multiplies the same way
    y.backward(dy)
    scale = lambda t: {"atol": 4e-3 * float(t.abs().max()), "rtol": 0}  # one bf16 rounding of the largest value
    ref = _bf16_reference(x0, w0, b0)
    torch.testing.assert_close(y.detach(), ref, **scale(ref))
    assert not torch.equal(y.detach(), torch.nn.functional.linear(x0, w0, b0))  # bf16, not fp32
    gx = _bf16_reference(dy, w0.t(), None)
    gw = _bf16_reference(dy.reshape(-1, 40).t(), x0.reshape(-1, 96).t(), None)
    torch.testing.assert_close(x.grad, gx, **scale(gx))
    torch.testing.assert_close(w.grad, gw, **scale(gw))
    torch.testing.assert_close(b.grad, dy.reshape(-1, 40).sum(0), atol=1e-5, rtol=1e-5)  # the bias stays fp32


def test_outside_bf16_matmuls_or_without_native_bf16_the_linear_is_fp32_bit_for_bit(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(6, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    with torch.no_grad():
        fp32 = linear(x, w, b)
        with kernels.bf16_matmuls(enabled=False):
            assert torch.equal(linear(x, w, b), fp32)
        monkeypatch.setattr(kernels, "NATIVE_BF16", False)
        with kernels.bf16_matmuls() as on:
            assert not on and torch.equal(linear(x, w, b), fp32)
    torch.testing.assert_close(fp32, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not kernels.NATIVE_BF16, reason="the CPU has no native bf16: bf16_matmuls() changes nothing")
def test_a_linear_serving_in_bf16_rounds_its_weight_again_once_the_weight_changes():
    """Inference in bf16 keeps the weight's bf16 copy between calls; a changed weight (in place,
    as an optimizer step, or a new tensor) is rounded again, so the products follow the weight."""
    g = torch.Generator().manual_seed(4)
    layer = kernels.OneDnnLinear(24, 40)
    x = torch.randn(5, 24, generator=g)
    with torch.no_grad(), kernels.bf16_matmuls():
        before = layer(x)
        assert torch.equal(before, _bf16_reference(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), before)  # the kept copy: the same products
        layer.weight.mul_(-2.0)
        after = layer(x)
        assert torch.equal(after, _bf16_reference(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(40, 24, generator=g))
        assert torch.equal(layer(x), _bf16_reference(x, layer.weight, layer.bias))
    assert set(layer.state_dict()) == {"weight", "bias"}


@pytest.mark.skipif(not kernels.NATIVE_BF16, reason="the CPU has no native bf16: bf16_matmuls() changes nothing")
def test_a_fused_projection_serving_in_bf16_rounds_its_weight_once_and_again_once_it_changes():
    """The frozen q/k/v projections run as one ``linear`` of their concatenated weight (not through
    a module): its bf16 copy is kept on the tensor and follows the weight like a layer's."""
    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(48, 16, generator=g), torch.randn(48, generator=g), torch.randn(7, 16, generator=g)
    with torch.no_grad(), kernels.bf16_matmuls():
        first = linear(x, w, b)
        kept = w._hmi_bf16[1]
        assert torch.equal(first, _bf16_reference(x, w, b)) and torch.equal(linear(x, w, b), first)
        assert w._hmi_bf16[1] is kept  # not rounded again
        w.add_(1.0)
        assert torch.equal(linear(x, w, b), _bf16_reference(x, w, b)) and w._hmi_bf16[1] is not kept


def test_bf16_is_not_native_where_onednn_is_held_below_avx512_bf16():
    """With oneDNN held to AVX2 (``make test-avx2``, or a user's ``ONEDNN_MAX_CPU_ISA``) there is no
    bf16 inner product even on a CPU with avx512_bf16: bf16 must not be chosen, or every bf16
    GEMM fails to create its primitive."""
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", "from hmi.model.kernels import NATIVE_BF16; print(NATIVE_BF16)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_the_bf16_unit_is_amx_only_where_the_cpu_has_tiles_and_onednns_cap_allows_them():
    """Calibrations in bf16 repeat bit for bit only on the same unit (AMX tiles sum in another order
    than AVX512_BF16's dot products), so the artifact records which one ran."""
    amx = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert kernels.bf16_unit(amx, True, None) == "AMX"
    assert kernels.bf16_unit(amx, True, "avx512_core_amx") == "AMX"
    assert kernels.bf16_unit(amx, True, "AVX512_CORE_BF16") == "AVX512_BF16"
    assert kernels.bf16_unit({"avx512f", "avx512_bf16"}, True, None) == "AVX512_BF16"
    assert kernels.bf16_unit(amx, False, None) is None  # no native bf16 (e.g. oneDNN held to AVX2)
