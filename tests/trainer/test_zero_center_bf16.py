"""The zero-center projection where it matters: bf16 logit gradients.

For softmax cross-entropy the exact logit gradient sums to zero per row; the bf16 rounding
of that gradient breaks the sum by ~2^-9 of the row's largest entry. The projection's
guarantee is that the gradient the LM head's backward consumes sums to zero to fp32
rounding, which the rounded gradient without the projection cannot meet (tried: with
`zero_center=False` the worst row is ~1e-3 of the row's absolute sum, bound 2^-20).
"""

from __future__ import annotations

import pytest
import torch

from rlsys.model import Transformer, zero_center
from tests.trainer.helpers import engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit

_BOUND = 2.0**-20  # fp32 rounding of a sum of O(V) terms, with margin; bf16 rounding is 2^-9


def _capture_logit_grads(monkeypatch: pytest.MonkeyPatch, model: Transformer) -> list[torch.Tensor]:
    """Gradients reaching the raw LM-head output, as the LM head's backward sees them."""
    grads: list[torch.Tensor] = []
    head_logits = model.head_logits

    def spy(h: torch.Tensor) -> torch.Tensor:
        out = head_logits(h)
        if out.requires_grad:
            out.register_hook(lambda g: grads.append(g.detach().clone()))
        return out

    monkeypatch.setattr(model, "head_logits", spy)
    return grads


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_bf16_logit_gradient_rows_sum_to_zero_at_fp32_precision(
    monkeypatch: pytest.MonkeyPatch, top_p: float
) -> None:
    model = tiny_model(compute_dtype="bfloat16")
    trajs = engine_trajectories(model, groups=2, top_p=top_p)
    grads = _capture_logit_grads(monkeypatch, model)
    make_trainer(model, zero_center=True, lm_head_chunk=16).train_step(trajs)
    g = torch.cat(grads)
    assert g.dtype == torch.bfloat16 and g.abs().sum() > 0
    row_sum, row_abs = g.double().sum(-1).abs(), g.double().abs().sum(-1)
    assert (row_sum <= _BOUND * row_abs).all(), float((row_sum / row_abs.clamp_min(1e-30)).max())


def test_projection_keeps_masked_entries_zero_and_sums_over_the_mask_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 64).bfloat16().requires_grad_()
    mask = torch.rand(8, 64) < 0.3
    mask[:, 0] = True
    weights = torch.randn(8, 64) * mask  # a gradient with a real common mode on the mask
    (zero_center(logits, mask).float() * weights).sum().backward()
    g = logits.grad.double()
    assert (g[~mask] == 0).all()
    row_sum, row_abs = g.sum(-1).abs(), g.abs().sum(-1)
    assert (row_sum <= _BOUND * row_abs).all()
