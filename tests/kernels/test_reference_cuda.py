"""The reference kernels on a CUDA device in bf16 agree with CPU fp32 within bf16 tolerance.

Runs with plain `python -m pytest tests/kernels/test_reference_cuda.py` with the repository
on PYTHONPATH and only torch (+ pydantic) installed: imports rlsys.kernels and rlsys.model,
nothing that needs ray / redis / sqlalchemy.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16 = {"atol": 3e-2, "rtol": 3e-2}


def _both(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cpu = [t.float() for t in tensors]
    gpu = [t.cuda().to(torch.bfloat16) if t.is_floating_point() else t.cuda() for t in tensors]
    return cpu, gpu


def test_linear_on_cuda_bf16_matches_cpu_fp32() -> None:
    from rlsys import kernels

    (x, w), (xg, wg) = _both(torch.randn(70, 64) / 8, torch.randn(96, 64) / 8)
    torch.testing.assert_close(kernels.linear(xg, wg).float().cpu(), kernels.linear(x, w), **BF16)
    torch.testing.assert_close(
        kernels.matmul_nt(xg, wg).float().cpu(), kernels.matmul_nt(x, w), **BF16
    )


def test_block_attention_on_cuda_bf16_matches_cpu_fp32() -> None:
    from rlsys import kernels

    (q, k, v), (qg, kg, vg) = _both(
        torch.randn(3, 8, 16), torch.randn(3, 5, 4, 16), torch.randn(3, 5, 4, 16)
    )
    visible = torch.rand(3, 8, 5, 4) > 0.3
    visible[..., 0, 0] = True
    out, mass = kernels.block_attention(q, k, v, visible, 0.25)
    out_g, mass_g = kernels.block_attention(qg, kg, vg, visible.cuda(), 0.25)
    torch.testing.assert_close(out_g.float().cpu(), out, **BF16)
    torch.testing.assert_close(mass_g.cpu(), mass, **BF16)


def test_norm_softmax_and_moe_combine_on_cuda_bf16_match_cpu_fp32() -> None:
    from rlsys import kernels

    (x, gamma, logits), (xg, gg, lg) = _both(
        torch.randn(40, 32), torch.randn(32) * 0.1, torch.randn(40, 100)
    )
    torch.testing.assert_close(
        kernels.rms_norm(xg, gg.float(), 1e-6).cpu(), kernels.rms_norm(x, gamma, 1e-6), **BF16
    )
    torch.testing.assert_close(kernels.log_softmax(lg).cpu(), kernels.log_softmax(logits), **BF16)
    (out, gates), (out_g, gates_g) = _both(torch.randn(6, 2, 8), torch.rand(6, 2))
    torch.testing.assert_close(
        kernels.moe_combine(out_g, gates_g, None).cpu(),
        kernels.moe_combine(out, gates, None),
        **BF16,
    )
    torch.testing.assert_close(kernels.silu(xg).float().cpu(), kernels.silu(x), **BF16)


def test_tiny_model_forward_on_cuda_bf16_matches_cpu_fp32() -> None:
    from rlsys.config.model import preset
    from rlsys.model import Transformer

    torch.manual_seed(0)
    cpu_model = Transformer(preset("tiny")).eval()
    gpu_model = Transformer(preset("tiny").with_overrides({"compute_dtype": "bfloat16"}))
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model = gpu_model.cuda().eval()
    tokens = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        ref = torch.log_softmax(cpu_model(tokens).logits, -1)
        got = torch.log_softmax(gpu_model(tokens.cuda()).logits, -1).cpu()
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)
