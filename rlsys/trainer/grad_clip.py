"""The gradient-norm clip, folded into the fused AdamW step where it can be.

torch's `clip_grad_norm_` scales every gradient by min(1, max_norm / (norm + 1e-6)) in a pass
of its own before the update. For bf16 gradients and an fp32 coefficient on the device,
foreach takes its slow path: one kernel per parameter (103 per step of `large` cut to 8
blocks, 2 ms of an H100's step). The fused AdamW reads every gradient anyway and divides it
in fp32 by its `grad_scale` (the hook `torch.amp.GradScaler` uses): handed
max(1, (norm + 1e-6) / max_norm), the update is the clipped gradient's, without a pass.

Where it applies: one process (`strategy.Local`; FSDP2 clips in place, its norm reduced over
ranks). The MTP heads are clipped apart from the policy (their own coefficient c), and the
update divides every gradient by the policy's divisor D: so the heads' gradients alone are
scaled in place, by c * D, and the update's division leaves them scaled by c.

Invariant: the update is the one clipping in place gives, up to rounding: in place, a bf16
gradient is scaled in fp32 and rounded to bf16 before the update reads it; folded, the
update reads it unrounded and divides by the inverse coefficient. The returned norm is the
same either way (the norm before clipping).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from rlsys.model.policy import PolicyModel

CLIP_EPS = 1e-6  # added to the norm, as torch's clip_grad_norm_ does


def folded_clip(model: PolicyModel, max_norm: float) -> tuple[Tensor, Tensor]:
    """(the policy's gradient norm, the divisor D the fused update applies to every
    gradient); the MTP heads' gradients, if any, are scaled in place by their own clip
    coefficient times D (module doc)."""
    head_params = list(model.mtp.parameters())  # type: ignore[union-attr]
    heads = {id(p) for p in head_params}
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in heads]
    norm = torch.nn.utils.get_total_norm(grads, 2.0).float()
    divisor = ((norm + CLIP_EPS) / max_norm).clamp_min(1.0)
    head_grads = [p.grad for p in head_params if p.grad is not None]
    if head_grads:
        head_norm = torch.nn.utils.get_total_norm(head_grads, 2.0).float()
        coef = (max_norm / (head_norm + CLIP_EPS)).clamp_max(1.0)
        torch._foreach_mul_(head_grads, coef * divisor)
    return norm, divisor


@contextmanager
def divided_gradients(optimizer: torch.optim.Optimizer, divisor: Tensor | None) -> Iterator[None]:
    """Inside, the fused optimizer's `step` divides every gradient by `divisor` (a one-element
    fp32 tensor on the parameters' device; None: the gradients as they are)."""
    if divisor is None:
        yield
        return
    if not optimizer.defaults.get("fused"):
        raise ValueError("a folded gradient clip needs a fused optimizer (fused=True)")
    optimizer.grad_scale = divisor  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
