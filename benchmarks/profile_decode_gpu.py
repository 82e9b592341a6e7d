"""Where an engine decode step's time goes on the GPU (torch profiler), batch 1, `medium`.

Usage (GPU machine): python benchmarks/profile_decode_gpu.py [--batch 1] [--steps 5] [--graphs]
Prints the top host-side ops by self CPU time, the top GPU kernels by device time (Triton
kernels included), kernel launches and device syncs per step, and the GPU time per step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.model import preset  # noqa: E402
from rlsys.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from rlsys.engine.config import EngineConfig  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.runners import make_runner  # noqa: E402
from rlsys.model import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--graphs", action="store_true", help="decode steps as CUDA graphs")
    parser.add_argument("--preset", default="medium")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(preset(args.preset)).cuda().eval()
    ecfg = EngineConfig(
        max_running=args.batch, max_context_tokens=2048, device="cuda", prefix_cache_tokens=0,
        max_step_tokens=max(args.batch, 8192), cuda_graphs=args.graphs,
    )  # fmt: skip
    core = EngineCore(model.cfg, ecfg, make_runner(model.cfg, ecfg, model.state_dict()))
    params = SamplingParams(max_tokens=64, seed=0)
    for i in range(args.batch):
        prompt = torch.randint(32, 127, (1024,)).tolist()
        core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params))
    # prefill every prompt, then warm-up decode steps (compiles everything): the profiled
    # steps are decode-only (with a small step budget, batch x 1024 prompt tokens would
    # still be prefilling)
    while any(s.num_generated == 0 for s in core.running) or core.waiting:
        core.step()
    for _ in range(3):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"GPU time per decode step (kernels): {gpu_us / args.steps / 1000:.2f} ms")
    launches = sum(
        e.count
        for e in events
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
    )
    syncs = sum(
        e.count
        for e in events
        if "Synchronize" in e.key or e.key == "aten::item" or e.key == "aten::_local_scalar_dense"
    )
    print(
        f"per decode step: {launches / args.steps:.0f} kernel launches, {syncs / args.steps:.0f} host syncs"
    )


if __name__ == "__main__":
    main()
