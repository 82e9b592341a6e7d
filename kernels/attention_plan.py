"""How a varlen attention call is laid out for the Triton kernels (torch only, no triton).

Legend: N query rows of the call, S sequences, H query heads, Hkv KV groups, G = H / Hkv,
D head dim, T query slots per tile.

- Query tiles. A tile is T consecutive absolute positions [slot0, slot0 + T) of ONE
  sequence, aligned (slot0 % T == 0); the positions of this call inside it are [lo, hi)
  and sit in query rows row .. row + (hi - lo). A kernel program handles one tile and one
  KV group: M = T * G rows ordered (slot, head). A decode token is a tile with one present
  slot; a prefill chunk or a training sequence fills its tiles. The slot a position takes
  is position % T in every case, so a query sits in the same tile row whatever the call.
- Keys are addressed through a block table: logical page p of sequence s starts at row
  `block_table[s, p]` of the K/V pool (rows of PAGE tokens). The engine's paged pools and
  the trainer's packed K/V (a sequence's pages are consecutive rows) are both pools.
Invariant: nothing here depends on how many sequences share the call; tiles and steps are
functions of absolute positions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys.kernels.host_to_device import index_arrays_on


@dataclass(frozen=True)
class QueryTiles:
    """Query tiles of one call (see module doc); all int32 tensors on the kernels' device."""

    T: int
    seq: Tensor  # (n_tiles,)
    slot0: Tensor  # (n_tiles,)
    lo: Tensor  # (n_tiles,)
    hi: Tensor  # (n_tiles,)
    row: Tensor  # (n_tiles,)
    q_seq: Tensor  # (N,)
    q_pos: Tensor  # (N,)
    max_pos: int = 0  # the largest query position (known on the host: no device sync)
    host_row: tuple[int, ...] = ()  # per tile: first query row, and present rows (host)
    host_rows: tuple[int, ...] = ()
    host_hi: tuple[int, ...] = ()  # per tile: one past its last position (host); () unknown

    @property
    def n_tiles(self) -> int:
        return int(self.seq.shape[0])

    @property
    def n_rows(self) -> int:
        return int(self.q_pos.shape[0])


@dataclass(frozen=True)
class PagedKV:
    """Where each sequence's keys live in a pool: row offsets of its logical pages."""

    block_table: Tensor  # (S, max_pages) int32
    page_size: int
    # every sequence's pages are consecutive rows, block_table[s, p] = block_table[s, 0] +
    # p * page_size (`contiguous_table`): a kernel may address a key as its sequence's
    # first row plus its position, without the table
    contiguous: bool = False


@dataclass(frozen=True)
class Span:
    """Rows [row, row + n) of the call hold positions [pos, pos + n) of sequence `seq`."""

    seq: int
    row: int
    n: int
    pos: int


def plan_tiles(spans: list[Span], T: int, device: torch.device | str) -> QueryTiles:
    """Query tiles covering every span (vectorised; one asynchronous host->device copy)."""
    seq = torch.tensor([s.seq for s in spans], dtype=torch.int64)
    row = torch.tensor([s.row for s in spans], dtype=torch.int64)
    n = torch.tensor([s.n for s in spans], dtype=torch.int64)
    pos = torch.tensor([s.pos for s in spans], dtype=torch.int64)
    first, last = pos // T, (pos + n - 1) // T
    count = last - first + 1
    span_of_tile = torch.repeat_interleave(torch.arange(len(spans)), count)
    starts = torch.cumsum(count, 0) - count
    j = first[span_of_tile] + torch.arange(int(count.sum())) - starts[span_of_tile]
    slot0 = j * T
    lo = torch.maximum(pos[span_of_tile], slot0)
    hi = torch.minimum(pos[span_of_tile] + n[span_of_tile], slot0 + T)
    tile_row = row[span_of_tile] + lo - pos[span_of_tile]
    q_seq = torch.repeat_interleave(seq, n)
    q_pos = torch.cat([torch.arange(s.pos, s.pos + s.n) for s in spans])
    on_device = index_arrays_on(device, seq[span_of_tile], slot0, lo, hi, tile_row, q_seq, q_pos)
    return QueryTiles(
        T,
        *on_device,
        max_pos=int(q_pos.max()) if q_pos.numel() else 0,
        host_row=tuple(tile_row.tolist()),
        host_rows=tuple((hi - lo).tolist()),
        host_hi=tuple(hi.tolist()),
    )


def contiguous_table(lengths: list[int], page_size: int, device: torch.device | str) -> PagedKV:
    """A block table for sequences packed back to back in one tensor (the trainer's K/V):
    sequence i's rows start where sequence i-1's end, its pages are consecutive rows."""
    max_pages = max((length + page_size - 1) // page_size for length in lengths)
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
    table = starts[:, None] + torch.arange(max_pages)[None, :] * page_size
    (on_device,) = index_arrays_on(device, table)
    return PagedKV(on_device, page_size, contiguous=True)
