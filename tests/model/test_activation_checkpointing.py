"""Activation checkpointing: the same gradients bit for bit, a fraction of the saved memory.

Run on the reference path (CPU) and, on a GPU machine, the Triton path; the saved-tensor
bytes are counted with `saved_tensors_hooks`, so the test fails if no block is recomputed.
"""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model import AuxLosses, Transformer

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _loss_and_saved_bytes(model: Transformer, tokens: torch.Tensor) -> tuple[dict, int]:
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad()
    aux = AuxLosses()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, aux=aux, with_mtp=False)
        logits = out.logits[:, :-1].reshape(-1, model.cfg.vocab_size)
        loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
        loss = loss + aux.total().to(loss.device)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, saved


@pytest.mark.parametrize("preset_name", ["tiny"])
def test_checkpointed_blocks_give_the_same_gradients_and_save_less(preset_name: str) -> None:
    torch.manual_seed(0)
    cfg = preset(preset_name).with_overrides({"balance": "aux_loss"})
    model = Transformer(cfg).to(DEV).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), device=DEV)
    plain, plain_bytes = _loss_and_saved_bytes(model, tokens)
    model.checkpoint_blocks = True
    ckpt, ckpt_bytes = _loss_and_saved_bytes(model, tokens)
    assert plain.keys() == ckpt.keys()
    for name, g in plain.items():
        assert torch.equal(g, ckpt[name]), name
    # only each block's input (and the head's activations) stay saved
    assert ckpt_bytes < plain_bytes / 3, (ckpt_bytes, plain_bytes)
