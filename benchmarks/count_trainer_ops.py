"""Which lines of the project issue a trainer step's `aten` ops: a host-overhead map.

Usage: python benchmarks/count_trainer_ops.py [--preset large] [--layers 8] [--length 8192]
    [--device cuda] [--top 40]
    python benchmarks/count_trainer_ops.py --device cpu --layers 4 --length 320
On the CPU the same Triton path as CUDA runs under the interpreter (`RLSYS_KERNELS=triton
TRITON_INTERPRET=1` are set for you) on a model with the preset's structure and the small
widths of `count_decode_kernels.py`. Each Triton launch counts one op at its site, and the
aten ops the interpreter itself issues inside a launch are not counted, so the CPU count
tracks the GPU's (the dense products differ: the dispatcher sends bf16 products to cuBLAS
on the GPU, fp32 ones to the Triton linear on the CPU).

One warm-up `train_step` on two sequences of `--length` tokens (replay on, chunked LM
head, as `bench_trainer_gpu.py`), then one step under a dispatch mode that counts every
`aten` op that reaches a kernel and charges it to a site: the innermost frame of this
project's code on the stack (file:line function), or, for ops autograd's engine issues for
a built-in backward node, that node's name. A host-bound step (GPU busy far below 100%) is
mostly the sum of these calls' dispatch costs, so the table says which lines to fuse or
batch first. Only views and metadata ops that launch nothing are left out of the count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("RLSYS_KERNELS", "triton")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_trainer_gpu import trajectory  # noqa: E402
from benchmarks.count_decode_kernels import SMALL_WIDTHS  # noqa: E402
from rlsys.config.algo import AlgoConfig  # noqa: E402
from rlsys.config.job import TrainerSection  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.kernels.triton_launches import hooked_triton_launches  # noqa: E402
from rlsys.model import Transformer  # noqa: E402
from rlsys.trainer import Trainer  # noqa: E402

# ops that only make a new view or read metadata: no kernel, little dispatch cost
FREE = {
    "view", "_unsafe_view", "as_strided", "reshape", "expand", "permute", "transpose", "t",
    "unsqueeze", "squeeze", "select", "slice", "alias", "detach", "split", "split_with_sizes",
    "unbind", "chunk", "narrow", "sym_size", "sym_stride", "sym_numel", "size", "stride",
    "is_same_size", "_reshape_alias", "diagonal", "view_as_real", "lift_fresh",
}  # fmt: skip
# ops that make the host wait for the device (a value read back, or an output size that
# depends on the data): each one drains the launch queue, so the GPU idles behind the host.
# They count only when a device tensor is involved: `.item()` of a CPU tensor (AdamW's step
# counters) waits for nothing.
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}
COPIES = {"_to_copy", "copy_"}
PROJECT = (str(ROOT / "rlsys"), str(ROOT / "kernels"), str(ROOT / "control"))


def _on_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _sync_kind(name: str, args: tuple, kwargs: dict, out: object) -> str | None:
    """Why this op makes the host wait for the device, or None when it does not.

    A read of a device value waits for the queue; so does a copy to the host that is not
    `non_blocking`, and an upload from pageable (unpinned) host memory: CUDA synchronizes
    the stream before a pageable host-to-device copy starts."""
    if name in SYNCS:
        return "read" if any(_on_device(a) for a in args) else None
    if name not in COPIES:
        return None
    if name == "copy_":
        dst, src = args[0], args[1]
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking"))
    else:
        src, dst = args[0], out
        non_blocking = bool(kwargs.get("non_blocking"))
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return None
    if _on_device(src) and not _on_device(dst) and not non_blocking:
        return "download"
    if not _on_device(src) and _on_device(dst) and not src.is_pinned():
        # a 0-dim CPU tensor goes to the kernel as a scalar argument, never through here
        return "pageable upload"
    return None


def _site() -> str:
    """The running built-in backward node (autograd's engine issues its ops; on the CPU the
    engine runs on the caller's thread, under the `backward()` call's frames), else the
    innermost project frame on the Python stack (the launch hook's own frame skipped)."""
    node = torch._C._current_autograd_node()
    if node is not None and not isinstance(node, torch.autograd.function.BackwardCFunction):
        return f"<backward {type(node).__name__}>"
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.endswith("triton_launches.py"):
            frame = frame.f_back
            continue
        if path.startswith(PROJECT) or "/rlsys/" in path:
            rel = path.split("/rlsys/")[-1] if "/rlsys/" in path else Path(path).name
            return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<no project frame>"


class OpSites(TorchDispatchMode):
    """Counts ops that launch work, per call site and per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.pairs: Counter[str] = Counter()  # "op at site"
        self.paused = 0  # inside a Triton launch: the interpreter's own ops are not the step's

    def on_launch(self, name: str, real: bool, launch: Callable[[], Any]) -> Any:
        """A Triton launch is one op at its site, whatever its host side does."""
        if real:
            self.sites[_site()] += 1
            self.ops[f"triton.{name}"] += 1
        self.paused += 1
        try:
            return launch()
        finally:
            self.paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        out = func(*args, **(kwargs or {}))
        if name in FREE or self.paused:
            return out
        site = _site()
        self.sites[site] += 1
        self.ops[name] += 1
        self.pairs[f"{name} at {site}"] += 1
        kind = _sync_kind(name, args, kwargs or {}, out)
        if kind is not None:
            self.syncs[f"{kind}: {name} at {site}"] += 1
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    torch.manual_seed(0)
    small = SMALL_WIDTHS if args.device == "cpu" else {}
    cfg = preset(args.preset).with_overrides({**small, "n_layers": args.layers})
    model = Transformer(cfg).to(args.device)
    trajs = [
        trajectory(model, args.length, args.device),
        trajectory(model, args.length, args.device),
    ]
    trajs[1].reward = 0.0  # a group with variance: the step is not filtered
    section = TrainerSection(
        replay_experts="indices", replay_candidates=True, lm_head_chunk=1024,
        micro_batch_tokens=args.length, mismatch_rollouts=0,
    )  # fmt: skip
    trainer = Trainer(model, section, AlgoConfig(max_staleness=10**6))
    trainer.train_step(trajs)
    counter = OpSites()
    start = time.perf_counter()
    with counter, hooked_triton_launches(counter.on_launch):
        trainer.train_step(trajs)
    wall = time.perf_counter() - start
    total = sum(counter.sites.values())
    widths = " (small widths)" if small else ""
    print(
        f"{args.preset}{widths} cut to {args.layers} blocks, 2 x {args.length} tokens, {args.device}"
    )
    print(
        f"ops that launch work: {total:,} per step, {total / args.layers:,.0f} per block "
        f"({wall:.1f} s under the counter)"
    )
    print("\n| ops | share | site |\n|---:|---:|---|")
    for site, n in counter.sites.most_common(args.top):
        print(f"| {n:,} | {n / total:.1%} | `{site}` |")
    print(
        f"\nhost syncs: {sum(counter.syncs.values()):,} per step\n\n| syncs | op at site |\n|---:|---|"
    )
    for site, n in counter.syncs.most_common(args.top):
        print(f"| {n:,} | `{site}` |")
    print("\n| ops | op at site |\n|---:|---|")
    for pair, n in counter.pairs.most_common(args.top):
        print(f"| {n:,} | `{pair}` |")
    print("\nmost frequent ops: " + ", ".join(f"{k} {v:,}" for k, v in counter.ops.most_common(15)))


if __name__ == "__main__":
    main()
