"""Can a trainer block's forward + backward be one CUDA graph, and what would it buy?

Usage (GPU machine): python benchmarks/probe_block_graph.py [--preset large] [--length 8192]
    [--mode global|thread_local|relaxed]

Per layer kind of the preset (one SWA block, one Sparse GQA block, each with its MoE FFN;
one process per kind, since a failed capture spoils a process's CUDA state), on one packed
sequence of `--length` rows from position 0 (the trainer's packed path, no routing replay,
no aux losses), everything on one side stream (a capture cannot use the default stream,
and autograd accumulates a leaf's gradient on the stream its forward ran on):
- eager: the block's forward and backward, timed over `--iters` calls (wall per call), and
  the GPU kernel time of one call under the profiler: wall - kernel is the host's share that
  a graph would remove; one more call under the sync debug mode prints any host wait;
- capture: the forward alone, then the backward alone (`--mode` is their
  `capture_error_mode`); a failure prints the first error and the project line it came
  from (the next thing to make capturable);
- graphed: forward and backward captured as one graph, replayed, checked bitwise against
  the eager output and gradients, and timed.
The graphed time is the floor a graphed trainer step approaches (`trainer.cuda_graphs`,
`rlsys.model.trunk_graphs`, graphs the whole trunk the same way).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_trainer_gpu import gpu_busy  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.model import Transformer  # noqa: E402
from rlsys.model.attention import SeqSpan  # noqa: E402
from rlsys.model.block import Block  # noqa: E402
from rlsys.model.kv_layout import packed_kv  # noqa: E402


class BlockCall(nn.Module):
    """The block with the packed layout bound: h -> h (what a graph may capture)."""

    def __init__(self, block: Block, positions: Tensor, spans: list[SeqSpan], kv: object):
        super().__init__()
        self.block, self.positions, self.spans, self.kv = block, positions, spans, kv

    def forward(self, h: Tensor) -> Tensor:
        return self.block(h, self.positions, self.spans, self.kv, None, None)


def step(fn: object, h: Tensor, grad: Tensor) -> Tensor:
    out = fn(h)
    out.backward(grad)
    return out


def wall_ms(fn: object, h: Tensor, grad: Tensor, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step(fn, h, grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def grads_of(module: nn.Module, h: Tensor) -> list[Tensor]:
    return [h.grad.clone()] + [p.grad.clone() for p in module.parameters() if p.grad is not None]


def zero(module: nn.Module, h: Tensor) -> None:
    module.zero_grad(set_to_none=True)
    h.grad = None


def _show_with_stack(message: object, *args: object, **kwargs: object) -> None:
    ours = [
        f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if "/rlsys/" in f.filename or "/kernels/" in f.filename
    ]
    print(f"    sync: {str(message)[:120]} at {' <- '.join(reversed(ours[-4:]))}")


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in tb if "/rlsys/" in f.filename or "/kernels/" in f.filename]
    f = ours[-1] if ours else tb[-1]
    return f"{f.filename}:{f.lineno} {f.name}: {f.line}"


def capture_fails(
    call: nn.Module, h: Tensor, grad: Tensor, part: str, mode: str
) -> tuple[str, str] | None:
    """Capture the forward alone, or the forward eagerly and the backward alone, on a side
    stream (as `make_graphed_callables` does); None when the capture held."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()  # the side stream every step of the probe runs on
    try:
        if part == "forward":
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                out = call(h)
        else:
            out = call(h)
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                out.backward(grad)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:240]}", _where(exc)


def probe(block: Block, cfg: object, length: int, iters: int, mode: str) -> dict[str, object]:
    dev = torch.device("cuda")
    spans = [SeqSpan(0, length, 0)]
    positions = torch.arange(length, device=dev)
    kv = packed_kv(cfg, spans, dev)
    call = BlockCall(block, positions, spans, kv)
    h = torch.randn(length, cfg.d_model, device=dev, requires_grad=True)
    grad = torch.randn(length, cfg.d_model, device=dev)
    row: dict[str, object] = {"kind": block.kind}
    zero(call, h)
    out = step(call, h, grad)  # warm-up: compiles every kernel
    eager_out, eager_grads = out.detach().clone(), grads_of(call, h)
    row["eager_ms"] = wall_ms(call, h, grad, iters)
    row["kernel_ms"] = gpu_busy(lambda: step(call, h, grad))[0] * 1e3
    zero(call, h)
    torch.cuda.synchronize()
    warnings.showwarning = _show_with_stack
    torch.cuda.set_sync_debug_mode("warn")  # a host wait in the step prints where it is
    step(call, h, grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    for part in ("forward", "backward"):  # which half a capture first fails in
        failure = capture_fails(call, h, grad, part, mode)
        if failure:
            row["graph"], row["where"] = f"{part} capture failed: {failure[0]}", failure[1]
            return row
    zero(call, h)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        out = step(call, h, grad)  # forward and backward in one graph: the step's floor
    graph.replay()
    torch.cuda.synchronize()
    same_out = torch.equal(out.detach(), eager_out)
    same_grads = all(torch.equal(a, b) for a, b in zip(grads_of(call, h), eager_grads, strict=True))
    row["graph"] = f"captured; output bitwise {same_out}, gradients bitwise {same_grads}"
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    row["graph_ms"] = (time.perf_counter() - start) / iters * 1e3
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--kind", default="", help="probe this layer kind only (one per process)")
    p.add_argument("--mode", default="global", help="capture_error_mode of the probe captures")
    args = p.parse_args()
    if not args.kind:  # a failed capture spoils the process's CUDA state: one process a kind
        kinds = dict.fromkeys(preset(args.preset).layer_kinds())
        for kind in kinds:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--kind", kind]
            subprocess.run(cmd, check=False)
        return
    torch.manual_seed(0)
    cfg = preset(args.preset).with_overrides({"n_layers": 4})
    with torch.device("cuda"):
        model = Transformer(cfg)
    model.train()
    seen: dict[str, Block] = {}
    for block in model.blocks:
        seen.setdefault(block.kind, block)
    name = torch.cuda.get_device_name()
    print(f"preset {args.preset}, one packed sequence of {args.length} rows, {name}")
    print("| block | eager fwd+bwd ms | GPU kernel ms | host share | graph | graphed ms |")
    print("|---|---:|---:|---:|---|---:|")
    for kind, block in seen.items():
        if kind != args.kind:
            continue
        # one side stream for everything: a capture cannot use the default stream, and
        # autograd's gradient accumulation must run on the stream its inputs came from
        with torch.cuda.stream(torch.cuda.Stream()):
            row = probe(block, cfg, args.length, args.iters, args.mode)
        eager, kern = row["eager_ms"], row["kernel_ms"]
        graphed = f"{row['graph_ms']:.2f}" if "graph_ms" in row else ""
        print(
            f"| {kind} | {eager:.2f} | {kern:.2f} | {1 - kern / eager:.0%} | {row['graph']} "
            f"| {graphed} |"
        )
        if "where" in row:
            print(f"    at {row['where']}")


if __name__ == "__main__":
    main()
