"""Shared helpers: a tiny model with fixed weights, an engine core over it, a trainer recompute."""

from __future__ import annotations

import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import ModelConfig, preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.engine.core import EngineCore
from rlsys.engine.runners import make_runner
from rlsys.engine.sampler import behaviour_log_probs
from rlsys.model import Transformer


def tiny(dtype: str = "float32", seed: int = 0) -> tuple[ModelConfig, Transformer]:
    cfg = preset("tiny").with_overrides({"compute_dtype": dtype})
    torch.manual_seed(seed)
    return cfg, Transformer(cfg).eval()


def make_core(cfg: ModelConfig, model: Transformer, **engine: object) -> EngineCore:
    ecfg = EngineConfig(**{"max_context_tokens": 256, **engine})  # type: ignore[arg-type]
    return EngineCore(cfg, ecfg, make_runner(cfg, ecfg, model.state_dict()))


def run_all(core: EngineCore, requests: list[GenerationRequest]) -> dict[str, GenerationResult]:
    done: dict[str, GenerationResult] = {}
    for req in requests:
        error = core.add(req)
        if error is not None:
            done[req.request_id] = error
    while core.has_work():
        done.update({r.request_id: r for r in core.step()})
    return done


REQUEST_OWN = ("seed", "stop_strings", "stop_token_ids")


def request(rid: str, prompt: list[int], **options: object) -> GenerationRequest:
    """A request with `options`: sampling fields (`max_tokens` is `max_tokens_per_turn`)
    and the request's own (seed, stop strings and ids)."""
    options = {"max_tokens": 10, "seed": 7, **options}
    own = {k: options.pop(k) for k in REQUEST_OWN if k in options}
    options["max_tokens_per_turn"] = options.pop("max_tokens")
    return GenerationRequest(rid, rid, prompt, SamplingConfig(**options), **own)  # type: ignore[arg-type]


def trainer_log_probs(
    model: Transformer, prompt: list[int], res: GenerationResult, temperature: float = 1.0
) -> torch.Tensor:
    """What the trainer recomputes: full forward over prompt + tokens, candidate log-probs."""
    seq = prompt + res.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]]), with_mtp=False).logits[0]
    width = max(len(c) for c in res.candidate_ids)
    cand = torch.full((len(res.token_ids), width), -1, dtype=torch.long)
    for j, ids in enumerate(res.candidate_ids):
        cand[j, : len(ids)] = torch.tensor(ids)
    return behaviour_log_probs(
        logits[len(prompt) - 1 :], torch.tensor(res.token_ids), cand, temperature
    )


def prompts(n: int, seed: int = 1, vocab: int = 64) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3 + 11 * i,), generator=gen).tolist() for i in range(n)]
