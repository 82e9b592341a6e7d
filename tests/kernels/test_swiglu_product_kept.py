"""The SwiGLUs' backward reads the forward's product a13 = x [w1; w3]^T kept from the forward
(`autograd.KEEP_SWIGLU_PRODUCT`) instead of recomputing it: the same gradients, bitwise, one
GEMM fewer.

On the CPU the products run in the `plain` linear mode (cuBLAS's forms, whose product exists
whole; the invariant mode picks them on CUDA, where cuBLAS's invariance is checked); the
routing's kernels run on the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.kernels.triton_ops import autograd as ag
from rlsys.kernels.triton_ops.products import linear_mode
from rlsys.model.moe import MoE

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("RLSYS_KERNELS", "triton")


def _moe_grads(monkeypatch: pytest.MonkeyPatch, keep: bool) -> tuple[list[torch.Tensor], int]:
    """The routed MoE's input and parameter gradients of one backward, and how many grouped
    GEMMs that backward ran."""
    torch.manual_seed(0)
    cfg = preset("tiny").with_overrides({"compute_dtype": "bfloat16"})
    moe = MoE(cfg, 0, torch.bfloat16).to(DEV).train()
    x = torch.randn(40, cfg.d_model, device=DEV).to(torch.bfloat16).requires_grad_(True)
    monkeypatch.setattr(ag, "KEEP_SWIGLU_PRODUCT", keep)
    calls = []
    real = ag.grouped_mm

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    with linear_mode("plain"):
        out = moe(x)
        monkeypatch.setattr(ag, "grouped_mm", counting)  # the backward's products only
        out.float().square().sum().backward()
    monkeypatch.setattr(ag, "grouped_mm", real)
    grads = [x.grad] + [p.grad for p in moe.parameters() if p.grad is not None]
    return grads, len(calls)


def test_the_grouped_swiglu_backward_reads_the_kept_product(
    triton_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    recomputed, calls_recomputing = _moe_grads(monkeypatch, keep=False)
    kept, calls_keeping = _moe_grads(monkeypatch, keep=True)
    # recomputing: the SwiGLU's a13, its input and two weight gradients, then the down
    # projection's two; kept: the a13 product is not run again
    assert calls_keeping == calls_recomputing - 1
    assert len(kept) == len(recomputed)
    for got, want in zip(kept, recomputed, strict=True):
        assert torch.equal(got, want)


def _dense(keep: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], object]:
    torch.manual_seed(1)
    x = torch.randn(33, 64, device=DEV).to(torch.bfloat16).requires_grad_(True)
    w1, w3 = (
        (torch.randn(48, 64, device=DEV) * 0.1).to(torch.bfloat16).requires_grad_(True)
        for _ in range(2)
    )
    monkeypatch.setattr(ag, "KEEP_SWIGLU_PRODUCT", keep)
    with linear_mode("plain"):
        out = ag.SwiGLU.apply(x, w1, w3)
        saved = out.grad_fn.saved_tensors[3]
        out.float().square().sum().backward()
    return [x.grad, w1.grad, w3.grad], saved


def test_the_dense_swiglu_backward_reads_the_kept_product(
    triton_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    recomputed, none = _dense(False, monkeypatch)
    kept, a13 = _dense(True, monkeypatch)
    assert none is None
    assert a13 is not None and a13.shape == (33, 96)
    for got, want in zip(kept, recomputed, strict=True):
        assert torch.equal(got, want)
