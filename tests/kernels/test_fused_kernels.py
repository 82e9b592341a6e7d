"""The fused inference kernels against the unfused ops they replace: bitwise, not within a
tolerance, because engine (fused) and trainer (unfused, with autograd) must agree bit for
bit. On a CPU through Triton's interpreter at small shapes; on a GPU compiled, which is
where FMA contraction and reduction layouts could make two kernels round differently."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels import reference

pytest.importorskip("triton")

from rlsys.kernels.attention_plan import Span  # noqa: E402
from rlsys.kernels.triton_ops import moe_route as mr  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import attention_forward  # noqa: E402
from rlsys.kernels.triton_ops.elementwise import sigmoid_fwd  # noqa: E402
from rlsys.kernels.triton_ops.linear import (  # noqa: E402
    BM,
    expert_tiles,
    grouped_tree_fwd,
    linear_fwd,
)
from rlsys.kernels.triton_ops.qkv_post import IndexOut, qkv_post  # noqa: E402
from rlsys.kernels.triton_ops.rope import rope_fwd  # noqa: E402
from rlsys.kernels.triton_ops.rows import add_rms_norm_fwd, rms_norm_fwd  # noqa: E402

from .triton_cases import paged_case, tiles_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


# the interpreter rounds fp32 -> bf16 toward zero (torch and the GPU: to nearest even), so
# bitwise comparisons against torch casts run in bf16 on the GPU only
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_with_a_cast_and_with_the_residual_add_are_the_unfused_ops(dtype: torch.dtype) -> None:
    h, a, gamma = _rand(37, 96), _rand(37, 96, seed=1), _rand(96, seed=2)
    y32 = rms_norm_fwd(h, gamma, 1e-6)
    torch.testing.assert_close(y32.cpu(), reference.rms_norm(h.cpu(), gamma.cpu(), 1e-6))
    assert torch.equal(rms_norm_fwd(h, gamma, 1e-6, dtype), y32.to(dtype))
    h_new, y = add_rms_norm_fwd(h, a.to(dtype), gamma, 1e-6, dtype)
    want_h = h + a.to(dtype).float()
    assert torch.equal(h_new, want_h)
    assert torch.equal(y, rms_norm_fwd(want_h, gamma, 1e-6).to(dtype))
    assert torch.equal(add_rms_norm_fwd(h[5:6], a.to(dtype)[5:6], gamma, 1e-6, dtype)[1], y[5:6])


def test_sigmoid_is_the_reference_function_and_position_independent() -> None:
    x = _rand(3, 1500) * 6
    s = sigmoid_fwd(x)
    torch.testing.assert_close(s.cpu(), reference.sigmoid(x.cpu()), atol=1e-6, rtol=1e-6)
    assert torch.equal(sigmoid_fwd(x[1:2, 7:300]), s[1:2, 7:300])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sigmoid_node_s_gradient_is_torch_s(dtype: torch.dtype) -> None:
    # the training form (`elementwise.Sigmoid`): its backward against autograd of torch's
    # sigmoid; the model-level gradient test is too coarse to see a 1% error in it (tried)
    from rlsys.kernels.triton_ops.elementwise import Sigmoid

    x = (_rand(4, 300) * 4).to(dtype).requires_grad_()
    up = _rand(4, 300, seed=1)
    (got,) = torch.autograd.grad(Sigmoid.apply(x), x, up)
    (want,) = torch.autograd.grad(torch.sigmoid(x.float()), x, up)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1e-5)


def test_the_sigmoid_node_rounds_to_its_output_dtype_inside_itself() -> None:
    # the attention gate's form: fp32 logits, a bf16 gate, one node (no cast node)
    from rlsys.kernels.triton_ops.elementwise import Sigmoid

    x = (_rand(4, 300) * 4).requires_grad_()
    y = Sigmoid.apply(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and "Sigmoid" in type(y.grad_fn).__name__
    assert torch.equal(y, sigmoid_fwd(x.detach()).to(torch.bfloat16))
    up = _rand(4, 300, seed=1).to(torch.bfloat16)
    (got,) = torch.autograd.grad(y, x, up)
    (want,) = torch.autograd.grad(torch.sigmoid(x).to(torch.bfloat16), x, up)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _fused(w: dict[str, torch.Tensor], names: list[str]) -> tuple[torch.Tensor, list[int]]:
    """The parts on 64-row boundaries, as `rlsys.model.fused_weights` lays them out."""
    from rlsys.model.fused_weights import fuse_rows

    return fuse_rows([w[name] for name in names], 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [False, True])
def test_projection_epilogue_is_bitwise_the_unfused_epilogue(
    dtype: torch.dtype, index: bool
) -> None:
    n, h, hkv, d, idx, dm, b = 9, 4, 2, 8, 6, 32, 4
    x = _rand(n, dm, dtype=dtype)
    rows = {"wq": h * d, "wk": hkv * d, "wv": hkv * d, "wg": h, "wiq": hkv * idx, "wik": idx}
    w = {name: _rand(r, dm, dtype=dtype, seed=i + 1) for i, (name, r) in enumerate(rows.items())}
    main, offsets = _fused(w, ["wq", "wk", "wv", "wg"])
    y = linear_fwd(x, main)
    pos = torch.tensor([0, 3, 7, 11, 15, 19, 20, 63, 100], device=DEV)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d)
    inv_i = 10000.0 ** (-torch.arange(0, idx, 2, dtype=torch.float32, device=DEV) / idx)
    kv_rows = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:n].to(DEV)
    k_pool = torch.zeros(40, hkv, d, dtype=dtype, device=DEV)
    v_pool = torch.zeros_like(k_pool)
    extra = None
    if index:
        wi, index_cols = _fused(w, ["wiq", "wik"])
        yi = linear_fwd(x, wi)
        # each row completes a block: its B - 1 predecessors are earlier tokens (pool rows
        # this call does not write), itself the last
        earlier = torch.tensor([r for r in range(40) if r not in kv_rows.tolist()])
        btr = torch.stack([
            earlier[torch.randperm(len(earlier), generator=torch.Generator().manual_seed(r))[: b - 1]]
            for r in range(n)
        ]).to(DEV)  # fmt: skip
        btr = torch.cat([btr, kv_rows[:, None]], dim=1)
        brows = torch.arange(n, device=DEV) % 10
        qi = torch.empty(n, hkv, idx, device=DEV)
        extra = IndexOut(
            yi, index_cols, qi, _rand(40, idx, seed=9), inv_i, torch.zeros(10, idx, device=DEV),
            btr, brows,
        )  # fmt: skip
    q, gate = qkv_post(y, offsets, pos, kv_rows, inv, k_pool, v_pool, h, b, extra)
    oq, ok, ov, og = offsets
    assert torch.equal(q, rope_fwd(y[:, oq : oq + h * d].reshape(n, h, d), pos, inv))
    want_k = rope_fwd(y[:, ok : ok + hkv * d].reshape(n, hkv, d), pos, inv)
    assert torch.equal(k_pool[kv_rows], want_k)
    assert torch.equal(v_pool[kv_rows], y[:, ov : ov + hkv * d].reshape(n, hkv, d))
    assert torch.equal(gate, sigmoid_fwd(y[:, og : og + h]).to(dtype))
    # a column of the fused product is the separate product's (the linear's column
    # invariance on these shapes; the model computes the fused product in every path)
    assert torch.equal(y[:, og : og + h], linear_fwd(x, w["wg"]))
    if extra is not None:
        oi, oki = extra.offsets
        want_qi = rope_fwd(extra.y[:, oi : oi + hkv * idx].float().reshape(n, hkv, idx), pos, inv_i)
        assert torch.equal(extra.qi, want_qi)
        want_ki = rope_fwd(extra.y[:, oki : oki + idx].float().reshape(n, 1, idx), pos, inv_i)
        assert torch.equal(extra.key_pool[kv_rows], want_ki.view(n, idx))
        keys = extra.key_pool[btr]  # (n, B, IDX) after this call's writes
        acc = keys[:, 0]
        for j in range(1, b):
            acc = acc + keys[:, j]
        assert extra.block_keys is not None
        assert torch.equal(extra.block_keys[brows], acc / b)


def test_routing_selects_the_top_k_with_ties_to_the_lower_id_and_normalises_in_order() -> None:
    raw = _rand(23, 12) * 2
    raw[4, 7] = raw[4, 2]  # a tie: expert 2 goes first
    bias = _rand(12, seed=5) * 0.1
    bias[7] = bias[2]
    idx, gates = mr.route_fwd(raw, bias, 3)
    scores = sigmoid_fwd(raw)
    keys = (scores + bias).cpu()
    order = sorted(range(12), key=lambda e: (-float(keys[4, e]), e))
    assert idx[4].tolist() == order[:3]
    want = torch.stack([torch.tensor(sorted(range(12), key=lambda e: (-float(keys[r, e]), e))[:3])
                        for r in range(23)])  # fmt: skip
    assert torch.equal(idx.cpu(), want)
    sel = scores.gather(-1, idx)
    total = sel[:, 0] + sel[:, 1] + sel[:, 2]
    assert torch.equal(gates, sel / total[:, None])
    assert torch.equal(mr.route_fwd(raw[9:10], bias, 3)[1], gates[9:10])
    # from scores already computed (the training path's selection): the same decision
    for got, want in zip(mr.route_fwd(scores, bias, 3, scores=True), (idx, gates), strict=True):
        assert torch.equal(got, want)


def test_expert_layout_numbers_rows_like_a_stable_sort_and_tiles_like_expert_tiles() -> None:
    g = torch.Generator().manual_seed(1)
    n, k, e = 301, 3, 7
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    idx[idx == 5] = 2  # expert 5 empty, 2 crowded (duplicates within a row are fine here)
    idx = idx.to(DEV)
    max_tiles = -(-n * k // BM) + e
    pos, order, offsets, tiles = mr.expert_layout(idx, e, max_tiles, BM)
    flat = idx.reshape(-1).cpu()
    stable = torch.argsort(flat, stable=True)
    assert torch.equal(order.cpu().long(), stable)
    assert torch.equal(pos.reshape(-1).cpu()[stable].long(), torch.arange(n * k))
    want_counts = torch.bincount(flat, minlength=e)
    assert torch.equal(offsets.cpu().long(), torch.cumsum(want_counts, 0))
    want = expert_tiles(want_counts.to(DEV), max_tiles)
    used = int((want[2] > 0).sum())
    for got_t, want_t in zip(tiles, want, strict=True):
        assert torch.equal(got_t[:used], want_t[:used])
    assert int(tiles[2][used:].sum()) == 0
    x = _rand(n, 40)
    assert torch.equal(mr.gather_rows(x, order, k), x[stable.to(DEV) // k])


@pytest.mark.parametrize("shared", [False, True])
def test_combine_is_bitwise_the_residual_plus_the_reference_combine(shared: bool) -> None:
    n, k, d = 11, 3, 70
    h, ys = _rand(n, d), _rand(n * k, d, seed=1)
    pos = torch.randperm(n * k, generator=torch.Generator().manual_seed(2)).view(n, k).to(DEV)
    gates = torch.rand(n, k, generator=torch.Generator().manual_seed(3)).to(DEV)
    sh = _rand(n, d, seed=4) if shared else None
    out = mr.combine_fwd(h, ys, pos.to(torch.int32), gates, sh)
    want = h + reference.moe_combine(ys[pos], gates, sh)
    assert torch.equal(out, want)


def test_grouped_products_of_the_layout_are_the_sorted_products() -> None:
    n, k, e, d, hid = 40, 2, 5, 32, 16
    idx, _ = mr.route_fwd(_rand(n, e), torch.zeros(e, device=DEV), k)
    max_tiles = -(-n * k // BM) + e
    pos, order, offsets, tiles = mr.expert_layout(idx, e, max_tiles, BM)
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    w2 = _rand(e, d, hid, seed=3)
    h = _rand(n * k, hid, seed=4)
    got = grouped_tree_fwd(h, w2, tiles, 8)
    want = grouped_tree_fwd(h, w2, expert_tiles(counts, max_tiles), 8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_with_the_gate_in_its_epilogue_is_the_gated_output(dtype: torch.dtype) -> None:
    hkv, g, d, page = 2, 4, 16, 16
    case = paged_case([37, 20], hkv, d, page, 4, 8, DEV, dtype)
    spans = [Span(0, 0, 7, 30), Span(1, 7, 20, 0)]  # a chunk of seq 0, all of seq 1
    tiles = tiles_for(spans, 64 // g, DEV)
    n = tiles.n_rows
    q = _rand(n, hkv * g, d, dtype=dtype, seed=7)
    gate = sigmoid_fwd(_rand(n, hkv * g, seed=8)).to(dtype)
    plain, _ = attention_forward(q, case.k, case.v, tiles, case.kv, scale=0.25, step=16, window=12)
    gated, _ = attention_forward(
        q, case.k, case.v, tiles, case.kv, scale=0.25, step=16, window=12, gate=gate
    )
    assert torch.equal(gated, plain * gate[..., None])


@pytest.mark.parametrize("split", [True, False], ids=["split", "serial"])
def test_epilogues_sum_partial_products_to_the_reduced_products_bits(
    split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The norm, the routing and the combine read a product's unreduced chunk products and
    sum them as the linear's own reduction does, whichever schedule the product took."""
    import rlsys.kernels.triton_ops.linear as lin
    from rlsys.kernels.triton_ops.linear import linear_tree_fwd
    from rlsys.kernels.triton_ops.partials import partial_products

    monkeypatch.setattr(lin, "split_chosen", lambda *args, **kwargs: split)
    n, d, hid, e, k = 13, 64, 256, 6, 2
    x = _rand(n, hid)
    wo = _rand(d, hid, seed=1)
    parts = partial_products(x, wo, 8)
    assert parts.nch == (8 if split else 1)
    a = linear_tree_fwd(x, wo, 8)
    assert torch.equal(parts.reduced(), a)
    h, gamma = _rand(n, d, seed=2), _rand(d, seed=3)
    assert all(
        torch.equal(u, v)
        for u, v in zip(add_rms_norm_fwd(h, parts, gamma, 1e-6, torch.float32),
                        add_rms_norm_fwd(h, a, gamma, 1e-6, torch.float32), strict=True)
    )  # fmt: skip
    router = _rand(e, d, seed=4)
    raw_parts = partial_products(h, router, 1 if not split else 4)
    raw = linear_fwd(h, router) if not split else raw_parts.reduced()
    bias = torch.zeros(e, device=DEV)
    for got, want in zip(mr.route_fwd(raw_parts, bias, k), mr.route_fwd(raw, bias, k), strict=True):
        assert torch.equal(got, want)
    idx, gates = mr.route_fwd(raw, bias, k)
    max_tiles = -(-n * k // BM) + e
    pos, order, _, tiles = mr.expert_layout(idx, e, max_tiles, BM)
    w2 = _rand(e, d, hid, seed=5)
    hidden = _rand(n * k, hid, seed=6)
    down = partial_products(hidden, w2, 8, tiles)
    want_down = grouped_tree_fwd(hidden, w2, tiles, 8)
    assert torch.equal(down.reduced(), want_down)
    assert torch.equal(
        mr.combine_fwd(h, down, pos, gates, None), mr.combine_fwd(h, want_down, pos, gates, None)
    )


@pytest.mark.parametrize("split", [True, False], ids=["split", "serial"])
def test_projection_epilogue_and_shared_expert_read_partial_products(
    split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rlsys.kernels.triton_ops.linear as lin
    from rlsys.kernels.triton_ops.linear import column_chunks, linear_tree_fwd
    from rlsys.kernels.triton_ops.partials import partial_products

    monkeypatch.setattr(lin, "split_chosen", lambda *args, **kwargs: split)
    n, h, hkv, d, dm = 5, 4, 2, 8, 256
    x = _rand(n, dm)
    w = {name: _rand(r, dm, seed=i) for i, (name, r) in enumerate(
        {"wq": h * d, "wk": hkv * d, "wv": hkv * d, "wg": h}.items())}  # fmt: skip
    main, offsets = _fused(w, ["wq", "wk", "wv", "wg"])
    pos = torch.arange(3, 3 + n, device=DEV)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d)
    rows = torch.arange(n, device=DEV)
    outs = []
    for y in (partial_products(x, main, column_chunks(dm)), linear_fwd(x, main)):
        k_pool = torch.zeros(n, hkv, d, device=DEV)
        v_pool = torch.zeros_like(k_pool)
        outs.append((*qkv_post(y, offsets, pos, rows, inv, k_pool, v_pool, h), k_pool, v_pool))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    # the shared expert's down projection, unreduced, in the combine
    w2 = _rand(48, dm, seed=7)
    hh, ys = _rand(n, 48, seed=8), _rand(n * 2, 48, seed=9)
    pos2 = torch.arange(n * 2, device=DEV, dtype=torch.int32).view(n, 2)
    gates = torch.rand(n, 2, generator=torch.Generator().manual_seed(1)).to(DEV)
    got = mr.combine_fwd(hh, ys, pos2, gates, partial_products(x, w2, 8))
    assert torch.equal(got, mr.combine_fwd(hh, ys, pos2, gates, linear_tree_fwd(x, w2, 8)))
