"""MTP drafts for speculative decoding: each sequence's head caches and not-yet-fed inputs.

Rows: main row p has input token tokens[p] and final hidden h_p (= h^0_p). Head d's row p
takes h^{d-1}_p and embed(tokens[p + d]) and predicts tokens[p + 1 + d] (as in training,
`Transformer.forward`). When the main cache covers N rows and token N was just sampled,
head d's row N - 1 drafts token N + d; its input token N - 1 + d is a draft for d >= 2.

Invariants:
- Head d has fed rows [0, committed[d]) to its cache, and every input token of those rows
  was sampled (never a draft): a rejected draft needs no rollback of the heads.
- `inputs[d]` holds h^{d-1} for rows [committed[d], committed[d] + n), not yet fed.
- Rows whose input token is a draft run on a throwaway snapshot of the head's cache.
- Drafts change only how many tokens one verify step yields, never which: the engine
  accepts a draft only when the seeded sampler draws it (`rlsys.engine.core`).
A draft is the head's argmax over the sampled vocabulary (the token most likely drawn).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys import kernels
from rlsys.model import SlidingKVCache, Transformer
from rlsys.model.attention import SeqSpan


@dataclass
class DraftState:
    caches: list[SlidingKVCache]
    committed: list[int]
    inputs: list[Tensor]

    def fork(self) -> DraftState:
        """A copy sharing tensors (caches are never written in place)."""
        return DraftState(
            [copy.copy(c) for c in self.caches], list(self.committed), list(self.inputs)
        )


@dataclass
class _Rows:
    """One head call: per sequence, rows [pos, pos + n) with their inputs."""

    index: list[int]
    spans: list[SeqSpan]
    h: list[Tensor]
    tokens: list[list[int]]
    caches: list[SlidingKVCache]


class Drafter:
    """Per-sequence MTP state keyed like the runner's caches; drafts k tokens in a batch."""

    def __init__(self, model: Transformer, k: int, sample_vocab: int | None) -> None:
        assert 1 <= k <= len(model.mtp), "validated by the engine (speculative_tokens)"
        self.model, self.k, self.sample_vocab = model, k, sample_vocab
        self.states: dict[int, DraftState] = {}

    def new(self, key: int, device: torch.device) -> None:
        model = self.model
        empty = torch.zeros(0, model.cfg.d_model, device=device)
        self.states[key] = DraftState(
            [model.mtp[d].block.attn.new_cache(model.dtype, device) for d in range(self.k)],
            [0] * self.k,
            [empty] * self.k,
        )

    def fork(self, key: int, new: int) -> None:
        self.states[new] = self.states[key].fork()

    def free(self, key: int) -> None:
        self.states.pop(key, None)

    def feed(self, key: int, first_row: int, hidden: Tensor) -> None:
        """Trunk hidden rows (n, d) of main rows [first_row, first_row + n)."""
        st = self.states[key]
        assert first_row == st.committed[0] + st.inputs[0].shape[0], "rows arrive in order"
        st.inputs[0] = torch.cat([st.inputs[0], hidden.float()])

    def truncate(self, key: int, length: int) -> None:
        """Forget trunk rows >= length (rejected drafts of a verify)."""
        st = self.states[key]
        assert length >= st.committed[0], "committed rows are never rolled back"
        st.inputs[0] = st.inputs[0][: length - st.committed[0]]

    @torch.inference_mode()
    def draft(self, keys: list[int], tokens: list[list[int]]) -> list[list[int]]:
        """k drafts per sequence, for tokens[len(t)] .. (each cache covers len(t) - 1 rows)."""
        drafts: list[list[int]] = [[] for _ in keys]
        spec: list[Tensor | None] = [None] * len(keys)  # head d-1's rows whose input is a draft
        for d in range(1, self.k + 1):
            committed, speculative = self._plan(d, keys, tokens, drafts, spec)
            out_c = self._run(d, committed)
            out_s = self._run(d, speculative)
            last: dict[int, Tensor] = {}
            for i, (h, normed) in zip(committed.index, out_c, strict=True):
                st = self.states[keys[i]]
                if d < self.k:
                    st.inputs[d] = torch.cat([st.inputs[d], h])
                if d == 1:  # deeper heads draft from their speculative last row
                    last[i] = normed[-1]
            for i, (h, normed) in zip(speculative.index, out_s, strict=True):
                spec[i], last[i] = h, normed[-1]
            if not last:
                break
            rows = sorted(last)
            logits = kernels.linear(torch.stack([last[i] for i in rows]), self.model.lm_head)
            picks = logits.float()[:, : self.sample_vocab].argmax(-1).tolist()
            for i, tok in zip(rows, picks, strict=True):
                if len(drafts[i]) == d - 1:
                    drafts[i].append(int(tok))
        return drafts

    def _plan(
        self,
        d: int,
        keys: list[int],
        tokens: list[list[int]],
        drafts: list[list[int]],
        spec: list[Tensor | None],
    ) -> tuple[_Rows, _Rows]:
        """Head d's rows: those with sampled inputs (committed here) and those with drafts."""
        committed, speculative = _Rows([], [], [], [], []), _Rows([], [], [], [], [])
        for i, key in enumerate(keys):
            st, ext = self.states[key], tokens[i] + drafts[i]
            n_rows = len(tokens[i]) - 1  # main rows cached
            c, known_end = st.committed[d - 1], n_rows + 1 - d
            if len(drafts[i]) < d - 1 or c > known_end or n_rows == 0:
                continue
            if known_end > c:
                committed.index.append(i)
                committed.spans.append(SeqSpan(0, known_end - c, c))
                committed.h.append(st.inputs[d - 1][: known_end - c])
                committed.tokens.append(ext[c + d : known_end + d])
                committed.caches.append(st.caches[d - 1])
                st.inputs[d - 1] = st.inputs[d - 1][known_end - c :]
                st.committed[d - 1] = known_end
            if d > 1:
                parts = [st.inputs[d - 1][:1]] + ([spec[i]] if spec[i] is not None else [])
                h = torch.cat(parts)
                if h.shape[0] != d - 1:
                    continue
                speculative.index.append(i)
                speculative.spans.append(SeqSpan(0, d - 1, known_end))
                speculative.h.append(h)
                speculative.tokens.append(ext[known_end + d : n_rows + d])
                speculative.caches.append(copy.copy(st.caches[d - 1]))
        return committed, speculative

    def _run(self, d: int, rows: _Rows) -> list[tuple[Tensor, Tensor]]:
        """Head d over the packed rows -> per sequence (hidden fp32, normed) rows."""
        if not rows.index:
            return []
        model, spans, at = self.model, [], 0
        for s in rows.spans:
            spans.append(SeqSpan(at, s.n, s.pos))
            at += s.n
        device = rows.h[0].device
        ids = torch.tensor([t for ts in rows.tokens for t in ts], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(s.pos, s.pos + s.n, device=device) for s in spans])
        h, normed = model.mtp[d - 1].step(
            torch.cat(rows.h), model.embed[ids].float(), positions, spans, rows.caches
        )
        return [(h[s.row : s.row + s.n], normed[s.row : s.row + s.n]) for s in spans]
