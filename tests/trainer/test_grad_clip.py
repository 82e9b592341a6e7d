"""The gradient clip folded into the fused AdamW step (`grad_clip.py`): the same update as
torch's in-place clip (the MTP heads clipped apart from the policy), and no pass over the
policy's gradients of its own: only the heads' are scaled in place."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlsys.model import Transformer
from rlsys.trainer.grad_clip import divided_gradients, folded_clip
from rlsys.trainer.mtp_loss import clip_policy_and_mtp
from tests.trainer.helpers import tiny_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the fused update of either device
MAX_NORM = 0.01  # far below the tiny model's gradient norm: the clip engages


class GradientWrites(TorchDispatchMode):
    """The multiplications run and the tensors they scale (data pointers)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.scaled: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name.startswith(("mul", "_foreach_mul", "div")):
            self.ops[name] += 1
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.scaled |= {t.data_ptr() for t in first if isinstance(t, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def _with_grads(model: Transformer, heads: bool) -> Transformer:
    model = model.to(DEV)
    tokens = torch.randint(
        0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1)
    )
    model(tokens.to(DEV), with_mtp=False).logits.pow(2).mean().backward()
    for i, p in enumerate(model.mtp.parameters()):
        p.grad = torch.full_like(p, 0.5 + i) if heads else None
    return model


def _adamw(model: Transformer) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("heads", [False, True])
def test_the_folded_clip_gives_the_in_place_clip_update(heads: bool) -> None:
    folded_model = _with_grads(tiny_model(), heads)
    in_place_model = _with_grads(tiny_model(), heads)  # the same seed, the same gradients
    norm, divisor = folded_clip(folded_model, MAX_NORM)
    ref_norm = clip_policy_and_mtp(in_place_model, MAX_NORM)
    assert torch.equal(norm, ref_norm.float())
    assert divisor.item() > 1.0  # the clip engaged
    torch.testing.assert_close(divisor, (ref_norm + 1e-6) / MAX_NORM)
    opt = _adamw(folded_model)
    with divided_gradients(opt, divisor):
        opt.step()
    assert not hasattr(opt, "grad_scale")  # the divisor is this step's alone
    _adamw(in_place_model).step()
    moved = False
    for (name, got), ref in zip(
        folded_model.state_dict().items(), in_place_model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7, msg=name)
        moved |= not torch.equal(got.cpu(), tiny_model().state_dict()[name])
    assert moved


@pytest.mark.parametrize("heads", [False, True])
def test_only_the_heads_gradients_are_scaled_in_place(heads: bool) -> None:
    model = _with_grads(tiny_model(), heads)
    assert len(model.mtp)  # the tiny preset has a head
    head_grads = {p.grad.data_ptr() for p in model.mtp.parameters() if p.grad is not None}
    opt = _adamw(model)
    with GradientWrites() as writes:
        norm, divisor = folded_clip(model, MAX_NORM)
        with divided_gradients(opt, divisor):
            opt.step()
    policy_grads = {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
    policy_grads -= head_grads
    assert not writes.scaled & policy_grads, writes.ops
    assert (writes.scaled & head_grads) == head_grads
