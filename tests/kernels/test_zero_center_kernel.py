"""The zero-center projection's one-launch backward against the torch form it replaces
(`rlsys.model.logits`, the reference path): the same projection up to the fp32 sum order,
entries outside the allowed set left as they came, and each row's residual sum driven to fp32 level in bf16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.zero_center import CHUNK, zero_center_bwd  # noqa: E402
from rlsys.model.logits import _RESIDUAL_ROUNDS, _ZeroCenter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_form(grad: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    class Ctx:
        pass

    ctx = Ctx()
    ctx.mask = mask
    return _ZeroCenter.backward(ctx, grad.cpu())[0]  # a CPU tensor: the torch form


@pytest.mark.parametrize("v", [70, CHUNK + 300])  # one chunk; several, the last partial
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_is_the_torch_projection(v: int, masked: bool) -> None:
    gen = torch.Generator().manual_seed(v)
    grad = torch.randn(6, v, generator=gen) + 0.3  # a real common mode to remove
    mask = torch.rand(6, v, generator=gen) < 0.4 if masked else None
    if mask is not None:
        mask[3] = False  # a row with nothing allowed is left as it came
    got = zero_center_bwd(grad.to(DEV), mask.to(DEV) if mask is not None else None, 0).cpu()
    torch.testing.assert_close(got, _torch_form(grad, mask), atol=1e-6, rtol=1e-6)
    if mask is not None:
        assert torch.equal(got[~mask], grad[~mask])  # only the allowed entries move
        assert torch.equal(got[3], grad[3])


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_rows_sum_to_zero_at_fp32_level(masked: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    v = CHUNK + 77
    grad = (torch.randn(5, v, generator=gen) * 0.01 + 0.002).to(torch.bfloat16)
    mask = torch.rand(5, v, generator=gen) < 0.5 if masked else None
    got = zero_center_bwd(grad.to(DEV), mask.to(DEV) if mask is not None else None, 2).cpu()
    assert got.dtype == torch.bfloat16
    allowed = mask if mask is not None else torch.ones_like(grad, dtype=torch.bool)
    row_sum = (got.double() * allowed).sum(-1).abs()
    row_abs = (got.double() * allowed).abs().sum(-1)
    assert (row_sum <= 2.0**-20 * row_abs).all(), float((row_sum / row_abs).max())
    # without the residual rounds the bf16 rounding leaves the sum far off
    plain = zero_center_bwd(grad.to(DEV), mask.to(DEV) if mask is not None else None, 0).cpu()
    assert ((plain.double() * allowed).sum(-1).abs() > 2.0**-20 * row_abs).any()
    # at most ROUNDS entries per row differ from the plain rounding
    assert int((got != plain).sum(-1).max()) <= _RESIDUAL_ROUNDS
