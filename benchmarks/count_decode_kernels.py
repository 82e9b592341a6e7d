"""Kernels per block of one decode step (the static step CUDA graphs capture), by kernel.

Usage: python benchmarks/count_decode_kernels.py [--preset large-shape] [--batch 8]
On a CPU machine it runs under Triton's interpreter (TRITON_INTERPRET=1 RLSYS_KERNELS=triton
are set for you) on a model with the preset's structure (experts, top-k, heads, groups,
blocks) and small widths; on a GPU at the preset's real shape. Counts come from
`benchmarks/kernel_count.py` (aten ops that launch kernels + Triton launches).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("RLSYS_KERNELS", "triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_count import Launches, count_launches  # noqa: E402
from rlsys.config.model import ModelConfig, preset  # noqa: E402
from rlsys.engine.runner import LocalRunner  # noqa: E402
from rlsys.model import RoutingRecorder  # noqa: E402

# the structure of `large` (experts, top-k, heads, groups, 3:1 blocks) at interpreter widths
SMALL_WIDTHS = {
    "vocab_size": 320, "d_model": 64, "n_layers": 4, "head_dim": 16, "swa_window": 64,
    "swa_tile": 16, "sparse_topk": 64, "sparse_query_tile": 16, "index_dim": 16,
    "expert_hidden": 32,
}  # fmt: skip


def model_config(name: str, cuda: bool) -> ModelConfig:
    cfg = preset(name)
    return cfg if cuda else cfg.with_overrides(SMALL_WIDTHS)


def decode_launches(cfg: ModelConfig, batch: int, prompt: int, device: str) -> Launches:
    """Launches of one decode forward of `batch` sequences after `prompt`-token prefills."""
    torch.manual_seed(0)
    runner = LocalRunner(cfg, None, device, kv_pages=batch * (prompt // 64 + 3), page_tokens=64)
    runner.enable_decode_graphs(max_batch=batch, max_context=prompt + 64)
    graphs = runner.graphs
    assert graphs is not None
    graphs.capture = False  # count the eager static step, kernel by kernel
    keys = [runner.new_cache() for _ in range(batch)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt,), generator=g).tolist() for _ in keys]
    runner.step(keys, prompts)
    runner.step(keys, [[1]] * batch)  # compiles the decode step's kernels
    caches = [runner.table.caches[k] for k in keys]
    bucket = next(b for b in graphs.buckets if max(c.length for c in caches) < b)
    layout = graphs.graphs[(next(b for b in graphs.ladder if b >= batch), bucket)].layout
    layout.fill([2] * batch, caches)  # type: ignore[arg-type]
    with torch.inference_mode(), count_launches() as launches:
        runner.model.forward_decode(layout.tokens, layout.positions, layout.kv, RoutingRecorder())
    runner.close()
    return launches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    cfg = model_config(args.preset, cuda).with_overrides(
        {"compute_dtype": "bfloat16"} if cuda else {}
    )
    launches = decode_launches(cfg, args.batch, args.prompt, "cuda" if cuda else "cpu")
    n = cfg.n_layers
    print(f"{args.preset} structure, {n} blocks, batch {args.batch}: {launches.total} launches "
          f"per decode forward, {launches.total / n:.1f} per block")  # fmt: skip
    print(launches.table(args.top))


if __name__ == "__main__":
    main()
