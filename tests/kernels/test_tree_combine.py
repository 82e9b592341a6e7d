"""The experts' down projection and the MoE's combine as one autograd node
(`autograd.TreeCombine`, `autograd.TREE_COMBINE`): the same output and the same gradients,
bitwise, as the two nodes (`GroupedTree`, then `Combine`, whose backward hands the tree an
fp32 row gradient to cast), with the rows' gradient written once in the weights' dtype.

On the CPU the products run in the `plain` linear mode and the routing's and combine's
kernels on the Triton interpreter (as `test_swiglu_product_kept.py`).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from rlsys.config.model import preset
from rlsys.kernels.triton_ops import autograd as ag
from rlsys.kernels.triton_ops import moe_bwd
from rlsys.kernels.triton_ops.products import linear_mode
from rlsys.model.moe import MoE

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _step(
    monkeypatch: pytest.MonkeyPatch, merged: bool, shared: bool
) -> tuple[Tensor, list[Tensor], list[torch.dtype]]:
    """One MoE forward with a residual and its backward: (output, gradients of the input,
    the residual and every parameter, the row-gradient dtypes the combine kernel wrote)."""
    torch.manual_seed(0)
    overrides = {"compute_dtype": "bfloat16"} | ({} if shared else {"n_shared_experts": 0})
    cfg = preset("tiny").with_overrides(overrides)
    moe = MoE(cfg, 0, torch.bfloat16).to(DEV).train()
    x = torch.randn(40, cfg.d_model, device=DEV).to(torch.bfloat16).requires_grad_(True)
    residual = torch.randn(40, cfg.d_model, device=DEV, requires_grad=True)
    monkeypatch.setattr(ag, "TREE_COMBINE", merged)
    written = []
    real = moe_bwd.combine_bwd

    def recording(*args: object, **kwargs: object) -> tuple:
        gy, gg = real(*args, **kwargs)
        written.append(gy.dtype)
        return gy, gg

    monkeypatch.setattr(moe_bwd, "combine_bwd", recording)
    with linear_mode("plain"):
        out = moe(x, residual=residual)
        out.square().sum().backward()
    monkeypatch.setattr(moe_bwd, "combine_bwd", real)
    grads = [x.grad, residual.grad] + [p.grad for p in moe.parameters() if p.grad is not None]
    return out.detach(), grads, written


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("RLSYS_KERNELS", "triton")


@pytest.mark.parametrize("shared", [True, False])
def test_one_node_gives_the_two_nodes_output_and_gradients(
    triton_path: None, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    want_out, want, want_written = _step(monkeypatch, merged=False, shared=shared)
    got_out, got, got_written = _step(monkeypatch, merged=True, shared=shared)
    assert torch.equal(got_out, want_out)
    assert len(got) == len(want) and len(got) > 2
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the two nodes wrote the rows' gradient in fp32 (then cast); one node, once in bf16
    assert want_written == [torch.float32] and got_written == [torch.bfloat16]


def test_the_narrow_row_gradient_is_the_rounded_fp32_one() -> None:
    g = torch.Generator().manual_seed(3)
    n, k, d = 9, 2, 40
    up, ys = torch.randn(n, d, generator=g), torch.randn(n * k, d, generator=g)
    gates, pos = torch.rand(n, k, generator=g), torch.randperm(n * k, generator=g).view(n, k)
    args = [t.to(DEV) for t in (up, ys, pos.to(torch.int32), gates)]
    wide, gg_wide = moe_bwd.combine_bwd(*args, True, True)
    narrow, gg_narrow = moe_bwd.combine_bwd(*args, True, True, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, wide.to(torch.bfloat16)) and torch.equal(gg_narrow, gg_wide)


def test_the_switch_picks_the_merged_node(
    triton_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = ag.TreeCombine.apply
    monkeypatch.setattr(ag.TreeCombine, "apply", lambda *a: calls.append(1) or real(*a))
    _step(monkeypatch, merged=False, shared=True)
    assert calls == []  # the switch off: two nodes
    _step(monkeypatch, merged=True, shared=True)
    assert calls == [1]


def test_the_rounding_is_torchs_at_ties_and_edges() -> None:
    # gates of 1: each row gradient is g itself, so its bf16 is the cast of g's fp32 values
    bits = torch.tensor(
        [
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0x3F80C000,
            0x3F807FFF,
            0x7F7FFFFF,
            0x7F7F8000,
            0x00008000,
            0x00018000,
            0x80000000,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x00000001,
        ],
        dtype=torch.int64,
    ).to(torch.int32)  # ties (even and odd), just below a tie, overflow, subnormals, specials
    up = bits.view(torch.float32).view(1, -1)
    ys, gates = torch.zeros(1, up.shape[1]), torch.ones(1, 1)
    pos = torch.zeros(1, 1, dtype=torch.int32)
    got, _ = moe_bwd.combine_bwd(
        up.to(DEV), ys.to(DEV), pos.to(DEV), gates.to(DEV), True, False, torch.bfloat16
    )
    want = up.to(torch.bfloat16)
    assert torch.equal(got.cpu().view(torch.int16)[:, :-2], want.view(torch.int16)[:, :-2])
    assert got[0, -2].isnan()  # NaN stays NaN
    assert torch.equal(got.cpu()[:, -1], want[:, -1])
