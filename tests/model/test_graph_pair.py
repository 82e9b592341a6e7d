"""The graphed trunk's gradient delivery (`graph_pair.accumulate_gradients`), on the CPU.

A graphed backward writes every parameter's gradient into one static buffer that the next
replay overwrites. Its gradients must reach `.grad` as autograd's own accumulation would
have them, bitwise: a parameter without `.grad` gets a copy (never the static buffer, which
would double itself at the next micro-batch: PyTorch issue 181723), one with a `.grad` gets
the sum. The capture itself runs on CUDA only (`tests/trainer/test_trunk_graphs_cuda.py`).
"""

from __future__ import annotations

import torch

from rlsys.model.graph_pair import accumulate_gradients


def _micro_batches(seed: int, shapes: list[tuple[int, ...]], n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes] for _ in range(n)]


def test_gradients_sum_over_micro_batches_from_one_static_buffer_per_parameter() -> None:
    shapes = [(3, 4), (5,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    want = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    static = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]  # the replay's buffers
    for grads in _micro_batches(0, shapes, 3):
        for buf, g in zip(static, grads, strict=True):
            buf.copy_(g)  # a replay rewrites the static buffers
        accumulate_gradients(params, static)
        for w, g in zip(want, grads, strict=True):  # autograd's own accumulation
            (w * g.detach()).sum().backward()
    for p, w, buf in zip(params, want, static, strict=True):
        assert torch.equal(p.grad, w.grad)
        assert p.grad.data_ptr() != buf.data_ptr()  # a copy, not the static buffer


def test_a_fresh_gradient_is_a_copy_in_one_flat_buffer_per_dtype() -> None:
    params = [
        torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.zeros(2, 3)),
        torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16)),
    ]
    grads = [torch.full((4,), -0.0, dtype=torch.bfloat16), torch.ones(2, 3), torch.arange(6.0)]
    grads[2] = grads[2].to(torch.bfloat16)
    accumulate_gradients(params, grads)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g) and torch.equal(p.grad.signbit(), g.signbit())
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype
    first, third = params[0].grad, params[2].grad  # the two bf16 ones share one storage
    assert first.untyped_storage().data_ptr() == third.untyped_storage().data_ptr()
    for g in grads:
        g.fill_(7.0)  # the next replay overwrites its buffers: the .grads keep their values
    assert torch.equal(params[1].grad, torch.ones(2, 3))


def test_some_parameters_with_a_gradient_and_some_without() -> None:
    # an eager layout's backward gave one parameter a `.grad` earlier in the step
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    params[0].grad = torch.tensor([1.0, 2.0, 3.0])
    held = params[0].grad
    accumulate_gradients(params, [torch.tensor([10.0, 20.0, 30.0]), torch.tensor([4.0, 5.0, 6.0])])
    assert params[0].grad is held  # added in place, as `AccumulateGrad` does
    assert torch.equal(params[0].grad, torch.tensor([11.0, 22.0, 33.0]))
    assert torch.equal(params[1].grad, torch.tensor([4.0, 5.0, 6.0]))
