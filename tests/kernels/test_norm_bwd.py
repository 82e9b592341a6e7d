"""RMSNorm's backward kernel against autograd over the reference formula, with the rows
spread over several programs (one of them without rows: its dgamma partial must be 0)."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels import reference

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.norm_bwd import (  # noqa: E402
    ROW_ELEMENTS,
    add_rms_norm_bwd,
    rms_norm_bwd,
)

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


@pytest.mark.parametrize("a_dtype", [torch.float32, torch.bfloat16])
def test_the_residual_add_and_norm_backward_is_autograd_of_the_unfused_form(
    a_dtype: torch.dtype,
) -> None:
    d, n = 64, 3 * (ROW_ELEMENTS // 64) + 1
    g = torch.Generator().manual_seed(1)
    h0, a = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g)
    gamma = 0.1 * torch.randn(d, generator=g, dtype=torch.float64)
    up_y, up_h = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    hr, ar, gr = h0.clone().requires_grad_(), a.double().requires_grad_(), gamma.clone()
    gr.requires_grad_()
    h_new = hr + ar
    torch.autograd.backward([reference.rms_norm(h_new, gr, 1e-6), h_new], [up_y, up_h])
    dh, da, dgamma = add_rms_norm_bwd(
        h_new.detach().float().to(DEV), gamma.float().to(DEV), up_y.to(DEV), up_h.to(DEV), 1e-6,
        a_dtype,
    )  # fmt: skip
    assert dh.dtype == torch.float32 and da.dtype == a_dtype
    torch.testing.assert_close(dh.cpu().double(), hr.grad, atol=1e-4, rtol=1e-4)
    if DEV == "cuda" or a_dtype == torch.float32:
        assert torch.equal(da, dh.to(a_dtype))  # da is dh cast once
    else:  # the interpreter rounds fp32 -> bf16 toward zero, torch to nearest even
        torch.testing.assert_close(da, dh.to(a_dtype), atol=0, rtol=2**-7)
    torch.testing.assert_close(dgamma.cpu().double(), gr.grad, atol=1e-3, rtol=1e-4)
    # without the residual's gradient: the norm's alone, as `rms_norm_bwd` gives it, to fp32
    # rounding: on the GPU the specialisation that also stores a bf16 da may lay the row out
    # differently, so its row sums round in another order (seen on an H100; fp32 da equal)
    dx, _ = rms_norm_bwd(h_new.detach().float().to(DEV), gamma.float().to(DEV), up_y.to(DEV), 1e-6)
    alone, _, _ = add_rms_norm_bwd(
        h_new.detach().float().to(DEV), gamma.float().to(DEV), up_y.to(DEV), None, 1e-6, a_dtype
    )
    torch.testing.assert_close(alone, dx, atol=1e-6, rtol=1e-6)
