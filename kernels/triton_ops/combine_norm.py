"""The MoE combine of one block fused into the next block's RMSNorm: one launch where the
decode step took two (`moe_route._combine`, then `rows._rms_norm`).

A block ends with h' = h + (shared + sum_j gates[:, j] * y[pos[:, j]]) (`combine_fwd`) and
the next block begins with rms_norm(h') cast to the compute dtype. `fused.CombineInputs` holds
the combine's operands unevaluated (what `MoE` returns when told the next consumer is a
block's norm); `combine_rms_norm_fwd` computes h' and its norm in one program per ROWS
rows.

Invariants:
- h' is bitwise `combine_fwd`'s: the same elementwise expression in the same order (the
  shared tree, then each slot's gate * row added in slot order, then h added), each step
  rounded as written (no FMA contraction); an elementwise value does not depend on how
  rows and columns are split over programs.
- The norm is bitwise `rows.rms_norm_fwd(h')`: the same block width (`rows.norm_shape`),
  the same warps, and the same reduction code (`rows.norm_rows`) over an fp32 [ROWS, BLOCK]
  tensor loaded with the same contiguity, so the compiler lays out and reduces each row
  alike (`tests/kernels/test_combine_norm.py` compares the reduction's layout in the sm_90
  compile, and the values on every path). Rows per program: where a row fills the
  program's threads (BLOCK >= `ONE_ROW_BLOCK`), all 4 warps lie along the row whatever
  ROWS is, so the fused kernel takes one row per program (as many programs as the combine
  had); below that, the norm's ROWS (warps then also lie along the rows).
- `CombineInputs.materialise()` (`rlsys.kernels.fused`) is `combine_fwd` itself: any
  consumer that is not a norm gets the tensor it always got.

Measured on the H100, under PDL, `large` (d 1,024): with 4 rows per program no faster than
the two launches (thirty-first session: batch 64 6.76 against 6.71 ms per step, batch 1
3.18 both, batch 256 15.53 against 15.33); with one row per program 1-2% faster (thirty-
second session, GPU per step: batch 1 3.02 against 3.08 ms, 64 6.42 against 6.49, 256
14.73 against 14.74), so `transformer.DEFER_COMBINE` is on (`RLSYS_DEFER_COMBINE=0`: off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.fused import CombineInputs
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device
from rlsys.kernels.triton_ops.moe_route import _rows_of, combined_rows
from rlsys.kernels.triton_ops.rows import norm_rows, norm_shape

# the padded row width from which the norm's 4 warps x 32 threads x 8 elements lie along one
# row (the sm_90 layout `rows._rms_norm` gets at d = 1,024 for any ROWS)
ONE_ROW_BLOCK = 1024


@triton.jit
def _combine_rms_norm(
    H, Y, POS, GATES, SHARED, HOUT, G, OUT, n_rows, n_cols,
    sh, sy, sp, sg, ss, sho, so, y_mn, s_mn, eps,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    Y_NCH: tl.constexpr, S_NCH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < n_rows
    r64 = row.to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = live[:, None] & (c < n_cols)[None, :]
    # `moe_route._combine`'s values
    x = combined_rows(
        H, Y, POS, GATES, SHARED, r64, live, c, mask, sh, sy, sp, sg, ss, y_mn, s_mn,
        K, HAS_SHARED, ROWS, BLOCK, Y_NCH, S_NCH,
    )  # fmt: skip
    tl.store(HOUT + r64[:, None] * sho + c[None, :], x, mask=mask)
    norm_rows(x, row, c, mask, n_cols, eps, G, OUT, so)


def combine_rms_norm_fwd(
    inputs: CombineInputs, gamma: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(h' = `inputs.materialise()` (N, d) fp32, rms_norm(h', gamma, eps) in `out_dtype`),
    bitwise `combine_fwd` followed by `rows.rms_norm_fwd`, in one launch."""
    h, pos, gates = inputs.h, inputs.pos, inputs.gates
    ys, y_stride, y_nch, y_mn = _rows_of(inputs.ys)
    check_device(h, ys, pos, gates, gamma)
    n, d = h.shape
    assert h.stride(1) == 1
    h_new = torch.empty_like(h)
    out = torch.empty(n, d, dtype=out_dtype, device=h.device)
    if n:
        block, rows = norm_shape(d)
        rows = 1 if block >= ONE_ROW_BLOCK else rows
        sp, s_stride, s_nch, s_mn = _rows_of(inputs.shared if inputs.shared is not None else h)
        # no FMA contraction: every product and sum rounds as in `_combine` and `_rms_norm`
        _combine_rms_norm[(triton.cdiv(n, rows),)](
            h, ys, pos, gates, sp, h_new, gamma, out, n, d,
            h.stride(0), y_stride, pos.stride(0), gates.stride(0), s_stride,
            h_new.stride(0), out.stride(0), y_mn, s_mn, eps,
            K=pos.shape[1], HAS_SHARED=inputs.shared is not None, BLOCK=block, ROWS=rows,
            Y_NCH=y_nch, S_NCH=s_nch, enable_fp_fusion=False, **pdl.launch(h.device),
        )  # fmt: skip
    return h_new, out
