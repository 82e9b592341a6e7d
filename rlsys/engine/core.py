"""The engine's synchronous core: continuous batching over a model runner, one step at a time.

Each `step()` admits waiting requests (prefix-cache lookup first), packs one decode row for
every sequence that has a sampled token to feed plus prefill chunks of the others (within
`max_step_tokens`) into ONE forward step, then samples for every sequence whose rows are
all fed. Requests join and leave at every step. A decode step served by a CUDA graph is
launched first and its tokens drawn on the device; the host writes the previous step's
per-token records (log-prob, version, candidates, routes) while the GPU runs it; with
overlap (below) the next decode step is queued before the host reads this one's tokens,
so nothing of the host's stands between two decode steps.

Invariants:
- A token's log-probs depend only on its sequence (batch-invariant kernels): not on the
  batch, the chunking of its prefill, a prefix-cache hit or the TP degree.
- Every generated token records the policy version of the weights that produced it. A
  weight update recomputes the caches of in-flight sequences under the new weights (their
  next rows are a fresh prefill), so every token is exactly its version's full-forward
  sample; prefix-cache entries of the old version are dropped.
- A failed request (bad input, or a runner error while it was in flight) finishes with
  `finish_reason="error"` and a message; the core keeps serving the others.
- Speculative decoding (`speculative_tokens` = k > 0): after sampling, the MTP heads draft
  k tokens; the next step feeds the sampled token plus the drafts as one chunk (a verify),
  and the sampler walks its rows in order with the request's own generator, one draw per
  emitted token as in plain decoding. A draft is accepted only when the draw equals it; the
  first draw that differs (or the draw after the last draft) is emitted and the rest is
  rolled back (KV rows, routes, drafter inputs). So tokens, log-probs, candidate sets,
  routes and versions are bitwise those of plain decoding; only the step count changes.
- Overlap (`overlap_decode`, decode graphs that draw on the device): a decode step's
  results are read at the next `step()`, which first queues the following decode step on
  the device, fed the drawn tokens there; while the GPU runs it, the host reads the
  previous step, writes its records and checks its stops. Only a batch that can go on
  unchanged is queued ahead (nothing to admit, every running sequence in it, none at a
  length limit, none at its first token). A sequence that stops at a token already fed to
  a queued step takes that row back (`runner.retract`) before its cache is kept or freed,
  and the queued step's row of it is never read: tokens, records and caches are those of
  the step-by-step engine. Aborts and weight updates first settle the step in flight.

Why one file over 600 lines: admission, the step, overlap, sampling, records and the
prefix cache all read and write the same per-sequence state (`Sequence.in_flight`,
`num_cached`, the queued records and the journal) in an order the invariants above depend
on; split, that order would be spread over modules that each reach into the others'.
(The stats record lives in `rlsys.engine.stats`.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlsys.config.engine import EngineConfig
from rlsys.config.model import ModelConfig
from rlsys.engine.api import FinishReason, GenerationRequest, GenerationResult
from rlsys.engine.prefix_cache import PrefixCache, PrefixEntry
from rlsys.engine.route_journal import RouteJournal
from rlsys.engine.route_log import RouteLog, token_routes
from rlsys.engine.runner import DraftingRunner, LaunchedStep, ModelRunner
from rlsys.engine.sampler import (
    RowParams,
    SampledToken,
    UniformStream,
    request_seed,
    sample_batch,
)
from rlsys.engine.sequence import Sequence
from rlsys.engine.stats import EngineStats
from rlsys.engine.validation import request_error
from rlsys.kernels.host_to_device import moved_without_sync
from rlsys.model import RoutedExperts
from rlsys.tokenizer import ByteTokenizer


@dataclass
class _InFlight:
    """A decode step on the device whose results the host has not read (see module doc):
    row i fed `batch[i]`; a sequence in `dropped` ended before the step and took its row
    back."""

    batch: list[Sequence]
    launched: LaunchedStep
    dropped: set[int] = field(default_factory=set)  # id() of the sequences

    def live(self) -> list[tuple[int, Sequence]]:
        if not self.dropped:  # the usual case: every row, without a test per row
            return list(enumerate(self.batch))
        return [(i, s) for i, s in enumerate(self.batch) if id(s) not in self.dropped]


class EngineCore:
    """Scheduler + sampler over a `ModelRunner` (see module doc)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        runner: ModelRunner,
        version: int = 0,
        tokenizer: ByteTokenizer | None = None,
    ) -> None:
        self.model_cfg, self.cfg, self.runner, self.version = model_cfg, engine_cfg, runner, version
        self.tokenizer = tokenizer or ByteTokenizer()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix = PrefixCache(engine_cfg.prefix_cache_tokens, runner.free_cache)
        self.steps = self.generated_tokens = self.forward_rows = 0
        self.draft_tokens = self.accepted_draft_tokens = 0
        self._busy_s = 0.0
        self._deferred: list[Callable[[], None]] = []  # see `_defer`
        # emitted tokens' records, written by `_flush` (while the GPU runs the next step)
        self._records: list[tuple[Sequence, SampledToken, int, int]] = []
        self._journal = RouteJournal()  # graph decode steps' routes (see `_keep_route_rows`)
        self._in_flight: _InFlight | None = None  # overlap (see module doc)
        self._done: list[GenerationResult] = []  # finished while settling outside `step`
        self._overlap = engine_cfg.overlap_decode and not engine_cfg.speculative_tokens
        self._fold_phase = 0  # the next request's route-log phase (`RouteLog`: spread folds)
        engine_cfg.check_model(model_cfg)

    # ---- requests ----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> GenerationResult | None:
        """Queue a request; returns its error result at once if it cannot run."""
        error = request_error(request, self.model_cfg.vocab_size, self.cfg.max_context_tokens)
        if error is None and self._find(request.request_id) is not None:
            error = f"request_id {request.request_id!r} is already in flight"
        if error is not None:
            return GenerationResult(
                request.request_id,
                finish_reason="error",
                error=error,
                prompt_tokens=len(request.prompt_ids),
            )
        rng = torch.Generator().manual_seed(
            request_seed(request.seed, self.cfg.seed, request.request_id)
        )
        self.waiting.append(
            Sequence(
                request,
                [self.tokenizer.encode(text) for text in request.stop_strings],
                RouteLog(self.model_cfg.n_experts, self.cfg.route_gates, self._fold_phase),
                RowParams(request.sampling, self.cfg.candidate_cap, stream=UniformStream(rng)),
            )
        )
        self._fold_phase = (self._fold_phase + 1) % RouteLog.FOLD
        return None

    def abort(self, request_id: str) -> GenerationResult | None:
        """Stop a request now; returns its partial result (None if unknown)."""
        self._done += self._drain()
        for result in self._done:  # it finished in the step just settled
            if result.request_id == request_id:
                self._done.remove(result)
                return result
        seq = self._find(request_id)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        return self._close(seq, "abort")

    def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Load version `version`; in-flight sequences continue, recomputed under it."""
        self._done += self._drain()  # the step on the device ran under the old version
        self._flush()
        self.runner.load_state_dict(state)
        superseded, self.version = self.version, version
        self.prefix.clear()
        for seq in self.running:
            if seq.routes.rows:  # what the old version computed, for its tokens' replay
                seq.result.superseded_routes.append(
                    (superseded, seq.routes.slice(0, seq.routes.rows))
                )
            self.runner.free_cache(seq.cache_key)
            seq.cache_key = self.runner.new_cache()
            seq.num_cached, seq.ready_logits = 0, None
            seq.drafts = []
            seq.routes.clear()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._done)

    # ---- one step ----------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """Admit, run one packed forward, sample; returns the requests that finished."""
        started = time.perf_counter()
        finished, self._done = self._done, []
        self._admit()
        try:
            if self._in_flight is not None:
                finished += self._advance()
            else:
                self._forward()
                if self._in_flight is None:
                    finished += self._sample_ready()
        except Exception as err:  # a runner failure fails the batch in flight, not the engine
            return finished + self._fail_running(err)
        self.steps += 1
        self._busy_s += time.perf_counter() - started
        return finished

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running:
            seq = self.waiting.popleft()
            entry = (
                self.prefix.lookup(seq.tokens, self.version)
                if self.cfg.prefix_cache_tokens
                else None
            )
            if entry is None:
                seq.cache_key = self.runner.new_cache()
            else:
                hit = len(entry.tokens)
                seq.cache_key = self.runner.fork_cache(entry.cache_key)
                seq.num_cached = hit
                seq.routes.extend(entry.routes, hit)
                seq.result.prefix_cache_hit_tokens = hit
                if hit == seq.prompt_len:
                    seq.ready_logits = entry.last_logits
            self.running.append(seq)

    def _forward(self) -> None:
        budget = self.cfg.max_step_tokens
        todo = [s for s in self.running if s.ready_logits is None]
        # decode rows first (one each) so a long prefill never stalls running sequences
        todo.sort(key=lambda s: s.num_pending > 1)
        batch: list[tuple[Sequence, list[int]]] = []
        for seq in todo:
            if budget <= 0:
                break
            n = min(seq.num_pending, budget)
            chunk = seq.tokens[seq.num_cached : seq.num_cached + n]
            if seq.drafts and seq.num_pending == 1:  # a verify: the token plus its drafts
                seq.fed_drafts, seq.drafts = seq.drafts[: budget - 1], []
                chunk = chunk + seq.fed_drafts
            batch.append((seq, chunk))
            budget -= len(chunk)
        if not batch:
            return
        # decode rows that will sample right after this step: the runner may draw their
        # tokens on the device, inside the step (decode graphs), from their own generators
        sampling = None
        if all(len(c) == 1 and seq.num_pending == 1 for seq, c in batch):
            sampling = [s.sample_row for s, _ in batch]
        keys, chunks = [s.cache_key for s, _ in batch], [c for _, c in batch]
        launch = getattr(self.runner, "launch", None)
        launched = launch(keys, chunks, sampling) if launch is not None else None
        # the previous step's records are written while the GPU runs this one
        self._flush(settle=False)
        if launched is not None and launched.tokens is not None and self._overlap:
            # read at the next step, after it queues the following one (see module doc)
            self._in_flight = _InFlight([s for s, _ in batch], launched)
            for seq, _ in batch:
                seq.in_flight = self._in_flight
            self.forward_rows += len(batch)
            return
        if launched is not None:
            out = launched.collect()
        else:
            out = self.runner.step(keys, chunks, sampling)
        if out.routes is not None:
            routes = out.routes
            self._defer(lambda: self._keep_routes(routes, batch))
        row = 0
        for i, (seq, chunk) in enumerate(batch):
            if out.sampled is not None:
                seq.presampled = out.sampled[i]
            row += len(chunk)
            seq.spec_rows = len(seq.fed_drafts)
            seq.num_cached += len(chunk) - seq.spec_rows
            if seq.spec_rows:
                assert out.row_logits is not None, "speculative decoding runs on LocalRunner"
                seq.verify_logits = out.row_logits[i]
                seq.ready_logits = seq.verify_logits[0]
            elif seq.num_pending == 0:
                seq.ready_logits = out.last_logits[i]
        self.forward_rows += row

    # ---- overlap (see module doc) --------------------------------------------------------

    def _advance(self) -> list[GenerationResult]:
        """Queue the next decode step behind the one in flight (when the batch goes on),
        then read the one in flight: its records, stops and finished requests."""
        prev, self._in_flight = self._in_flight, None
        assert prev is not None
        self._in_flight = self._launch_ahead(prev)
        self._flush(settle=False)  # the records of the step before, while the GPU runs
        return self._read_step(prev)

    def _launch_ahead(self, prev: _InFlight) -> _InFlight | None:
        rows = prev.live()
        live = [s for _, s in rows]
        if len(live) != len(self.running) or (
            self.waiting and len(self.running) < self.cfg.max_running
        ):
            return None  # the batch changes: the next step is scheduled from the host
        limit = self.cfg.max_context_tokens
        for seq in live:  # one that surely stops at prev's token, or samples its first
            generated = seq.num_generated
            if (
                generated == 0
                or generated + 1 >= seq.request.sampling.max_tokens_per_turn
                or len(seq.tokens) + 1 >= limit
            ):
                return None
        tokens = prev.launched.tokens
        assert tokens is not None
        if len(live) < len(prev.batch):
            # without a sync: a pageable copy would wait for the step in flight
            kept = torch.tensor([i for i, _ in rows])
            tokens = tokens[moved_without_sync(kept, tokens.device)]
        sampling = [s.sample_row for s in live]
        launch = self.runner.launch  # type: ignore[attr-defined]
        launched = launch([s.cache_key for s in live], [[0]] * len(live), sampling, tokens)
        if launched is None:  # no graph holds the batch now (a context bucket outgrown)
            return None
        ahead = _InFlight(live, launched)
        for seq in live:
            seq.in_flight = ahead
        self.forward_rows += len(live)
        return ahead

    def _read_step(self, step: _InFlight) -> list[GenerationResult]:
        """Read a decode step's results and sample (emit) its rows' tokens."""
        out = step.launched.collect()
        live = step.live()
        if out.routes is not None and live:
            routes = out.routes
            self._defer(lambda: self._keep_route_rows(routes, live))
        assert out.sampled is not None
        if self._drawn_in_order(live):
            return self._emit_drawn(step, live, out.sampled, out.last_logits)
        rows = out.last_logits.unbind(0)  # every row's view in one call, not one per row
        for i, seq in live:
            seq.presampled = out.sampled[i]
            seq.num_cached += 1
            seq.ready_logits = rows[i]
            if seq.in_flight is step:
                seq.in_flight = None
        return self._sample_ready()

    def _drawn_in_order(self, live: list[tuple[int, Sequence]]) -> bool:
        """Whether a decode step's rows can be emitted in one pass (`_emit_drawn`): no
        drafts to verify, every running sequence is a row of the step, in running order,
        and each has sampled before (no prompt to remember). Then `_sample_ready` would
        take exactly these rows, in this order, each with the token drawn on the device."""
        running = self.running
        if self.cfg.speculative_tokens or len(live) != len(running):
            return False
        return all(
            seq is ran and seq.num_generated > 0
            for (_, seq), ran in zip(live, running, strict=True)
        )

    def _emit_drawn(
        self, step: _InFlight, live: list[tuple[int, Sequence]], drawn: list[SampledToken],
        logits: Tensor,
    ) -> list[GenerationResult]:  # fmt: skip
        """`_read_step` + `_sample_ready` for a step `_drawn_in_order` admits, in one pass
        over its rows: the same records, stops and results in the same order, without
        parking each row's token and logits on its sequence first (per sequence per
        step, this is the host's hottest loop at large batches)."""
        finished = []
        limit = self.cfg.max_context_tokens
        for i, seq in live:
            seq.num_cached += 1
            if seq.in_flight is step:
                seq.in_flight = None
            self._emit(seq, drawn[i])
            reason = seq.stop_reason(limit)
            if reason is not None:
                self.running.remove(seq)
                finished.append(self._finish(seq, reason, logits[i]))
        return finished

    def _drain(self) -> list[GenerationResult]:
        """Settle the step in flight (before an abort or a weight update)."""
        if self._in_flight is None:
            return []
        step, self._in_flight = self._in_flight, None
        try:
            self._flush()
            return self._read_step(step)
        except Exception as err:  # as in `step`: the batch fails, the engine serves on
            return self._fail_running(err)

    def _fail_running(self, err: Exception) -> list[GenerationResult]:
        """A runner failure: every running request ends with an error, nothing in flight."""
        self._in_flight = None
        for seq in self.running:
            seq.in_flight = None
        failed = [self._close(seq, "error", f"engine step failed: {err!r}") for seq in self.running]
        self.running = []
        return failed

    def _retract(self, seq: Sequence) -> None:
        """A sequence ends: take back its row of a step queued before that was known."""
        step = seq.in_flight
        if step is not None and seq.cache_key is not None:
            self.runner.retract(seq.cache_key)  # type: ignore[attr-defined]
            step.dropped.add(id(seq))
        seq.in_flight = None

    def _keep_route_rows(self, routes: RoutedExperts, rows: list[tuple[int, Sequence]]) -> None:
        """Each sequence keeps its row of a decode step's routes: through the journal,
        which hands them over per epoch of unchanged batch, not per step (`RouteJournal`)."""
        compact = routes.to_compact(self.model_cfg.n_experts, self.cfg.route_gates)
        if self._journal.take(compact, rows):
            return
        # every row's (L, 1, k) view in one call per key: a Python slice per row and key
        # cost ~2.5x as much, for every sequence at every decode step
        columns = {key: t.split(1, dim=1) for key, t in compact.items()}
        for i, seq in rows:
            seq.routes.append_compact({key: cols[i] for key, cols in columns.items()})

    def _keep_routes(self, routes: RoutedExperts, batch: list[tuple[Sequence, list[int]]]) -> None:
        """Each sequence keeps its rows of a step's routes (compacted once for the step)."""
        self._journal.close()  # the journal's rows come first (`RouteJournal`)
        compact = routes.to_compact(self.model_cfg.n_experts, self.cfg.route_gates)
        row = 0
        for seq, chunk in batch:
            rows = slice(row, row + len(chunk))
            seq.routes.append_compact({key: t[:, rows] for key, t in compact.items()})
            row += len(chunk)

    def _defer(self, record: Callable[[], None]) -> None:
        """Queue host bookkeeping that no scheduling decision reads (route rows, per-token
        records): written by `_flush`, while the GPU runs the next step (or before anything
        reads them: a finished, aborted or updated sequence flushes first)."""
        if self.cfg.speculative_tokens:  # verifies roll rows back within the step
            record()
        else:
            self._deferred.append(record)

    def _flush(self, settle: bool = True) -> None:
        """Write the deferred records; `settle`: also hand the journal's routes to the
        sequences' logs (anything that reads or rebuilds a log settles first; the per-step
        flushes that overlap the GPU leave the journal open)."""
        emitted, self._records = self._records, []
        self._write_records(emitted)
        records, self._deferred = self._deferred, []
        for record in records:
            record()
        if settle:
            self._journal.close()

    def _sample_ready(self) -> list[GenerationResult]:
        """Sample every sequence whose rows are all fed, in batches (one host copy each).

        Round j samples row j of each verify (row 0 of the others); a sequence goes on to
        round j + 1 only while its draws equal its drafts (see module doc)."""
        ready = [s for s in self.running if s.ready_logits is not None]
        if not ready:
            return []
        active, current = ready, [s.ready_logits for s in ready]
        for seq in ready:
            seq.ready_logits = None
            if seq.num_generated == 0:
                self._remember_prompt(seq, current[ready.index(seq)])  # type: ignore[arg-type]
        finished, j = [], 0
        while active:
            sampled = self._draw(active, current)
            next_active, next_logits = [], []
            for seq, tok, logits in zip(active, sampled, current, strict=True):
                self._emit(seq, tok)
                reason = seq.stop_reason(self.cfg.max_context_tokens)
                if reason is None and j < seq.spec_rows and tok.token_id == seq.fed_drafts[j]:
                    self.accepted_draft_tokens += 1
                    seq.num_cached += 1  # the draft's row now holds a sampled token
                    next_active.append(seq)
                    next_logits.append(seq.verify_logits[j + 1])  # type: ignore[index]
                    continue
                if seq.spec_rows:  # a verify: roll back its rejected drafts
                    self._settle(seq, j)
                if reason is not None:
                    self.running.remove(seq)
                    finished.append(self._finish(seq, reason, logits))  # type: ignore[arg-type]
            active, current, j = next_active, next_logits, j + 1
        if self.cfg.speculative_tokens:
            self._draft([s for s in ready if s.cache_key is not None])
        return finished

    def _draw(self, active: list[Sequence], current: list[Tensor]) -> list[SampledToken]:
        """One token per sequence: the one its step drew on the device, else sampled here
        (in one batch) from its logits."""
        todo = [i for i, s in enumerate(active) if s.presampled is None]
        drawn = [s.presampled for s in active]
        if todo:
            rows = [active[i] for i in todo]
            params = [s.sample_row for s in rows]
            logits = torch.stack([current[i] for i in todo])
            for i, tok in zip(
                todo, sample_batch(logits, params, self.cfg.sample_vocab), strict=True
            ):
                drawn[i] = tok
        for seq in active:
            seq.presampled = None
        return drawn  # type: ignore[return-value]

    def _emit(self, seq: Sequence, tok: SampledToken) -> None:
        # its record is written by `_flush` (a tuple queued, not a closure per token)
        self._records.append((seq, tok, self.version, len(seq.tokens) - 1))
        seq.tokens.append(tok.token_id)
        self.generated_tokens += 1

    @staticmethod
    def _write_records(records: list[tuple[Sequence, SampledToken, int, int]]) -> None:
        """Generated tokens' records: id, log-prob, version, candidates, each after its
        sequence's earlier ones. A token's input row's routes stay in the sequence's log
        until the result is made (`_result`)."""
        for seq, tok, version, row in records:
            res = seq.result
            assert row == seq.prompt_len - 1 + len(res.token_ids), "token j's input row"
            res.token_ids.append(tok.token_id)
            res.logprobs.append(tok.logprob)
            res.versions.append(version)
            res.candidate_ids.append(tok.candidates)
            res.candidate_capped.append(tok.capped)

    def _settle(self, seq: Sequence, accepted: int) -> None:
        """End a verify: roll back the rows of the drafts after the `accepted` first ones."""
        if seq.spec_rows > accepted:
            runner: DraftingRunner = self.runner  # type: ignore[assignment]
            runner.truncate_cache(seq.cache_key, seq.num_cached)  # type: ignore[arg-type]
            seq.routes.truncate(seq.num_cached)
        self.draft_tokens += seq.spec_rows
        seq.fed_drafts, seq.spec_rows, seq.verify_logits = [], 0, None

    def _draft(self, seqs: list[Sequence]) -> None:
        """Draft the next tokens of sequences that just sampled (see mtp_drafter)."""
        runner: DraftingRunner = self.runner  # type: ignore[assignment]
        drafts = runner.draft([s.cache_key for s in seqs], [s.tokens for s in seqs])  # type: ignore[misc]
        for seq, guess in zip(seqs, drafts, strict=True):
            room = min(
                seq.request.sampling.max_tokens_per_turn - seq.num_generated,
                self.cfg.max_context_tokens - len(seq.tokens),
            )
            seq.drafts = guess[: max(room - 1, 0)]

    # ---- prefix cache ------------------------------------------------------------------

    def _remember_prompt(self, seq: Sequence, logits: Tensor) -> None:
        """Snapshot the cache right after the prompt (serves a group's identical prompts)."""
        self._flush()
        prompt = tuple(seq.request.prompt_ids)
        if not self.cfg.prefix_cache_tokens or prompt in self.prefix:
            return
        routes = RouteLog(self.model_cfg.n_experts, self.cfg.route_gates)
        routes.extend(seq.routes, len(prompt))
        key = self.runner.fork_cache(seq.cache_key)
        self.prefix.insert(PrefixEntry(prompt, key, logits, routes, self.version))

    def _finish(self, seq: Sequence, reason: FinishReason, logits: Tensor) -> GenerationResult:
        """Hand the finished cache (covering tokens[:-1]) to the prefix cache."""
        self._retract(seq)
        self._flush()
        result = self._result(seq, reason)
        if self.cfg.prefix_cache_tokens:
            covered = tuple(seq.tokens[: seq.num_cached])
            self.prefix.insert(
                PrefixEntry(covered, seq.cache_key, logits, seq.routes, self.version)
            )
        else:
            self.runner.free_cache(seq.cache_key)
        seq.cache_key = None
        return result

    def _close(
        self, seq: Sequence, reason: FinishReason, error: str | None = None
    ) -> GenerationResult:
        self._retract(seq)
        self._flush()
        if seq.cache_key is not None:
            self.runner.free_cache(seq.cache_key)
            seq.cache_key = None
        result = self._result(seq, reason)
        result.error = error
        return result

    def _result(self, seq: Sequence, reason: FinishReason) -> GenerationResult:
        res = seq.result
        res.finish_reason = reason
        rows = min(seq.prompt_len - 1, seq.routes.rows)
        if seq.routes.rows:
            res.prompt_routed_experts = seq.routes.slice(0, rows)
        # Tokens' routes from the log: after a weight update the engine fed their rows again
        # under the new version, which later tokens saw; a row not fed again yet keeps the
        # route its token was emitted with (`token_routes`).
        res.routed_experts = token_routes(
            seq.routes, seq.prompt_len - 1, res.versions, res.superseded_routes
        )
        return res

    def _find(self, request_id: str) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request.request_id == request_id:
                return seq
        return None

    def stats(self) -> EngineStats:
        return EngineStats(
            version=self.version,
            running=len(self.running),
            waiting=len(self.waiting),
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            forward_rows=self.forward_rows,
            tokens_per_s=self.generated_tokens / self._busy_s if self._busy_s else 0.0,
            prompt_tokens=self.prefix.prompt_tokens,
            prefix_cache_hit_tokens=self.prefix.hit_tokens,
            prefix_cache_hit_rate=self.prefix.hit_rate,
            prefix_cache_entries=len(self.prefix),
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
        )
