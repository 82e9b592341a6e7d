"""The MoE combine fused into the next block's norm (`triton_ops.combine_norm`): bitwise the
combine followed by the norm, in values (the interpreter on the CPU, compiled on a GPU) and
in how the compiled kernel reduces a row (the sm_90 compile's reduction layout, offline);
and the model's inference forward takes it between blocks with the same logits."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels import fused  # noqa: E402
from rlsys.kernels.triton_ops import moe_route as mr  # noqa: E402
from rlsys.kernels.triton_ops.combine_norm import combine_rms_norm_fwd  # noqa: E402
from rlsys.kernels.triton_ops.partials import Partials  # noqa: E402
from rlsys.kernels.triton_ops.rows import rms_norm_fwd  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: both paths cast alike
# here (one kernel each), but bf16 outputs are compared on the GPU only, as elsewhere
OUT_DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def _rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV)


def _inputs(n: int, k: int, d: int, y_nch: int, s_nch: int | None) -> fused.CombineInputs:
    ys: torch.Tensor | Partials = (
        Partials(_rand(y_nch, n * k, d, seed=1), y_nch) if y_nch > 1 else _rand(n * k, d, seed=1)
    )
    shared: torch.Tensor | Partials | None = None
    if s_nch is not None:
        shared = Partials(_rand(s_nch, n, d, seed=2), s_nch) if s_nch > 1 else _rand(n, d, seed=2)
    perm = torch.randperm(n * k, generator=torch.Generator().manual_seed(3))
    gates = torch.rand(n, k, generator=torch.Generator().manual_seed(4)).to(DEV)
    return fused.CombineInputs(
        _rand(n, d, seed=0), ys, perm.view(n, k).to(DEV, torch.int32), gates, shared
    )


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("n", "k", "d", "y_nch", "s_nch"),
    [(1, 2, 64, 1, None), (9, 3, 70, 2, 4), (13, 2, 1024, 4, 1), (5, 4, 300, 1, 2)],
)
def test_the_fused_launch_is_the_combine_then_the_norm_bitwise(
    n: int, k: int, d: int, y_nch: int, s_nch: int | None, out_dtype: torch.dtype
) -> None:
    inputs = _inputs(n, k, d, y_nch, s_nch)
    gamma = _rand(d, seed=5) * 0.1
    h_new, y = combine_rms_norm_fwd(inputs, gamma, 1e-6, out_dtype)
    want_h = mr.combine_fwd(inputs.h, inputs.ys, inputs.pos, inputs.gates, inputs.shared)
    assert torch.equal(inputs.materialise(), want_h)
    assert torch.equal(h_new, want_h)
    assert y.dtype == out_dtype
    assert torch.equal(y, rms_norm_fwd(want_h, gamma, 1e-6, out_dtype))
    # a row's values do not depend on the other rows of the call
    one_h, one_y = combine_rms_norm_fwd(_first_row(inputs), gamma, 1e-6, out_dtype)
    assert torch.equal(one_h, h_new[:1]) and torch.equal(one_y, y[:1])


def _first_row(inputs: fused.CombineInputs) -> fused.CombineInputs:
    shared = inputs.shared
    if isinstance(shared, Partials):
        shared = Partials(shared.p[:, :1].contiguous(), shared.nch)
    elif shared is not None:
        shared = shared[:1]
    return fused.CombineInputs(inputs.h[:1], inputs.ys, inputs.pos[:1], inputs.gates[:1], shared)


def _reduce_layout(ttgir: str) -> str:
    """The layout of the operand of the compiled kernel's only row reduction, spelt out."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, flags=re.MULTILINE))
    reduces = re.findall(
        r'"tt\.reduce"\(.*?\) <\{axis = 1 : i32\}>[\s\S]*?\) : \(tensor<[^,]+, (#\w+)>', ttgir
    )
    assert len(reduces) == 1, reduces
    return aliases[reduces[0]]


@pytest.mark.parametrize("d", [2048, 1024, 256])
def test_the_compiled_row_reduction_is_laid_out_as_the_norms(d: int) -> None:
    """Compiled for sm_90 offline (no GPU): the fused kernel's row sum, at its own rows per
    program, runs over a tensor in the layout of `_rms_norm`'s, so the two reduce each row in
    the same tree (the GPU tests compare the values)."""
    from rlsys.kernels.triton_ops.combine_norm import ONE_ROW_BLOCK
    from rlsys.kernels.triton_ops.offline import compile_ir
    from rlsys.kernels.triton_ops.rows import norm_shape

    block, rows = norm_shape(d)
    fused_rows = 1 if block >= ONE_ROW_BLOCK else rows
    ptrs = {"G": "*fp32", "Y": "*bf16", "eps": "fp32"}
    norm = compile_ir(
        "rlsys.kernels.triton_ops.rows:_rms_norm",
        {**ptrs, "X": "*fp32", "R": "*fp32", "H": "*fp32"},
        {"BLOCK": block, "ROWS": rows, "HAS_RES": False, "R_NCH": 1},
        {"num_warps": 4},
        divisible=("sx", "sr", "sh", "sy"),
    )
    fused_ir = compile_ir(
        "rlsys.kernels.triton_ops.combine_norm:_combine_rms_norm",
        {
            "H": "*fp32",
            "Y": "*fp32",
            "POS": "*i32",
            "GATES": "*fp32",
            "SHARED": "*fp32",
            "HOUT": "*fp32",
            "G": "*fp32",
            "OUT": "*bf16",
            "eps": "fp32",
        },  # fmt: skip
        {"K": 8, "HAS_SHARED": True, "BLOCK": block, "ROWS": fused_rows, "Y_NCH": 2, "S_NCH": 4},
        {"num_warps": 4},
        divisible=("sh", "sy", "ss", "sho", "so", "y_mn", "s_mn"),
    )
    assert _reduce_layout(fused_ir) == _reduce_layout(norm)


def test_the_model_leaves_each_blocks_combine_to_the_next_norm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inference on the Triton path: every block but the last hands its MoE combine to the
    next block's norm (one launch fewer each), and the logits are bitwise those of the
    forward that combines in each block (and of the training forward: test_fused_inference)."""
    from benchmarks.kernel_count import count_launches
    from rlsys.config.model import preset
    from rlsys.model import Transformer, transformer
    from rlsys.model.moe import MoE

    if DEV == "cpu":
        monkeypatch.setenv("RLSYS_KERNELS", "triton")
    small = {"n_layers": 3, "swa_per_sparse": 2} if DEV == "cpu" else {}
    torch.manual_seed(0)
    model = Transformer(preset("tiny").with_overrides(small)).to(DEV).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 12), device=DEV)
    moe_blocks = sum(isinstance(b.ffn, MoE) for b in model.blocks)
    assert moe_blocks >= 2
    with torch.no_grad():
        model(tokens, with_mtp=False)  # builds the fused weights (launches of their own)
    logits, launches = {}, {}
    for deferred in (True, False):
        monkeypatch.setattr(transformer, "DEFER_COMBINE", deferred)
        with torch.no_grad(), count_launches() as counted:
            logits[deferred] = model(tokens, with_mtp=False).logits
        launches[deferred] = counted.total
    assert launches[False] - launches[True] == moe_blocks - 1, launches
    assert torch.equal(logits[True], logits[False])
