"""The Triton path at real shapes on the GPU (skipped without CUDA).

- the `deep-92` attention shape (16 heads, 4 KV groups, head dim 128, B=8, k=512 blocks
  here, bf16): prefill against a dense fp32 oracle, decode batches bitwise the prefill;
- the `medium` model: the engine's paged decode and the trainer's packed forward give
  bitwise the same log-probs on the GPU (docs/ARCHITECTURE.md, "Numerics").
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from rlsys.kernels.attention_plan import PagedKV, Span, contiguous_table, plan_tiles  # noqa: E402

H, HKV, D, B, IDX, W = 16, 4, 128, 8, 64, 512


def _dense(q, k, v, allowed):  # noqa: ANN001, ANN202
    """fp32 masked attention of one sequence: q (L, H, D), k/v (L, Hkv, D), allowed (H, L, L)."""
    kh = k.float().repeat_interleave(H // HKV, 1)
    vh = v.float().repeat_interleave(H // HKV, 1)
    s = torch.einsum("lhd,mhd->hlm", q.float(), kh) / math.sqrt(D)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hlm,mhd->lhd", p, vh)


@pytest.mark.parametrize("kind", ["swa", "sparse"])
def test_deep92_shape_prefill_matches_the_oracle_and_decode_is_bitwise(kind: str) -> None:
    from rlsys.kernels.triton_ops.attention_fwd import attention_forward
    from rlsys.kernels.triton_ops.indexer import select_blocks, union_steps

    length, ksel = 2048, 64
    torch.manual_seed(0)
    q = torch.randn(length, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(length, HKV, D, device="cuda")
    # about one key in 8 scaled up: scores jump past a row's reference mid-walk, so the
    # rescale that head dim 128 runs only on demand (`fold_step`) is taken by some rows
    k[torch.randint(0, 8, (length,), device="cuda") == 0] *= 8
    k = k.to(torch.bfloat16)
    v = torch.randn_like(k)
    kv = contiguous_table([length], 64, "cuda")
    pos = torch.arange(length, device="cuda")
    causal = pos[None, :] <= pos[:, None]

    def run(spans: list[Span], rows: torch.Tensor):  # noqa: ANN202
        tiles = plan_tiles(spans, 16, "cuda")
        if kind == "swa":
            return attention_forward(
                q[rows], k, v, tiles, kv, scale=1 / math.sqrt(D), step=32, window=W
            ), None
        sel = select_blocks(
            qi[rows], bk, tiles, PagedKV(kv.block_table // B, 8), topk_blocks=ksel, block=B
        )
        off, ids = union_steps(sel, tiles, block=B, step=16)
        out = attention_forward(
            q[rows],
            k,
            v,
            tiles,
            kv,
            scale=1 / math.sqrt(D),
            step=16,
            sparse=(off, ids, sel.bits),
            block=B,
        )
        return out, sel

    qi = torch.randn(length, HKV, IDX, device="cuda")
    bk = torch.randn(length // B, IDX, device="cuda")
    all_rows = torch.arange(length, device="cuda")
    (full, _), sel = run([Span(0, 0, length, 0)], all_rows)
    if kind == "swa":
        allowed = (causal & (pos[None, :] > pos[:, None] - W))[None].expand(H, -1, -1)
    else:
        # padding (-1) goes to a spare column, so it never clears a real block's flag
        nb = length // B
        chosen = torch.zeros(length, HKV, nb + 1, dtype=torch.bool, device="cuda")
        ids = sel.ids.long()
        chosen.scatter_(2, torch.where(ids >= 0, ids, nb), True)
        chosen = chosen[..., :nb]
        own = (pos // B)[:, None] == torch.arange(length // B, device="cuda")[None, :]
        blocks = chosen | own[:, None, :]
        allowed = blocks.repeat_interleave(B, 2)[:, :, :length].permute(1, 0, 2)
        allowed = allowed.repeat_interleave(H // HKV, 0) & causal[None]
    want = _dense(q, k, v, allowed)
    torch.testing.assert_close(full.float(), want, atol=2e-2, rtol=2e-2)
    tail = torch.arange(length - 8, length, device="cuda")
    decode_spans = [Span(0, i, 1, int(p)) for i, p in enumerate(tail)]
    (decoded, _), _ = run(decode_spans, tail)
    assert torch.equal(decoded, full[tail])
    chunk = torch.arange(700, 1500, device="cuda")
    (part, _), _ = run([Span(0, 0, 800, 700)], chunk)
    assert torch.equal(part, full[chunk])


def test_medium_engine_decode_and_trainer_forward_agree_bitwise() -> None:
    from rlsys.config.model import preset
    from rlsys.model import Transformer
    from tests.trainer.helpers import behaviour, engine_trajectories, make_trainer

    torch.manual_seed(0)
    model = Transformer(preset("medium")).cuda()
    trajs = engine_trajectories(model, groups=2, group_size=3, turns=2, top_p=0.9, device="cuda")
    trainer = make_trainer(model, replay_experts="indices_and_gates")
    for traj, logp in zip(trajs, trainer.log_probs(trajs), strict=True):
        assert torch.equal(logp, behaviour(traj))
