"""The model on the Triton path: the same function as the reference, and the engine's
paged decode bitwise equal to the trainer's packed forward (docs/ARCHITECTURE.md, "Numerics").

On a CPU machine the Triton path is forced (`RLSYS_KERNELS=triton`) and runs through the
interpreter, on the tiny preset; on a GPU machine it runs compiled, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model import AuxLosses, Transformer

pytest.importorskip("triton")

from rlsys.model.paged_cache import PagePool  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv("RLSYS_KERNELS", "triton")


def _model(dtype: str = "float32", **overrides: object) -> Transformer:
    """Tiny, cut to one SWA and one Sparse GQA block (the interpreter is slow)."""
    torch.manual_seed(0)
    small = {"n_layers": 2, "swa_per_sparse": 1} if not CUDA else {}
    cfg = preset("tiny").with_overrides({"compute_dtype": dtype, **small, **overrides})
    return Transformer(cfg).to(DEV).eval()


def _pool(model: Transformer, pages: int = 16) -> PagePool:
    return PagePool(
        model.cfg, page_size=64, sparse_pages=pages, swa_pages=pages, dtype=model.dtype, device=DEV
    )


def test_triton_forward_computes_the_reference_function(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 30), device=DEV)
    with torch.no_grad():
        monkeypatch.setenv("RLSYS_KERNELS", "triton")
        triton_logits = model(tokens, with_mtp=False).logits
        model_cpu = model.cpu()
        monkeypatch.setenv("RLSYS_KERNELS", "reference")
        ref = model_cpu(tokens.cpu(), with_mtp=False).logits
    torch.testing.assert_close(triton_logits.cpu(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if CUDA else ["float32"])
def test_paged_decode_prefill_and_forks_are_bitwise_the_packed_forward(
    triton_path: None, dtype: str
) -> None:
    model = _model(dtype)
    pool = _pool(model)
    model.attach_page_pool(pool)
    length = 22
    tokens = torch.randint(0, model.cfg.vocab_size, (3, length), device=DEV)
    with torch.no_grad():
        packed = model(tokens, with_mtp=False).logits
        caches = [model.new_cache() for _ in range(2)]
        got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
        # seq 0: prefill 0..13 beside seq 1's prefill 0..5; then chunks and decodes mixed
        for s, out in zip(
            (0, 1), model.forward_step([tokens[0, :13], tokens[1, :5]], caches), strict=True
        ):
            got[s].append(out)
        pos = {0: 13, 1: 5}
        fork = None
        while pos[0] < length or pos[1] < length:
            live = [s for s in (0, 1) if pos[s] < length]
            sizes = {s: (7 if s == 1 and pos[s] == 5 else 1) for s in live}
            outs = model.forward_step(
                [tokens[s, pos[s] : pos[s] + sizes[s]] for s in live], [caches[s] for s in live]
            )
            for s, out in zip(live, outs, strict=True):
                got[s].append(out)
                pos[s] += sizes[s]
            if pos[0] == 17 and fork is None:  # a prefix-cache snapshot of seq 0 at 17 tokens
                fork = pool.fork(caches[0])
        # the snapshot serves another sequence with the same first 17 tokens
        assert fork is not None
        cont = tokens[2].clone()
        cont[:17] = tokens[0, :17]
        tail = model.forward_step([cont[17:]], [fork])[0]
        want_tail = model(cont[None], with_mtp=False).logits[0, 17:]
    for s in (0, 1):
        assert torch.equal(torch.cat(got[s]), packed[s]), f"sequence {s}"
    assert torch.equal(tail, want_tail)
    for cache in (*caches, fork):
        pool.free(cache)
    assert pool.sparse_alloc.in_use == 0 and pool.swa_alloc.in_use == 0


def test_swa_pages_are_released_behind_the_window(triton_path: None) -> None:
    model = _model(swa_window=8)
    pool = _pool(model, pages=8)
    model.attach_page_pool(pool)
    cache = model.new_cache()
    tokens = torch.randint(0, model.cfg.vocab_size, (200,), device=DEV)
    with torch.no_grad():
        model.forward_step([tokens[:130]], [cache])
        model.forward_step([tokens[130:200]], [cache])
    # future queries see positions > 199 - 8: pages 0..2 (positions < 192) are released
    assert cache.swa_pages[:3] == [None, None, None] and cache.swa_pages[3] is not None
    assert pool.swa_alloc.in_use == 1 and pool.sparse_alloc.in_use == 4


def test_training_through_the_kernels_gives_the_reference_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model().train()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 30), device=DEV)

    def grads(kernels: str) -> dict[str, torch.Tensor]:
        monkeypatch.setenv("RLSYS_KERNELS", kernels)
        m = model if kernels == "triton" else model.cpu()
        t = tokens if kernels == "triton" else tokens.cpu()
        m.zero_grad()
        aux = AuxLosses()
        out = m(t, aux=aux, with_mtp=False)
        logits = out.logits[:, :-1].reshape(-1, m.cfg.vocab_size)
        loss = torch.nn.functional.cross_entropy(logits, t[:, 1:].reshape(-1)) + aux.total()
        loss.backward()
        return {
            n: p.grad.detach().cpu().clone() for n, p in m.named_parameters() if p.grad is not None
        }

    with_triton = grads("triton")
    ref = grads("reference")
    assert with_triton.keys() == ref.keys()
    for name, g in ref.items():
        assert name in with_triton
        scale = float(g.abs().max()) + 1e-12
        assert float((with_triton[name] - g).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_the_streamed_indexer_gives_the_model_the_buffered_ones_logits(
    triton_path: None,
) -> None:
    """`RLSYS_INDEXER=streamed` changes how the selection is made, not what it is: the
    forward's logits are bitwise the buffered selection's (rows past k / B blocks select)."""
    from rlsys.kernels.triton_ops.selection import indexer_method

    model = _model()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), device=DEV)
    assert 40 // model.cfg.sparse_block > model.cfg.sparse_selected_blocks
    with torch.no_grad():
        with indexer_method("buffered"):
            buffered = model(tokens, with_mtp=False).logits
        with indexer_method("streamed"):
            streamed = model(tokens, with_mtp=False).logits
    assert torch.equal(streamed, buffered)
    with pytest.raises(ValueError, match="indexer method 'sorted'"):
        with indexer_method("sorted"):
            pass
