"""Sparse GQA token coverage: the fraction of dense attention mass that the selected blocks
cover, over a grid of block size B and selected tokens k, for a briefly trained model.

What it does:
1. Generates a structured byte-level corpus with long-range dependencies: records
   `key=value;`, later look-ups `key?value;` that must copy a value seen far earlier, and
   arithmetic `a+b=c;` filler. Byte tokens (vocab 256 of the preset's 320).
2. Trains the preset (default `small`) with the LM loss plus the Sparse GQA indexer KL
   (dense warm-up: k >= training length, so the indexer learns over all past blocks).
3. On held-out sequences, for every Sparse GQA layer, computes the dense causal attention
   of every head and, per (B, k), the index selection (mean-merged index keys of B
   positions, top k/B past blocks per KV group, plus the current block); coverage = dense
   mass on the selected positions, averaged over heads and over queries in the second half
   of the sequence (where k is smaller than the past). Baseline: the last k positions.

Usage: python benchmarks/token_coverage.py [--steps 150] [--train-len 256] [--eval-len 1024]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlsys import kernels
from rlsys.config.model import preset
from rlsys.model import AuxLosses, Transformer
from rlsys.model.rope import apply_rope
from rlsys.model.sparse_gqa import SparseGQA

WORDS = [a + b + c for a in "bcdfgklmnprst" for b in "aeiou" for c in "nrstxz"]


def document(rng: random.Random, n_bytes: int) -> list[int]:
    table: dict[str, str] = {}
    out: list[str] = []
    size = 0
    while size < n_bytes:
        r = rng.random()
        if r < 0.4 or len(table) < 3:
            key, val = rng.choice(WORDS), str(rng.randrange(1000, 9999))
            table[key] = val
            piece = f"{key}={val};"
        elif r < 0.8:
            key = rng.choice(list(table))
            piece = f"{key}?{table[key]};"
        else:
            a, b = rng.randrange(100), rng.randrange(100)
            piece = f"{a}+{b}={a + b};"
        out.append(piece)
        size += len(piece)
    return list("".join(out).encode()[:n_bytes])


def batch(rng: random.Random, n: int, length: int) -> torch.Tensor:
    return torch.tensor([document(rng, length) for _ in range(n)])


def train(model: Transformer, steps: int, length: int, bsz: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(steps):
        tokens = batch(rng, bsz, length)
        aux = AuxLosses()
        out = model(tokens, aux=aux, with_mtp=False)
        lm = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        (lm + aux.total()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_balance()
        losses.append(lm.item())
        if step % 25 == 0 or step == steps - 1:
            kl = float(aux.values.get("indexer_kl", torch.zeros(())).detach())
            print(f"step {step:4d} lm {lm.item():.3f} indexer_kl {kl:.3f}", flush=True)
    return losses


def layer_inputs(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    hooks = [
        b.attn.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        for b in model.blocks
        if isinstance(b.attn, SparseGQA)
    ]
    with torch.no_grad():
        model(tokens, with_mtp=False)
    for h in hooks:
        h.remove()
    return captured


def coverage(layer: SparseGQA, x: torch.Tensor, grid: list[tuple[int, int]]) -> dict:
    cfg = layer.cfg
    length, hkv = x.shape[0], cfg.n_kv_groups
    g = cfg.n_heads // hkv
    pos = torch.arange(length)
    q, k, _ = layer.proj.qkv(x, pos)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float().repeat_interleave(g, 1))
    scores = scores * layer.proj.scale
    causal = pos[None, :] <= pos[:, None]
    dense = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)  # (H, L, L)
    qi = kernels.linear(x, layer.w_index_q).float().view(length, hkv, cfg.index_dim)
    qi = apply_rope(qi, pos, cfg.rope_theta)
    ki = kernels.linear(x, layer.w_index_k).float().view(length, 1, -1)
    ki = apply_rope(ki, pos, cfg.rope_theta).view(length, -1)
    half = slice(length // 2, length)
    results = {}
    for b, topk in grid:
        n_blocks = length // b
        keys = ki[: n_blocks * b].view(n_blocks, b, -1).mean(1)
        idx = torch.einsum("tgd,nd->tgn", qi, keys)
        past = torch.arange(n_blocks)[None, :] < (pos // b)[:, None]
        idx = idx.masked_fill(~past[:, None, :], float("-inf"))
        top = idx.topk(min(topk // b, n_blocks), dim=-1)
        chosen = torch.zeros_like(idx, dtype=torch.bool).scatter(
            -1, top.indices, torch.isfinite(top.values)
        )
        token_sel = chosen.repeat_interleave(b, dim=-1)  # (L, Hkv, n_blocks * b)
        token_sel = torch.nn.functional.pad(token_sel, (0, length - n_blocks * b))
        current = (pos[None, :] // b == pos[:, None] // b) & causal  # (L, L)
        sel = token_sel | current[:, None, :]
        sel_heads = sel.repeat_interleave(g, dim=1).permute(1, 0, 2)  # (H, L, L)
        results[b, topk] = float((dense * sel_heads).sum(-1)[:, half].mean())
        window = (pos[None, :] > pos[:, None] - topk) & causal
        results["window", topk] = float((dense * window).sum(-1)[:, half].mean())
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--eval-len", type=int, default=1024)
    parser.add_argument("--eval-seqs", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = preset(args.preset).with_overrides({"sparse_topk": 4096})  # dense warm-up
    model = Transformer(cfg)
    start = time.perf_counter()
    losses = train(model, args.steps, args.train_len, args.batch, seed=1)
    print(
        f"trained {args.steps} steps x {args.batch} x {args.train_len} tokens in "
        f"{time.perf_counter() - start:.0f}s; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    model.eval()
    grid = [(b, k) for k in (32, 64, 128) for b in (1, 2, 4, 8, 16) if k // b >= 1]
    rng = random.Random(12345)
    totals: dict = {}
    count = 0
    for _ in range(args.eval_seqs):
        tokens = batch(rng, 1, args.eval_len)
        layers = [b.attn for b in model.blocks if isinstance(b.attn, SparseGQA)]
        for layer, x in zip(layers, layer_inputs(model, tokens), strict=True):
            with torch.no_grad():
                for key, val in coverage(layer, x, grid).items():
                    totals[key] = totals.get(key, 0.0) + val
            count += 1
    print(
        f"\ncoverage of dense attention mass, L={args.eval_len}, queries in the 2nd half, "
        f"{count} (sequence, layer) pairs"
    )
    print("| k \\ B | " + " | ".join(f"B={b}" for b in (1, 2, 4, 8, 16)) + " | last-k window |")
    print("|---:|" + "---:|" * 6)
    for k in (32, 64, 128):
        cells = [
            f"{100 * totals[b, k] / count:.2f}%" if (b, k) in totals else "-"
            for b in (1, 2, 4, 8, 16)
        ]
        window = 100 * totals["window", k] / count
        print(f"| k={k} | " + " | ".join(cells) + f" | {window:.2f}% |")


if __name__ == "__main__":
    main()
