"""The decode-sized routed-expert kernels give the bits of the products they stand in for.

`grouped_tree_rows` (the down projection) must equal the grouped tree kernel
(`linear.grouped_tree_fwd`) bitwise: same chunk products, same tree, computed transposed.
`grouped_swiglu_rows` (w1 and w3 with SwiGLU fused) must equal the grouped GEMM followed by
`silu_mul` bitwise on the GPU, at every preset's expert shape; under the interpreter (CI) it
is checked against the plain formula, since there the grouped GEMM does not exist. Row
counts cover an expert with no rows, one row, and more rows than one MMA's 16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.config.model import preset  # noqa: E402
from rlsys.kernels.triton_ops.grouped_decode import (  # noqa: E402
    check_counts,
    grouped_swiglu_rows,
    grouped_tree_rows,
)
from rlsys.kernels.triton_ops.linear import expert_tiles, grouped_tree_fwd  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
# (E, H, K): every preset's routed-expert shape on the GPU; a small one in the interpreter
SHAPES = (
    sorted({(c.n_experts, c.expert_hidden, c.d_model) for c in map(preset, ("small", "medium", "large", "deep-92"))})
    if CUDA
    else [(4, 64, 128)]
)  # fmt: skip


def _rand(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 0.05).to(DTYPE).to(DEV)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_tree_is_the_grouped_tree_bitwise(shape: tuple[int, int, int]) -> None:
    n_exp, h, d = shape
    counts = check_counts(n_exp)
    rows = int(counts.sum())
    hid, w2 = _rand(rows, h), _rand(n_exp, d, h)
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(DEV)
    tiles = expert_tiles(counts.to(DEV), -(-rows // 64) + n_exp)
    for chunks in (1, 8):
        got = grouped_tree_rows(hid, w2, offsets, chunks)
        assert torch.equal(got, grouped_tree_fwd(hid, w2, tiles, chunks)), chunks


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_swiglu_is_the_grouped_gemm_bitwise(shape: tuple[int, int, int]) -> None:
    n_exp, h, d = shape
    counts = check_counts(n_exp)
    x, w13 = _rand(int(counts.sum()), d), _rand(n_exp, 2 * h, d)
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(DEV)
    got = grouped_swiglu_rows(x, w13, offsets)
    # the same rows read through a routing order (tokens with 2 slots each, shuffled):
    # the gather in place gives the bits of the gathered copy
    slots, rows = 2, x.shape[0]
    token = torch.randperm(rows + 3)[:rows]
    order = (token * slots + torch.randint(0, slots, (rows,))).to(torch.int32).to(DEV)
    tokens = _rand(rows + 3, d)
    tokens[token.to(DEV)] = x
    assert torch.equal(grouped_swiglu_rows(tokens, w13, offsets, order, slots), got)
    if CUDA:
        from rlsys.kernels.triton_ops.products import cublas_grouped_swiglu

        want = cublas_grouped_swiglu(x, w13[:, :h], w13[:, h:], offsets, w13)
        assert torch.equal(got, want)
        return
    first = torch.cumsum(counts, 0) - counts
    for e in range(n_exp):
        rows = slice(int(first[e]), int(first[e] + counts[e]))
        a = x[rows] @ w13[e].T
        want = torch.nn.functional.silu(a[:, :h]) * a[:, h:]
        torch.testing.assert_close(got[rows], want, atol=1e-4, rtol=1e-4)


def test_the_dispatcher_takes_the_decode_kernels_where_they_hold() -> None:
    """The engine's MoE takes the decode kernels only through these checks: they must pass
    where the kernels give the products' bits (here, the interpreter or the GPU), so the
    decode path is the one the engine runs."""
    from rlsys.kernels.triton_ops import products as pr

    n_exp, h, d = SHAPES[0]
    assert pr.decode_tree_holds(_rand(n_exp, d, h), 8)
    if CUDA:
        assert pr._decode_swiglu_holds(_rand(n_exp, 2 * h, d))


def test_the_decode_kernels_compile_for_sm90_on_tensor_cores_without_spills() -> None:
    """Compiled offline for the H200's architecture (no GPU: `triton_ops.offline`), under
    the launch the kernels use: both reach the MMA as wgmma (`HGMMA`, the instruction the
    grouped GEMM and the grouped tree kernel use) and spill nothing (no `STL`)."""
    from rlsys.kernels.triton_ops import grouped_decode as gd
    from rlsys.kernels.triton_ops.offline import compile_sass

    module = "rlsys.kernels.triton_ops.grouped_decode"
    swiglu = compile_sass(
        f"{module}:_grouped_swiglu_rows",
        {"X": "*bf16", "ORDER": "*i32", "W": "*bf16", "OFFS": "*i32", "Y": "*bf16"},
        {"SLOTS": 4, "GATHER": True, "BN": gd.BN, "BK": gd.BK, "BR": gd.BR, "UPCAST": False},
        gd.LAUNCH,
        divisible=("K", "H", "sx", "sw_e", "sw_n", "sy"),
    )
    tree = compile_sass(
        f"{module}:_grouped_tree_rows",
        {"Hs": "*bf16", "W": "*bf16", "OFFS": "*i32", "Y": "*fp32"},
        {"NCH": 8, "BN": gd.BN, "BK": 64, "BR": gd.BR, "EVEN": True, "UPCAST": False,
         "PRECISION": "tf32"},
        gd.LAUNCH,
        divisible=("K", "N", "sh", "sw_e", "sw_n", "sy"),
    )  # fmt: skip
    for name, sass in (("swiglu", swiglu), ("tree", tree)):
        assert "HGMMA" in sass, name
        assert "STL" not in sass, name
