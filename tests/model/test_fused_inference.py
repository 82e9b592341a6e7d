"""The fused inference path (`rlsys.kernels.fused`, the projection epilogue, the sort-free
MoE) against the unfused forward the trainer differentiates: bitwise, and in few launches.

On a CPU machine the Triton path runs through the interpreter on a tiny model cut to one
SWA and one Sparse GQA block, in fp32 (the interpreter rounds bf16 casts differently from
torch); on a GPU at the tiny preset's full depth, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernel_count import count_launches
from rlsys.config.model import preset
from rlsys.model import Transformer

pytest.importorskip("triton")

from rlsys.model.paged_cache import PagePool  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = ["float32", "bfloat16"] if CUDA else ["float32"]


@pytest.fixture(autouse=True)
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv("RLSYS_KERNELS", "triton")


def _model(dtype: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    small = {"n_layers": 2, "swa_per_sparse": 1} if not CUDA else {}
    cfg = preset("tiny").with_overrides({"compute_dtype": dtype, **small})
    return Transformer(cfg).to(DEV).eval()


def _decode(model: Transformer, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Paged engine steps: a prefill of `prompt` tokens per sequence, then decode steps."""
    pool = PagePool(
        model.cfg, page_size=64, sparse_pages=8, swa_pages=8, dtype=model.dtype, device=DEV
    )
    model.attach_page_pool(pool)
    caches = [model.new_cache() for _ in range(tokens.shape[0])]
    with torch.inference_mode():
        out = [model.forward_step(list(tokens[:, :prompt]), caches)]
        for t in range(prompt, tokens.shape[1]):
            out.append(model.forward_step(list(tokens[:, t : t + 1]), caches))
    model.attach_page_pool(None)
    return torch.stack([torch.cat([step[s] for step in out]) for s in range(tokens.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_inference_is_bitwise_the_training_forward(dtype: str) -> None:
    model = _model(dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 19), device=DEV)
    trained = model(tokens, with_mtp=False).logits  # autograd on: every op unfused
    assert trained.requires_grad
    with torch.no_grad():
        no_grad = model(tokens, with_mtp=False).logits  # fused norms and MoE
    assert torch.equal(no_grad, trained.detach())
    assert torch.equal(_decode(model, tokens, 11), trained.detach())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_weights_follow_a_weight_update(dtype: str) -> None:
    model, other = _model(dtype), _model(dtype, seed=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 9), device=DEV)
    _decode(model, tokens, 5)  # builds the fused weights
    model.load_state_dict(other.state_dict())  # in place: the fused copies are now stale
    with torch.no_grad():
        want = other(tokens, with_mtp=False).logits
    assert torch.equal(_decode(model, tokens, 5), want)


def test_a_decode_step_launches_few_kernels_per_block() -> None:
    from rlsys.model.decode_layout import StaticDecodeLayout, scratch_pages

    model = _model("float32")
    pool = PagePool(
        model.cfg, page_size=64, sparse_pages=8, swa_pages=8, dtype=model.dtype, device=DEV
    )
    model.attach_page_pool(pool)
    caches = [model.new_cache() for _ in range(3)]
    tokens = torch.randint(0, model.cfg.vocab_size, (3, 10), device=DEV)
    layout = StaticDecodeLayout(model.cfg, pool, 4, 127, scratch_pages(pool))
    with torch.inference_mode():
        model.forward_step(list(tokens), caches)
        layout.fill([1, 2, 3], caches)
        with count_launches() as launches:
            model.forward_decode(layout.tokens, layout.positions, layout.kv)
    per_block = launches.total / model.cfg.n_layers
    # unfused, the same step is ~90 launches per block (norms, casts, rotary tables, the
    # routing sort, the combine's elementwise ops)
    assert per_block <= 24, launches.table()
