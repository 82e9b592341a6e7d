"""`column_parts`: the fused projection's column slices as one autograd node give the
gradient plain slicing gives, for any subset of parts used downstream."""

import pytest
import torch

from rlsys.model.attention import column_parts

pytestmark = pytest.mark.unit

PARTS = ((0, 5), (8, 3), (16, 3), (24, 2))  # gaps between parts, as the fused layout pads
# (parts, columns): the gaps above; parts that tile the columns; padding after the last part
LAYOUTS = {
    "gaps": (PARTS, 26),
    "tiled": (((0, 5), (5, 3), (8, 3), (11, 2)), 13),
    "tail": (((0, 5), (5, 3), (8, 3), (11, 2)), 20),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("used", [(0, 1, 2, 3), (0, 3), (2,)])
def test_column_parts_gradients_are_plain_slicings(used: tuple[int, ...], layout: str) -> None:
    parts, columns = LAYOUTS[layout]
    torch.manual_seed(0)
    y = torch.randn(7, columns, requires_grad=True)
    weights = [torch.randn(7, w) for _, w in parts]

    def loss(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return sum((parts[i] * weights[i]).sum() for i in used)  # type: ignore[return-value]

    (g_fused,) = torch.autograd.grad(loss(column_parts(y, parts)), y)
    (g_plain,) = torch.autograd.grad(loss(tuple(y[:, s : s + w] for s, w in parts)), y)
    assert torch.equal(g_fused, g_plain)
    with torch.no_grad():
        assert all(
            torch.equal(p, y[:, s : s + w])
            for p, (s, w) in zip(column_parts(y, parts), parts, strict=True)
        )
