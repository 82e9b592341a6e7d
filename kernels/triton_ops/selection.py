"""Which implementation makes the Sparse GQA indexer's selection: a registry, chosen per
process (`RLSYS_INDEXER`) or inside a block (`indexer_method`, for benches and tests).

Every implementation returns the same `Selection` bitwise (the k highest fp32 block scores
per row, ties to the lower block id; their tests compare them), so the choice is one of
speed, and an engine and a trainer may differ in it without any mismatch:
- `buffered` (default): scores to an fp32 buffer, then one program per row ranks it
  (`indexer.select_blocks`);
- `streamed`: no buffer; a program per query tile recomputes its scores in a few passes
  (`indexer_stream.select_blocks_streamed`). On the H100 it is no faster (2.72 -> 3.71 ms
  at 32K, 45.8 -> 45.2 at 128K), so it is not the default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.triton_ops.indexer import Selection, select_blocks
from rlsys.kernels.triton_ops.indexer_stream import select_blocks_streamed

Selector = Callable[..., Selection]
METHODS: dict[str, Selector] = {"buffered": select_blocks, "streamed": select_blocks_streamed}
_method = os.environ.get("RLSYS_INDEXER", "buffered")


def _check(name: str) -> str:
    if name not in METHODS:
        raise ValueError(
            f"indexer method {name!r} (RLSYS_INDEXER): expected one of {sorted(METHODS)}"
        )
    return name


def select_top_blocks(
    qi: Tensor,
    block_keys: Tensor,
    tiles: QueryTiles,
    bk_table: PagedKV,
    *,
    topk_blocks: int,
    block: int,
    precision: str,
    ids: bool,
) -> Selection:
    """The selection by the current method (see the module doc)."""
    return METHODS[_check(_method)](
        qi, block_keys, tiles, bk_table, topk_blocks=topk_blocks, block=block,
        precision=precision, ids=ids,
    )  # fmt: skip


@contextlib.contextmanager
def indexer_method(name: str) -> Iterator[None]:
    """Select with method `name` inside the block."""
    global _method
    saved, _method = _method, _check(name)
    try:
        yield
    finally:
        _method = saved
