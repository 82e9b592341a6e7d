"""The attention forward (and the backward's dq walk) compiled for the H200's architecture
(sm_90) on this machine: at the models' narrow head dim (64, `large`), under the launch
options engine and trainer use (`forward_launch`), the single walk and the split walk keep
their values in registers (at most a few spilled values) within the cap that fits four
programs per SM.

Why on the CPU: a register regression costs occupancy, not correctness, and no interpreter
test sees it (the softmax chunks' second accumulator cost `large`'s 32K prefill +27% on the
H200 before the cap). The compile is Triton's own toolchain; nothing is launched.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.kernel_registers import intermediate, resources  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import (  # noqa: E402
    NARROW_HEAD_MAX_REGISTERS,
    forward_launch,
)

# Spilled stack tolerated under the cap: a few values (none under Triton 3.9 with the
# launch's specialisation). A second accumulator's worth of state is hundreds of bytes: with
# the query tile doubled (twice the rows' state) the walk spills 408 bytes (tried).
MAX_SPILL_BYTES = 32
# rows of the benchmark's table: the decode part walk on one warp's rows, and on the whole
# tile (calls of fewer part programs)
KERNELS = {"walk": "forward walk", "part": "split part", "whole": "split part, whole tile"}


@pytest.mark.parametrize(
    ("kernel", "sparse"), [("walk", True), ("walk", False), ("part", True), ("whole", True)],
    ids=["sparse-walk", "swa-walk", "sparse-split-part", "sparse-split-part-whole-tile"],
)  # fmt: skip
def test_the_narrow_head_walks_fit_the_register_cap(kernel: str, sparse: bool) -> None:
    launch = forward_launch(64)
    assert launch["maxnreg"] == NARROW_HEAD_MAX_REGISTERS
    used = resources(KERNELS[kernel], 64, sparse)
    assert used.registers <= NARROW_HEAD_MAX_REGISTERS, used
    assert used.stack <= MAX_SPILL_BYTES, used


def test_a_window_of_one_compiles() -> None:
    """Triton specialises an integer argument equal to 1 to a constant, so a model whose
    sliding window is 1 hands the SWA walk a constexpr `window`: the mask must not call a
    tensor method on it (`window.to(...)` failed to compile, found offline)."""
    from benchmarks.kernel_registers import DIVISIBLE, POINTERS, geometry
    from rlsys.kernels.triton_ops.attention_fwd import FORWARD_PAIRED_STEPS, chunk_constants
    from rlsys.kernels.triton_ops.offline import compile_resources

    constants = {
        **geometry(64, False),
        **chunk_constants(256),
        "HAS_GATE": False,
        "window": 1,
        "PAIRED": FORWARD_PAIRED_STEPS,
    }
    used = compile_resources(
        "rlsys.kernels.triton_ops.attention_fwd:_attn_fwd", POINTERS, constants,
        forward_launch(64), 90, DIVISIBLE,
    )  # fmt: skip
    assert used.registers > 0


def test_the_forward_walk_multiplies_on_warp_group_mma_from_swizzled_shared_memory() -> None:
    # Hopper's wgmma reads its shared operands conflict-free only in the 128-byte swizzle;
    # a walk that fell back to mma.sync or unswizzled tiles would lose that (Nsight
    # Compute on the H100 already counts 27% of the walk's shared wavefronts excessive)
    ir = intermediate("forward walk", 64, True)
    assert ir.count("ttng.warp_group_dot ") >= 2, "Q.K^T and P.V on warp-group MMA"
    tiles = [line for line in ir.splitlines() if "async_copy_global_to_local" in line]
    kv = [line for line in tiles if "bf16" in line]
    assert kv and all("#shared," in line or "#shared2," in line for line in kv), kv
    assert "swizzlingByteWidth = 128" in ir


@pytest.mark.parametrize("d", [64, 128])
def test_the_wide_dkv_chunk_runs_all_four_products_on_warp_group_mma(d: int) -> None:
    # the 16-key program's dV and dK products have M = 16 rows: mma.sync, with Q and dO
    # re-read from shared memory every tile (Nsight Compute: L1/shared-bound at 84%); a
    # 64-key chunk gives them M = 64, warp-group MMA, within the register file unspilled
    narrow = intermediate("backward dk dv", d, True)
    wide = intermediate("backward dk dv, 64 keys", d, True)
    assert narrow.count("ttng.warp_group_dot ") == 2 and narrow.count("tt.dot ") == 2
    assert wide.count("ttng.warp_group_dot ") == 4 and "tt.dot " not in wide
    used = resources("backward dk dv, 64 keys", d, True)
    assert used.stack == 0, used


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "swa"])
def test_the_dq_walk_compiles_for_sm90_without_spilling(d: int, sparse: bool) -> None:
    # the dq program also makes the backward's delta = rowsum(dO * O) from one more load of
    # its O rows: 100 / 164 registers at head dim 64 / 128 (99 / 140 before), no spill
    used = resources("backward dq", d, sparse)
    assert used.registers > 0 and used.stack == 0, used


def test_an_unnamed_defaulted_constexpr_compiles_at_its_default() -> None:
    """A launch that omits a defaulted constexpr compiles it at its default; the offline
    compile must too (left out of its signature, it would compile as a runtime integer with
    both branches, and every figure read from it would be another kernel's)."""
    from rlsys.kernels.triton_ops.offline import _launch_constexprs, compile_sass

    kernel = "tests.kernels.offline_cases:branchy"
    options = {"num_warps": 4, "num_stages": 1}

    def count(consts: dict) -> int:
        sass = compile_sass(kernel, {"X": "*fp32"}, consts, options)
        return sum(1 for line in sass.splitlines() if "/*0" in line and ";" in line)

    light, heavy, unnamed = count({"HEAVY": False}), count({"HEAVY": True}), count({})
    assert heavy > light  # the two branches compile apart
    assert unnamed == light
    with pytest.raises(ValueError, match="constexpr NEEDED not given"):
        _launch_constexprs(kernel, [_Required()], {})


class _Required:
    """A `tl.constexpr` parameter without a default, as `JITFunction.params` lists one."""

    name = "NEEDED"
    is_constexpr = True
    has_default = False


@pytest.mark.parametrize("d", [64, 128])
def test_the_block_mass_sums_the_heads_within_a_thread(d: int) -> None:
    """`_block_mass` lays its product's rows out head-major on one warp (`MASS_LAUNCH`), so
    the head sum adds MMA row tiles a thread holds: its step loop shuffles only for the 8
    keys of a block (and the rank's scan). Rows slot-major, or two warps, take 50 and 18
    shuffles a step and a cross-warp barrier per sum (1.6-1.8x the kernel time on the H100)."""
    from benchmarks.kernel_instructions import step_loop_opcodes
    from benchmarks.kernel_registers import DIVISIBLE, POINTERS, geometry
    from rlsys.kernels.triton_ops.attention_bwd import MASS_LAUNCH
    from rlsys.kernels.triton_ops.offline import compile_sass

    constants = {k: v for k, v in geometry(d, True).items() if k != "SPARSE"}
    sass = compile_sass(
        "rlsys.kernels.triton_ops.attention_bwd:_block_mass", {**POINTERS, "MASS": "*fp32"},
        {**constants, "CONTIG": True}, MASS_LAUNCH, 90, (*DIVISIBLE, "m_stride_n", "m_stride_g"),
    )  # fmt: skip
    ops = step_loop_opcodes(sass)
    assert ops.count("SHFL") <= 12, ops.count("SHFL")
    assert ops.count("BAR") <= 2, ops.count("BAR")  # the K pipeline's, not the sums'
