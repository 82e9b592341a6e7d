"""How much key work a Sparse GQA query tile's walk does beyond its queries' selections (CPU).

Usage: python benchmarks/union_waste.py [--lengths 8192,32768] [--tiles 4,8,16,32]

The selection is the benchmarks' stand-in for a trained indexer (`bench_attention_walk`'s
`prefill_inputs`: index queries 0.9 x a centre shared by 64 positions + 0.1 x noise, one
index key per 8-token block, i.i.d. normal; group 0) with each query's top 512 complete
past blocks. Per tile of T queries, the union of its queries' selected blocks against the
blocks they selected (the tile's own blocks, which every walk visits, are left out):
- `blocks`: the walk visits the union's blocks (the packed backward walks, `attention_pairs`);
- `steps`: the walk visits the aligned 16-key steps holding them (the forward, which must
  not depend on a tile's other queries, and the dK/dV chunks).
Deterministic: the same table on every machine.
"""

from __future__ import annotations

import argparse

import torch

B, KSEL, IDX = 8, 512, 64


def selection(length: int) -> torch.Tensor:
    """(length, blocks) bool: each query's top KSEL complete past blocks."""
    g = torch.Generator().manual_seed(2)
    centre = torch.randn(length // 64 + 1, IDX, generator=g).repeat_interleave(64, 0)
    qi = 0.9 * centre[:length] + 0.1 * torch.randn(length, IDX, generator=g)
    bk = torch.randn(length // B, IDX, generator=g)
    nb = length // B
    sel = torch.zeros(length, nb, dtype=torch.bool)
    for s in range(0, length, 1024):
        pos = torch.arange(s, min(s + 1024, length))[:, None]
        past = (torch.arange(nb)[None, :] + 1) * B <= pos
        scores = (qi[s : s + 1024] @ bk.T).masked_fill(~past, float("-inf"))
        top = scores.topk(min(KSEL, nb), dim=1).indices
        chosen = torch.zeros_like(past)
        chosen.scatter_(1, top, True)
        sel[s : s + 1024] = chosen & past
    return sel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--tiles", default="4,8,16,32")
    args = ap.parse_args()
    print("| tokens | query slots per tile | blocks / selected | 16-key steps / selected |")
    print("|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        sel = selection(length)
        needed = int(sel.sum())
        for t in (int(x) for x in args.tiles.split(",")):
            union = sel.view(length // t, t, -1).any(1)
            blocks = int(union.sum()) * t
            steps = int(union.view(length // t, -1, 2).any(2).sum()) * 2 * t
            print(f"| {length:,} | {t} | {blocks / needed:.2f} | {steps / needed:.2f} |")


if __name__ == "__main__":
    main()
