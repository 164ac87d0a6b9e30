"""The base executor of private tenants on each device: its projections are the frozen layers'
own, and calls of many clients gathered into one GEMM each get their own rows back."""

import asyncio

import pytest
import torch

from hmi.split.base_executor import BaseExecutor, FrozenLinears
from tests.conftest import DEVICES, tiny_bert

L_LOW = 2


@pytest.mark.parametrize("device", DEVICES)
def test_the_executors_projections_are_the_frozen_layers_own_on_every_device(device):
    bert = tiny_bert()
    linears = FrozenLinears(bert, L_LOW, device)
    layer = bert.encoder.layer[3]
    x, g = torch.randn(9, 32), torch.randn(9, 64)
    att = layer.attention.self
    with torch.no_grad():
        want = torch.cat([att.query(x), att.key(x), att.value(x)], -1)
        got = linears.run(3, "qkv", "forward", x)
        assert got.device.type == "cpu"  # calls leave as CPU tensors
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        ffn = layer.intermediate.dense
        torch.testing.assert_close(linears.run(3, "ffn_in", "nobias", x), x @ ffn.weight.T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linears.run(3, "ffn_in", "backward", g), g @ ffn.weight, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_calls_gathered_into_one_gemm_on_every_device_each_get_their_own_rows(device):
    bert = tiny_bert()
    executor = BaseExecutor(FrozenLinears(bert, L_LOW, device), max_wait_s=0.05)
    reference = FrozenLinears(bert, L_LOW)
    calls = [torch.randn(n, 32) for n in (1, 7, 3, 12, 5)]

    async def all_at_once():
        return await asyncio.gather(*(executor.call(2, "attn_out", "forward", x) for x in calls))

    try:
        got = asyncio.run(all_at_once())
    finally:
        executor.shutdown()
    assert executor.stats["batches"] < len(calls)
    for x, y in zip(calls, got):
        torch.testing.assert_close(y, reference.run(2, "attn_out", "forward", x), atol=1e-5, rtol=1e-5)
