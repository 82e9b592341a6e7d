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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batched_decode_step_gives_each_sequence_its_full_forward_bits(dtype: str) -> None:
    """Sequences decoding together at different positions (one query each: the engine's
    decode step, batched across sequences) past the SWA window and across tiles, beside
    a sequence whose prompt arrives in chunks within the same steps."""
    model = build(dtype)
    lengths, prompts, chunks = [70, 41, 58, 64], [5, 30, 1, 13], [1, 1, 1, 13]
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,)) for n in lengths]
    assert max(lengths) > model.cfg.swa_window + model.cfg.swa_tile
    with torch.no_grad():
        full = [model(s[None]).logits[0] for s in seqs]
        caches = [model.new_cache() for _ in seqs]
        done = list(prompts)
        outs = [
            [o]
            for o in model.forward_step([s[:p] for s, p in zip(seqs, prompts, strict=True)], caches)
        ]
        while any(d < n for d, n in zip(done, lengths, strict=True)):
            live = [i for i in range(len(seqs)) if done[i] < lengths[i]]
            step = model.forward_step(
                [seqs[i][done[i] : done[i] + chunks[i]] for i in live], [caches[i] for i in live]
            )
            for i, o in zip(live, step, strict=True):
                outs[i].append(o)
                done[i] += chunks[i]
    for i in range(len(seqs)):
        assert torch.equal(torch.cat(outs[i]), full[i]), i


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
