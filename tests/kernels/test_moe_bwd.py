"""The MoE's token <-> slot backward kernels (the combine's and the sorted rows') against
autograd over the torch expressions they differentiate, at a width of several column blocks
and with the tokens spread over several programs (the last one partly empty)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.moe_bwd import ELEMENTS, combine_bwd, slot_sum  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("n", "k", "d"), [(7, 3, 40), (5, 4, 2 * 1024 + 100)])
def test_the_backward_is_autograd_of_the_combine(n: int, k: int, d: int) -> None:
    g = torch.Generator().manual_seed(0)
    ys = torch.randn(n * k, d, generator=g, dtype=torch.float64)
    gates = torch.rand(n, k, generator=g, dtype=torch.float64)
    pos = torch.randperm(n * k, generator=g).view(n, k)
    up = torch.randn(n, d, generator=g, dtype=torch.float64)
    yr, gr = ys.clone().requires_grad_(), gates.clone().requires_grad_()
    (gr.unsqueeze(-1) * yr[pos]).sum(1).backward(up)
    dev = [t.float().to(DEV) for t in (up, ys, gates)]
    dy, dg = combine_bwd(dev[0], dev[1], pos.to(torch.int32).to(DEV), dev[2], True, True)
    torch.testing.assert_close(dy.cpu().double(), yr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dg.cpu().double(), gr.grad, atol=1e-4, rtol=1e-5)
    # each row's gradient is the one fp32 product the torch expression rounds
    want = (dev[0].unsqueeze(1) * dev[2].unsqueeze(-1)).reshape(n * k, d)
    assert torch.equal(dy[pos.reshape(-1).to(DEV)], want)
    # either output alone is the same bits
    only_y, none_g = combine_bwd(dev[0], dev[1], pos.to(torch.int32).to(DEV), dev[2], True, False)
    none_y, only_g = combine_bwd(dev[0], dev[1], pos.to(torch.int32).to(DEV), dev[2], False, True)
    assert none_g is None and none_y is None
    assert torch.equal(only_y, dy) and torch.equal(only_g, dg)


def test_more_tokens_than_one_program_holds() -> None:
    d = 64
    n, k = 3 * (ELEMENTS // d) + 5, 2
    g = torch.Generator().manual_seed(1)
    ys, gates = torch.randn(n * k, d, generator=g), torch.rand(n, k, generator=g)
    pos, up = torch.randperm(n * k, generator=g).view(n, k), torch.randn(n, d, generator=g)
    dy, dg = combine_bwd(
        up.to(DEV), ys.to(DEV), pos.to(torch.int32).to(DEV), gates.to(DEV), True, True
    )
    flat = pos.reshape(-1)
    want_y = torch.empty_like(ys).index_copy_(
        0, flat, (up[:, None] * gates[..., None]).flatten(0, 1)
    )
    assert torch.equal(dy.cpu(), want_y)
    torch.testing.assert_close(dg.cpu(), (ys[pos] * up[:, None]).sum(-1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("n", "k", "d"), [(3 * (ELEMENTS // 64) + 5, 4, 64), (6, 2, 1024 + 30)])
def test_a_tokens_gradient_is_its_slots_summed_in_order(n: int, k: int, d: int) -> None:
    g = torch.Generator().manual_seed(2)
    grads, pos = torch.randn(n * k, d, generator=g), torch.randperm(n * k, generator=g).view(n, k)
    got = slot_sum(grads.to(DEV), pos.to(DEV)).cpu()
    want = grads[pos[:, 0]]
    for j in range(1, k):
        want = want + grads[pos[:, j]]
    assert torch.equal(got, want)
    # bf16 gradients: summed in fp32, rounded once
    half = grads.to(torch.bfloat16)
    got16 = slot_sum(half.to(DEV), pos.to(DEV)).cpu()
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(
        got16, half.float()[pos].sum(1).to(torch.bfloat16), atol=0, rtol=0.01
    )
