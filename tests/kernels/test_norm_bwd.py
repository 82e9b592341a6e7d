"""RMSNorm's backward kernel against autograd over the reference formula, with the rows
spread over several programs (one of them without rows: its dgamma partial must be 0)."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels import reference

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.norm_bwd import ROW_ELEMENTS, rms_norm_bwd  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("row_steps", [1, 5])  # 5 row steps over 4 programs: one is idle
def test_the_backward_is_autograd_of_the_reference(row_steps: int) -> None:
    d = 64
    n = row_steps * (ROW_ELEMENTS // d)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    gamma = 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    up = torch.randn(n, d, generator=g, dtype=torch.float64)
    xr, gr = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    reference.rms_norm(xr, gr, 1e-6).backward(up)
    dx, dgamma = rms_norm_bwd(x.float().to(DEV), gamma.float().to(DEV), up.float().to(DEV), 1e-6)
    torch.testing.assert_close(dx.cpu().double(), xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dgamma.cpu().double(), gr.grad, atol=1e-3, rtol=1e-4)
