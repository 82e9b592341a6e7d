"""The engine's incremental forward gives bitwise the trainer's full-sequence log-probs."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model import Transformer, token_log_probs

pytestmark = pytest.mark.unit


def build(dtype: str = "float32", **overrides) -> Transformer:  # type: ignore[no-untyped-def]
    cfg = preset("tiny").with_overrides({"compute_dtype": dtype, **overrides})
    return Transformer(cfg).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_part_then_decode_matches_full_forward_bitwise(dtype: str) -> None:
    model = build(dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 45))
    with torch.no_grad():
        full = model(tokens).logits[0]
        cache = model.new_cache()
        steps = [model.forward_step([tokens[0, :17]], [cache])[0]]
        steps += [model.forward_step([tokens[0, t : t + 1]], [cache])[0] for t in range(17, 45)]
    incremental = torch.cat(steps)
    targets = tokens[0, 1:]
    assert torch.equal(
        token_log_probs(incremental[:-1], targets), token_log_probs(full[:-1], targets)
    )
    assert torch.equal(incremental, full)


def test_log_probs_do_not_depend_on_batch_composition() -> None:
    model = build()
    a = torch.randint(0, model.cfg.vocab_size, (30,))
    b = torch.randint(0, model.cfg.vocab_size, (30,))
    with torch.no_grad():
        alone = model(a[None]).logits[0]
        ca, cb = model.new_cache(), model.new_cache()
        first = model.forward_step([a[:9], b[:3]], [ca, cb])
        second = model.forward_step([a[9:10], b[3:25]], [ca, cb])
        third = model.forward_step([b[25:], a[10:]], [cb, ca])
    mixed = torch.cat([first[0], second[0], third[1]])
    assert torch.equal(mixed, alone)
    assert cb.length == 30 and ca.length == 30


def test_sparse_layers_in_a_long_decode_select_fewer_blocks_than_exist() -> None:
    # k=8 tokens (4 blocks of 2) over 60 tokens: selection must matter and still match.
    model = build(sparse_topk=4)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 60))
    with torch.no_grad():
        full = model(tokens).logits[0]
        cache = model.new_cache()
        steps = [model.forward_step([tokens[0, t : t + 1]], [cache])[0] for t in range(60)]
    assert torch.equal(torch.cat(steps), full)


def test_full_forward_returns_mtp_logits_and_fp32_hidden_state() -> None:
    model = build("bfloat16")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12))
    out = model(tokens)
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.float32
    assert len(out.mtp_logits) == model.cfg.mtp_depth
    assert out.mtp_logits[0].shape == (2, 12, model.cfg.vocab_size)
