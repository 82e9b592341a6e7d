"""Instructions per step of the attention walks, from their sm_90 SASS compiled offline (no
GPU needed: `kernels/triton_ops/offline.py`).

Usage: python benchmarks/kernel_instructions.py [--head-dim 64] [--top 12]

The decode walk (`attention_split._attn_fwd_part`) is bound by instruction issue on the
H200 (Nsight Compute: issue slots 61% busy, DRAM 28%), so the instructions its step loop
issues per thread are a figure a change can be judged by before any device time is spent.
Each kernel is compiled as `kernel_registers.py` compiles it (`large`'s geometry, bf16 on
tensor cores, the project's launch options); its loops are the spans of SASS closed by a
backward branch, and the step loop is the longest (the part walk's pairs loop: two steps
per iteration; the forward walk's and the backward's: one). Prints, per kernel and layer
kind, each loop's length, the step loop's shortest path (its branch bodies skipped: no
chunk merge, no rescale) and its most frequent opcodes. Counts are this Triton
version's compile; the H200's Triton may schedule a few differently.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_registers import DIVISIBLE, POINTERS, geometry, kernels  # noqa: E402
from rlsys.kernels.triton_ops.offline import compile_sass  # noqa: E402

LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
TARGET = re.compile(r"BRA\s+(?:`?\()?0x([0-9a-f]+)")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction."""
    return [
        (int(m.group(1), 16), m.group(2).strip()) for m in map(LINE.match, sass.splitlines()) if m
    ]


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """[start, end] addresses of every loop: a branch back to an earlier address."""
    found = []
    for at, text in code:
        hit = TARGET.search(text) if "BRA" in text else None
        if hit and int(hit.group(1), 16) < at:
            found.append((int(hit.group(1), 16), at))
    return found


def shortest_path(code: list[tuple[int, str]], start: int, end: int) -> int:
    """Instructions on the shortest path through the loop [start, end] (its back branch
    included): every forward branch that skips a body (a chunk merge, a rescale no row
    needs) taken where that is shorter. What a step issues in the common case."""
    inside = [(at, text) for at, text in code if start <= at <= end]
    best = {start: 0}
    for at, text in inside:
        if at not in best:
            continue
        here = best[at] + 1
        hit = TARGET.search(text) if "BRA" in text else None
        target = int(hit.group(1), 16) if hit else None
        if target is not None and at < target <= end:
            best[target] = min(best.get(target, here), here)
        unconditional = target is not None and not text.startswith("@")
        if at == end:
            return here
        if not unconditional:
            best[at + 16] = min(best.get(at + 16, here), here)
    return best.get(end, 0) + 1


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def step_loop_opcodes(sass: str) -> list[str]:
    """The opcodes of a kernel's step loop (its longest loop), in address order."""
    code = instructions(sass)
    start, end = max(loops(code), key=lambda span: span[1] - span[0])
    return [opcode(text) for at, text in code if start <= at <= end]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    d = args.head_dim
    print(f"sm_90, compiled offline on this machine; `large` geometry, head dim {d}\n")
    print(
        "| kernel | layer | variant | loops (instructions each) | step loop's shortest path "
        "| step loop's top opcodes |"
    )
    print("|---|---|---|---|---|---|")
    for label, kernel, extra, launch in kernels(d):
        variants = [("", extra, launch)]
        if label == "split part":
            variants = [("one query, one warp's 16 rows", extra, launch)]
        elif label == "split part, whole tile":  # and the part walk of tiles of any rows
            variants += [("any rows", {**extra, "ONE_ROW": False, "SUB": 0}, launch)]
        for sparse in (True, False):
            for name, consts, options in variants:
                sass = compile_sass(
                    kernel, POINTERS, {**geometry(d, sparse), **consts}, options, 90, DIVISIBLE
                )
                code = instructions(sass)
                spans = loops(code)
                lengths = [sum(1 for at, _ in code if a <= at <= b) for a, b in spans]
                top, path = "", "-"
                if spans:
                    a, b = max(spans, key=lambda s: s[1] - s[0])
                    path = str(shortest_path(code, a, b))
                    ops = collections.Counter(opcode(t) for at, t in code if a <= at <= b)
                    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top))
                print(
                    f"| {label} | {'Sparse GQA' if sparse else 'SWA'} | {name or '-'} "
                    f"| {', '.join(map(str, lengths))} | {path} | {top} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
