"""Small pieces shared by the Triton kernels: launch-time facts and dtype helpers.

Why `mma` has an interpreter form: Triton's interpreter runs `tl.dot` through numpy's
matmul, which multiplies bf16 tiles as raw integers (seen with Triton 3.6 and 3.9) and, for
fp32, gives a row a value that depends on the row's position in the tile (BLAS micro-kernel
edges). Under `TRITON_INTERPRET=1` (`UPCAST`) the kernels therefore multiply in fp32 and
reduce over K with an explicit in-order sum, the same for every row: the kernels' logic,
masks and reduction structure are tested on the CPU; the MMA itself only on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 for fp32 models, the native MMA otherwise.

    fp32 models (tests, the CPU-sized presets) must not silently drop to tf32 on the GPU.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(max(int(n), 1)))


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA, or on the CPU only under the interpreter."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`a @ b` with fp32 accumulation (see module doc for the interpreter form)."""
    if UPCAST:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def bf16_nearest(x):
    """fp32 -> bf16 rounded to nearest, ties to even: torch's cast, bit for bit, on the GPU
    and under the interpreter alike (the interpreter's own cast truncates). NaN stays NaN.
    For a kernel whose bf16 output must equal a torch cast of its fp32 value."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), y)
