"""`column_parts`: the fused projection's column slices as one autograd node give the
gradient plain slicing gives, for any subset of parts used downstream."""

import pytest
import torch

from rlsys.model.attention import column_parts

pytestmark = pytest.mark.unit

PARTS = ((0, 5), (8, 3), (16, 3), (24, 2))  # gaps between parts, as the fused layout pads


@pytest.mark.parametrize("used", [(0, 1, 2, 3), (0, 3), (2,)])
def test_column_parts_gradients_are_plain_slicings(used: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    y = torch.randn(7, 26, requires_grad=True)
    weights = [torch.randn(7, w) for _, w in PARTS]

    def loss(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return sum((parts[i] * weights[i]).sum() for i in used)  # type: ignore[return-value]

    (g_fused,) = torch.autograd.grad(loss(column_parts(y, PARTS)), y)
    (g_plain,) = torch.autograd.grad(loss(tuple(y[:, s : s + w] for s, w in PARTS)), y)
    assert torch.equal(g_fused, g_plain)
    with torch.no_grad():
        assert all(
            torch.equal(p, y[:, s : s + w])
            for p, (s, w) in zip(column_parts(y, PARTS), PARTS, strict=True)
        )
