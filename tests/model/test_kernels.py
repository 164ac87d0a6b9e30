import copy

import pytest
import torch
from torch import nn

from hmi.model import kernels
from hmi.model.kernels import InferenceLinear, linear, use_inference_kernels


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 24), (3, 7, 24), (0, 24)])
def test_inference_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g) if bias else None
    with torch.no_grad():
        y = linear(x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_inference_linear_reads_non_contiguous_input():
    x = torch.randn(7, 3, 24).transpose(0, 1)
    w = torch.randn(16, 24)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w, None), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_inference_linear_keeps_gradients_when_autograd_records():
    lin = use_inference_kernels(nn.Sequential(nn.Linear(8, 4)))[0]
    ref = copy.deepcopy(lin)
    ref.__class__ = nn.Linear
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def test_use_inference_kernels_switches_plain_linears_only_and_keeps_weights():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Sequential(nn.Linear(4, 2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    use_inference_kernels(model)
    assert type(model[0]) is InferenceLinear and type(model[2][0]) is InferenceLinear
    assert type(model[1]) is Custom
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_switching_the_kernel_off_gives_aten_results(monkeypatch):
    monkeypatch.setattr(kernels, "ONEDNN_LINEAR", False)
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(linear(x, w, None), torch.nn.functional.linear(x, w, None))
