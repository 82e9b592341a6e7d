"""The indexer's k-th-key search selects exactly the reference top-k, whatever the row.

`select_from_scores` runs the selection kernel on hand-made score rows, so the search can be
given what a dot product rarely produces: heavy tails, values over many binades, rows of a
few distinct values (ties at the k-th score), signed zeros, infinities, constant rows. The
reference ranks by the same order (-0.0 below +0.0) with ties to the lower block id.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.indexer import select_from_scores  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH, K = 300, 37  # rows past RANK_MAX (so the search runs), k not a power of two


def _rows(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, WIDTH, generator=g)
    if kind == "heavy":
        return x**3 * 5
    if kind == "binades":  # magnitudes from 1e-30 to 1e30, both signs
        return torch.sign(x) * torch.exp(torch.rand(n, WIDTH, generator=g) * 138 - 69)
    if kind == "ties":  # four distinct values: hundreds tie at the k-th
        return torch.randint(0, 4, (n, WIDTH), generator=g).float()
    if kind == "zeros":  # signed zeros around the k-th score
        z = torch.where(x > 0, torch.tensor(0.0), torch.tensor(-0.0))
        return torch.where(x.abs() > 1.7, x, z)
    if kind == "infinities":
        return torch.where(x > 1.9, torch.tensor(float("inf")), torch.where(x < -2, -1e38, x))
    if kind == "constant":
        return torch.full((n, WIDTH), 2.5)
    return x


def _reference(scores: torch.Tensor, n_past: torch.Tensor) -> list[list[int]]:
    bits = scores.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    out = []
    for r in range(scores.shape[0]):
        n = int(n_past[r])
        order = torch.sort(key[r, :n], descending=True, stable=True).indices[:K]
        out.append(sorted(order.tolist()))
    return out


KINDS = ["gaussian", "heavy", "binades", "ties", "zeros", "infinities", "constant"]


@pytest.mark.parametrize("guesses", [24, 0], ids=["interpolated", "halving"])
@pytest.mark.parametrize("kind", KINDS)
def test_search_selects_the_reference_top_k(kind: str, guesses: int) -> None:
    g = torch.Generator().manual_seed(KINDS.index(kind))
    n = 12
    scores = _rows(kind, n, g)
    n_past = torch.randint(K + 1, WIDTH + 1, (n,), generator=g)
    n_past[0], n_past[1] = K + 1, WIDTH  # one more than k, and the whole row
    sel = select_from_scores(
        scores.to(DEV), n_past.to(DEV), topk_blocks=K, rank_max=0, guesses=guesses
    )
    ids, words = sel.ids[:, 0].cpu(), sel.bits[:, 0].cpu()
    for r, want in enumerate(_reference(scores, n_past)):
        assert ids[r].tolist() == want, (kind, r)
        w = [int(v) & 0xFFFFFFFF for v in words[r]]
        assert [b for b in range(32 * len(w)) if (w[b // 32] >> (b % 32)) & 1] == want, (kind, r)
