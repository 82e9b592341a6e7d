"""Engine-vs-trainer alignment check (`rlsys align`): generate, recompute, compare bitwise.

For each TP degree the engine serves the same multi-turn workload: sessions of different
prompt lengths arrive together while `max_running` is smaller than their number (requests
join and leave the batch; prefill and decode share steps), a second turn extends every
session (prefix-cache hits), and two sessions share a first prompt (an exact hit). Then the
trainer's forward (`Transformer.forward`, TP=1, fresh, one sequence at a time) recomputes
every generated token's log-prob with `behaviour_log_probs` (candidate set, temperature).
At staleness 0 the difference must be exactly 0.0 for every degree.

`recompute` swaps that trainer side: `rlsys align` passes the trainer's real RL path
(`rlsys.trainer.recompute`: packing, chunked LM head, replay), which this package may not
import itself (the engine sits below the trainer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import ModelConfig
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.engine.core import EngineCore
from rlsys.engine.runners import make_runner
from rlsys.engine.sampler import behaviour_log_probs
from rlsys.model import Transformer


@dataclass(frozen=True)
class AlignRow:
    tp: int
    max_abs_logprob_diff: float
    num_tokens: int
    prefix_cache_hit_tokens: int
    max_batch_rows: int


def workload(seed: int, sessions: int, vocab: int) -> list[list[int]]:
    """First-turn prompts: printable bytes of varied lengths; sessions 0 and 1 share one."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(32, min(127, vocab), (5 + 9 * i,), generator=gen).tolist()
        for i in range(sessions)
    ]
    prompts[1] = list(prompts[0])
    return prompts


def run_engine(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    state: dict[str, torch.Tensor],
    prompts: list[list[int]],
    sampling: SamplingConfig,
) -> tuple[list[tuple[list[int], GenerationResult]], int]:
    """Two turns per session through one `EngineCore`; returns (prompt, result) pairs."""
    core = EngineCore(model_cfg, engine_cfg, make_runner(model_cfg, engine_cfg, state))
    pairs: list[tuple[list[int], GenerationResult]] = []
    last: list[tuple[list[int], GenerationResult]] = []
    max_rows = 0
    try:
        for turn in range(2):
            # the next turn: the whole context so far plus a short "observation"
            contexts = [
                ctx + res.token_ids + [10, 62, 32 + i] for i, (ctx, res) in enumerate(last)
            ] or [list(p) for p in prompts]
            for i, ctx in enumerate(contexts):
                req = GenerationRequest(f"s{i}:t{turn}", f"s{i}", ctx, sampling)
                assert core.add(req) is None, "the alignment workload is valid"
            done: dict[str, GenerationResult] = {}
            while core.has_work():
                rows_before = core.forward_rows
                done.update({r.request_id: r for r in core.step()})
                max_rows = max(max_rows, core.forward_rows - rows_before)
            last = [(ctx, done[f"s{i}:t{turn}"]) for i, ctx in enumerate(contexts)]
            assert all(r.finish_reason in ("stop", "length") for _, r in last)
            pairs += last
        return pairs, max_rows
    finally:
        core.runner.close()


def recompute_diff(
    model: Transformer, pairs: list[tuple[list[int], GenerationResult]], temperature: float
) -> tuple[float, int]:
    """Max |engine log-prob - trainer log-prob| and the number of tokens compared (the
    trainer side on the model's device)."""
    worst, count = 0.0, 0
    dev = next(model.parameters()).device
    for prompt, res in pairs:
        seq = prompt + res.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([seq[:-1]], device=dev), with_mtp=False).logits[0]
        width = max(len(c) for c in res.candidate_ids)
        cand = torch.full((len(res.token_ids), width), -1, dtype=torch.long)
        for j, ids in enumerate(res.candidate_ids):
            cand[j, : len(ids)] = torch.tensor(ids)
        trainer = behaviour_log_probs(
            logits[len(prompt) - 1 :],
            torch.tensor(res.token_ids, device=dev),
            cand.to(dev),
            temperature,
        ).cpu()
        engine = torch.tensor(res.logprobs, dtype=torch.float32)
        worst = max(worst, float((trainer - engine).abs().max()))
        count += len(res.token_ids)
    return worst, count


Pairs = list[tuple[list[int], GenerationResult]]
Recompute = Callable[[Transformer, Pairs, float], tuple[float, int]]


def alignment_report(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    sampling: SamplingConfig,
    degrees: list[int],
    seed: int = 0,
    sessions: int = 6,
    device: str = "cpu",
    recompute: Recompute = recompute_diff,
) -> list[AlignRow]:
    """One row per TP degree (see module doc); the trainer's side runs on `device`."""
    torch.manual_seed(seed)
    model = Transformer(model_cfg).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prompts = workload(seed, sessions, model_cfg.vocab_size)
    rows = []
    for degree in degrees:
        cfg = engine_cfg.model_copy(update={"tp": degree, "max_running": max(2, sessions - 2)})
        pairs, max_rows = run_engine(model_cfg, cfg, state, prompts, sampling)
        diff, count = recompute(model.to(device), pairs, sampling.temperature)
        hits = sum(res.prefix_cache_hit_tokens for _, res in pairs)
        rows.append(AlignRow(degree, diff, count, hits, max_rows))
    return rows
