"""The softmax chunk rule of the attention walks: where the online softmax restarts.

Chunks are `chunk` positions wide up to 2 * P * chunk (P chunks per octave), then P to an
octave: [2^o, 2^(o+1)) splits into P chunks of 2^o / P. Every width is a power of two of
at least one key step, so no step straddles a boundary. The rule is part of the numerics
(engine and trainer merge chunk states at the same positions; `attention_fwd`'s module
doc says why), so every function here has a host twin and a kernel twin that agree
position by position (`tests/kernels/test_attention_split.py`). The widths themselves,
`SOFTMAX_CHUNK` and `CHUNKS_PER_OCTAVE`, are `attention_fwd`'s constants.
"""

from __future__ import annotations

import triton
import triton.language as tl


def log2_exact(x: int, what: str) -> int:
    """log2(x) for a power of two x (`what` names it in the error otherwise)."""
    if x < 1 or x & (x - 1):
        raise ValueError(f"{what} must be a power of two, got {x}")
    return x.bit_length() - 1


def softmax_chunk(step: int, chunk: int) -> int:
    """The base chunk width for a walk of `step`-key steps: a power of two, at least a step."""
    log2_exact(chunk, "softmax chunk")
    log2_exact(step, "key step")
    return max(chunk, step)


def chunk_index(pos: int, chunk: int, per_octave: int) -> int:
    """The softmax chunk key position `pos` lies in (host twin of the kernels' `chunk_of`)."""
    log_c, log_p = log2_exact(chunk, "softmax chunk"), log2_exact(per_octave, "chunks per octave")
    if pos < per_octave << log_c:
        return pos >> log_c
    o = pos.bit_length() - 1
    return per_octave * (o - log_c - log_p) + (pos >> (o - log_p))


def chunk_start(j: int, chunk: int, per_octave: int) -> int:
    """The first key position of softmax chunk `j` (host twin of the kernels' `chunk_first`)."""
    log_c = log2_exact(chunk, "softmax chunk")
    if j < per_octave:
        return j << log_c
    return (per_octave + j % per_octave) << (log_c + j // per_octave - 1)


@triton.jit
def chunk_of(pos, LOG_CHUNK: tl.constexpr, LOG_PER_OCTAVE: tl.constexpr):
    """The softmax chunk of key position `pos` (int scalar or tensor; see `chunk_index`)."""
    pos = tl.full([], 0, tl.int64) + pos  # a loop index may be a Python int (interpreter)
    # floor(log2(pos)) from the exponent of an exact fp64 image (exact below 2^53)
    o = (pos.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023
    o = tl.maximum(o, LOG_CHUNK + LOG_PER_OCTAVE)  # small positions: the flat branch below
    octave = ((o - LOG_CHUNK - LOG_PER_OCTAVE) << LOG_PER_OCTAVE) + (pos >> (o - LOG_PER_OCTAVE))
    flat = pos >> LOG_CHUNK
    return tl.where(pos < (1 << (LOG_CHUNK + LOG_PER_OCTAVE)), flat, octave).to(tl.int32)


@triton.jit
def chunk_first(j, LOG_CHUNK: tl.constexpr, LOG_PER_OCTAVE: tl.constexpr):
    """The first key position of softmax chunk `j` (see `chunk_start`)."""
    j = tl.full([], 0, tl.int64) + j
    PER: tl.constexpr = 1 << LOG_PER_OCTAVE
    shift = LOG_CHUNK + tl.maximum(j >> LOG_PER_OCTAVE, 1) - 1
    return tl.where(j < PER, j << LOG_CHUNK, (PER + (j & (PER - 1))) << shift)


@triton.jit
def chunk_first_step(j, STEP: tl.constexpr, LOG_CHUNK: tl.constexpr, LOG_PER_OCTAVE: tl.constexpr):
    """The first `STEP`-key step of softmax chunk `j` (chunks are whole steps)."""
    return (chunk_first(j, LOG_CHUNK, LOG_PER_OCTAVE) // STEP).to(tl.int32)
