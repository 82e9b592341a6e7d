"""Programmatic dependent launch (`triton_ops.pdl`): where it is on, and that every kernel
that may be launched with it waits for the previous kernel before touching memory.

A kernel launched with the PDL attribute may start while the kernel before it still runs;
one whose first load or store came before `wait_prior` would race with it (read a value
not yet written, or overwrite memory the allocator has just handed over). The bits of a
decode graph captured with PDL against the eager step are `test_decode_graphs`' (on the GPU,
with `pdl.DECODE_GRAPHS` on, its graphs are captured with dependent launches, the eager
steps without); the trainer's trunk graphs against the eager trunk are `test_trunk_graphs`'
(on the GPU with `RLSYS_PDL_TRAINER=1`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops import (  # noqa: E402
    attention_bwd,
    attention_fwd,
    attention_split,
    combine_norm,
    elementwise,
    expert_plan,
    grouped_decode,
    indexer,
    linear,
    moe_bwd,
    moe_route,
    norm_bwd,
    pdl,
    qkv_post,
    rope,
    rows,
    swiglu,
)

# the kernels of a decode step (`benchmarks/count_decode_kernels.py` lists them), each
# PDL-aware
DECODE_KERNELS = [
    rows._rms_norm, linear._matmul, linear._tree_reduce, qkv_post._qkv_post,
    attention_fwd._attn_fwd, attention_split._attn_fwd_part, attention_split._attn_merge,
    moe_route._route, moe_route._expert_layout, moe_route._gather_rows, moe_route._combine,
    grouped_decode._grouped_swiglu_rows, grouped_decode._grouped_tree_rows,
    indexer._index_scores, indexer._topk_select, indexer._union_steps,
    combine_norm._combine_rms_norm,
]  # fmt: skip
# the Triton kernels of the trainer's trunk graphs that the decode step does not run (the
# trunk's forward and backward: `pdl.TRUNK_GRAPHS`), each PDL-aware
TRAINER_KERNELS = [
    attention_bwd._attn_bwd_dq, attention_bwd._attn_bwd_dkv,
    attention_bwd._block_mass,
    elementwise._sigmoid, expert_plan._expert_plan, expert_plan._zero_empty,
    moe_bwd._combine_bwd, moe_bwd._slot_sum, norm_bwd._rms_norm_bwd, rope._rope,
    swiglu._silu_mul, swiglu._silu_mul_bwd,
]  # fmt: skip


def _body(kernel: object) -> list[ast.stmt]:
    fn = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0]  # type: ignore[attr-defined]
    assert isinstance(fn, ast.FunctionDef)
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _calls(stmt: ast.stmt, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
        for n in ast.walk(stmt)
    )


@pytest.mark.parametrize("kernel", DECODE_KERNELS + TRAINER_KERNELS, ids=lambda k: k.fn.__name__)
def test_a_pdl_kernel_waits_for_the_previous_one_before_anything_else(kernel: object) -> None:
    params = inspect.signature(kernel.fn).parameters  # type: ignore[attr-defined]
    assert "PDL" in params, "a PDL parameter"
    assert "constexpr" in str(params["PDL"].annotation), "a compile-time one"
    assert params["PDL"].default is False, "off unless a launch turns it on"
    body = _body(kernel)
    first = body[0]
    assert _calls(first, "wait_prior"), f"first statement: {ast.unparse(first)}"
    assert any(_calls(s, "release_next") for s in body), "the next kernel is never released"


def test_launches_carry_the_attribute_only_where_turned_on_and_supported() -> None:
    cpu = torch.device("cpu")
    assert pdl.launch(cpu) == {"PDL": False}
    with pdl.dependent_launches(True):
        assert pdl.launch(cpu) == {"PDL": False}, "no PDL off CUDA (nor under the interpreter)"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        dev = torch.device("cuda")
        assert pdl.launch(dev) == {"PDL": False}, "off outside dependent_launches"
        with pdl.dependent_launches(True):
            # the feature must be live on the GPU the benchmarks run on (Triton with grid
            # dependency control), not silently off
            assert pdl.launch(dev) == {"PDL": True, "launch_pdl": True}
            with pdl.dependent_launches(False):
                assert pdl.launch(dev) == {"PDL": False}
        assert pdl.launch(dev) == {"PDL": False}


def test_the_compiled_wait_comes_before_the_first_memory_access() -> None:
    """Compiled for sm_90 offline (no GPU): with PDL the PTX's first instruction touching
    global memory follows `griddepcontrol.wait`; without it there is no grid dependency
    control at all (the kernel the trainer and the eager engine run is unchanged)."""
    from rlsys.kernels.triton_ops.offline import compile_ir

    def ptx(on: bool) -> list[str]:
        text = compile_ir(
            "rlsys.kernels.triton_ops.rows:_rms_norm",
            {"X": "*fp32", "R": "*fp32", "H": "*fp32", "G": "*fp32", "Y": "*bf16", "eps": "fp32"},
            {"BLOCK": 1024, "ROWS": 4, "HAS_RES": True, "R_NCH": 1, "PDL": on},
            {"num_warps": 4, **({"launch_pdl": True} if on else {})},
            stage="ptx",
        )
        return [line.strip() for line in text.splitlines()]

    lines = ptx(True)
    access = [i for i, line in enumerate(lines) if line.startswith(("ld.global", "st.global", "@"))
              and ("ld.global" in line or "st.global" in line)]  # fmt: skip
    wait = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    assert wait and access and wait[0] < access[0]
    assert any(line.startswith("griddepcontrol.launch_dependents") for line in lines)
    assert not any("griddepcontrol" in line for line in ptx(False))
