"""Training's grouped SwiGLU on the cached [w1; w3] (`MoE._caches_stack`): the same forward
bits and gradients as a concatenation made per call, and the cache follows a parameter
update (an optimiser step writes w1 and w3 in place).

On the CPU the products run in the `plain` linear mode, the mode whose grouped SwiGLU reads
the stack here (the invariant mode reads it on CUDA, where cuBLAS's invariance is checked);
the routing's kernels run on the Triton interpreter. The graphed trunk's refresh before a
replay is held by tests/trainer/test_trunk_graphs_cuda.py (graphed steps bitwise the eager
ones across optimiser steps).
"""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.kernels.triton_ops import autograd as ag
from rlsys.kernels.triton_ops.products import linear_mode
from rlsys.model import moe as moe_mod
from rlsys.model.moe import MoE

pytest.importorskip("triton")


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        monkeypatch.setenv("RLSYS_KERNELS", "triton")


def _moe() -> MoE:
    torch.manual_seed(0)
    cfg = preset("tiny").with_overrides({"compute_dtype": "bfloat16"})
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return MoE(cfg, 0, torch.bfloat16).to(dev).train()


def _step(
    moe: MoE, x: torch.Tensor, layouts: list[bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' output and the w1 / w3 gradients of one backward; `layouts`
    collects whether each gradient reached the parameters contiguous (autograd copies a
    strided one into a new `.grad`, so only a hook sees it as handed over)."""
    moe.zero_grad(set_to_none=True)
    hooks = [
        w.register_hook(lambda g: layouts.append(g.is_contiguous()))
        for w in (moe.w1, moe.w3)
        if layouts is not None
    ]
    out = moe(x)
    out.float().square().sum().backward()
    for h in hooks:
        h.remove()
    return out.detach(), moe.w1.grad.clone(), moe.w3.grad.clone()


@pytest.mark.parametrize("split_grads", [True, False], ids=["two-products", "halves"])
def test_the_cached_stack_gives_the_concatenations_forward_and_gradients(
    triton_path: None, monkeypatch: pytest.MonkeyPatch, split_grads: bool
) -> None:
    moe = _moe()
    x = torch.randn(24, moe.cfg.d_model, device=moe.w1.device).to(torch.bfloat16)
    with linear_mode("plain"):
        monkeypatch.setattr(ag, "SPLIT_EXPERT_GRADS", split_grads)
        monkeypatch.setattr(moe_mod, "CACHED_EXPERT_STACK", False)
        assert not moe._caches_stack()
        want = _step(moe, x)
        monkeypatch.setattr(moe_mod, "CACHED_EXPERT_STACK", True)
        assert moe._caches_stack()
        layouts: list[bool] = []
        got = _step(moe, x, layouts)
    assert moe._w13.buffer is not None  # the training call built and read the cache
    assert torch.equal(got[0], want[0])  # forward: the same product over the same values
    assert layouts == [split_grads, split_grads]
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-3)


def test_the_cached_stack_follows_an_update_of_the_experts(triton_path: None) -> None:
    moe = _moe()
    x = torch.randn(24, moe.cfg.d_model, device=moe.w1.device).to(torch.bfloat16)
    with linear_mode("plain"):
        before = _step(moe, x)[0]
        with torch.no_grad():  # as an optimiser step writes them: in place
            moe.w1.mul_(-1.0)
            moe.w3.add_(0.5)
        after = _step(moe, x)[0]
        moe._w13.buffer = None  # rebuilt from the parameters as they are now
        fresh = _step(moe, x)[0]
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh)


def test_fsdp_turns_the_cache_off() -> None:
    moe = _moe()
    moe.stack_cache = False  # what `trainer.fsdp.shard_policy` sets
    with linear_mode("plain"):
        assert not moe._caches_stack()
