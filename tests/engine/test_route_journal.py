"""The route journal hands each sequence exactly the rows a per-step append would have."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlsys.engine.route_journal import RouteJournal
from rlsys.engine.route_log import RouteLog

LAYERS, TOP_K, EXPERTS = 3, 2, 16


@dataclass(eq=False)
class _Seq:
    routes: RouteLog = field(default_factory=lambda: RouteLog(EXPERTS))


def _step(width: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, EXPERTS, (LAYERS, width, TOP_K), generator=gen, dtype=torch.uint8)
    return {"indices": ids, "gates": torch.rand(LAYERS, width, TOP_K, generator=gen)}


def _append_rows(compact: dict, owners: list[tuple[int, _Seq]]) -> None:
    for i, seq in owners:
        seq.routes.append_compact({key: t[:, i : i + 1] for key, t in compact.items()})


def test_journal_rows_equal_per_step_appends_across_epochs_and_folds() -> None:
    """Epochs longer than FOLD steps (stacked parts and a loose tail), a batch that drops a
    sequence and shifts columns, a direct append between epochs, and logs read mid-way:
    every log holds bitwise the rows, in the order, that per-step appends give."""
    gen = torch.Generator().manual_seed(0)
    seqs, want = [_Seq() for _ in range(4)], [_Seq() for _ in range(4)]
    journal = RouteJournal()
    prompt = _step(4, gen)  # a prompt's rows, appended before any journal row
    _append_rows(prompt, list(enumerate(seqs)))
    _append_rows(prompt, list(enumerate(want)))
    plan = [
        ([0, 1, 2, 3], RouteJournal.FOLD * 2 + 5),
        ([0, 2, 3], 7),  # sequence 1 left: columns shift
        ([3, 0], RouteJournal.FOLD + 1),  # columns reordered
    ]
    for members, steps in plan:
        for _ in range(steps):
            block = _step(len(members) + 1, gen)  # a padded row no sequence owns
            assert journal.take(block, [(c, seqs[m]) for c, m in enumerate(members)])
            _append_rows(block, [(c, want[m]) for c, m in enumerate(members)])
        assert journal.steps == steps
    journal.close()
    assert journal.steps == 0
    between = _step(4, gen)  # a host-scheduled step's rows after the journal closed
    _append_rows(between, list(enumerate(seqs)))
    _append_rows(between, list(enumerate(want)))
    for _ in range(3):
        block = _step(4, gen)
        journal.take(block, list(enumerate(seqs)))
        _append_rows(block, list(enumerate(want)))
    journal.close()
    journal.close()  # a closed journal hands nothing over twice
    for got, ref in zip(seqs, want, strict=True):
        assert got.routes.rows == ref.routes.rows
        a, b = got.routes.slice(0, got.routes.rows), ref.routes.slice(0, ref.routes.rows)
        assert all(torch.equal(a[k], b[k]) for k in b)
        assert torch.equal(got.routes.row(got.routes.rows - 1)["gates"], b["gates"][:, -1])


def test_journal_leaves_selection_blocks_to_the_caller() -> None:
    """A step with Sparse GQA selections (widths differ per step) is not journaled, and the
    rows held before it reach the logs first."""
    gen = torch.Generator().manual_seed(1)
    seqs = [_Seq(), _Seq()]
    journal = RouteJournal()
    first = _step(2, gen)
    assert journal.take(first, list(enumerate(seqs)))
    assert seqs[0].routes.rows == 0  # held, not handed over yet
    with_blocks = _step(2, gen) | {"blocks": torch.zeros(1, 2, 1, 3, dtype=torch.int16)}
    assert not journal.take(with_blocks, list(enumerate(seqs)))
    assert [s.routes.rows for s in seqs] == [1, 1]
    got = seqs[1].routes.row(0)
    assert torch.equal(got["indices"], first["indices"][:, 1])
