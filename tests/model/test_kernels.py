import copy

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
