"""The attackers' parts on their own (``hmi.split.attack``): GELU's inverse, and the subspace a
pooled noise lies in found from the rows alone."""

import torch
import torch.nn.functional as F

from hmi.split import attack


def test_gelu_inverse_undoes_gelu_where_it_is_one_to_one():
    x = torch.linspace(-0.75, 6.0, 500, dtype=torch.float64)
    torch.testing.assert_close(attack.gelu_inverse(F.gelu(x)), x, atol=1e-9, rtol=1e-9)


def test_noise_confined_to_k_directions_is_found_as_where_the_rows_vary_most_and_flattened():
    gen = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(4000, 64, generator=gen, dtype=torch.float64) + 1.0
    pool = 3.0 * torch.randn(4, 64, generator=gen, dtype=torch.float64)
    sent = x + torch.randn(4000, 4, generator=gen, dtype=torch.float64) @ pool / 2
    found = attack.varied_most(sent, 4)
    basis = torch.linalg.qr(pool.T).Q  # (64, 4) orthonormal, the pool's span
    assert float((found.T - basis @ (basis.T @ found.T)).norm()) < 0.05  # the same subspace
    flat = attack.flattened(sent, found)
    off = x - flat  # what is left of the noise, and of x's own variation there
    assert float(off.norm() / (sent - x).norm()) < 0.1
