"""Bytes per token of all replay metadata: routed experts, candidate sets, Sparse GQA selections.

From the shapes of a preset and the encodings the engine actually sends (`RoutedExperts.
to_compact`, `RouteLog`, candidate ids as Python lists of ints in `GenerationResult`):
- routes: per MoE layer, k expert ids (uint8 when n_experts <= 256, else int16) and k gates
  (fp32 as sent: the bitwise `indices_and_gates` replay needs them; bf16 would halve them,
  and `indices` replay needs none);
- candidate sets: `--candidates` ids per policy token (the recorded top-p set, at most
  `candidate_cap`), pickled as a list of ints (2 bytes an id below 256, 3 below 65,536,
  5 above) — or as an int16/int32 tensor;
- selections: a row at position p selects min(k / B, p // B) blocks in each of the S Sparse
  GQA layers and Hkv KV groups, sent as int16 ids (int32 past 32,767 blocks) in records as
  wide as their widest row (k / B once any row has a choice). A row with no choice
  (p // B <= k / B: it selects every complete past block) could send nothing; a bitmap
  over the p // B past blocks costs p / (8B) bytes, below the ids when p < 16 k.
Averages are over the rows of one sequence of `--tokens` tokens (every row carries routes
and selections; only policy tokens carry candidates).

Then checks the formula against the real engine: the `small` model generates after a
prompt long enough for its selections to have a choice, and the payload's tensors are
measured.

Run:  OMP_NUM_THREADS=1 python -m benchmarks.replay_bytes
"""

from __future__ import annotations

import argparse
import math

import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import ModelConfig, preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from rlsys.engine.engine import InferenceEngine


def route_bytes(cfg: ModelConfig, gate_bytes: int = 4) -> float:
    id_bytes = 1 if cfg.expert_index_dtype() == "uint8" else 2
    return cfg.n_layers * cfg.experts_per_token * (id_bytes + gate_bytes)


def candidate_bytes(cfg: ModelConfig, count: int, pickled: bool) -> float:
    if pickled:
        per_id = 2 if cfg.vocab_size <= 256 else 3 if cfg.vocab_size <= 65536 else 5
        return count * per_id + 4  # list opcodes
    return count * (2 if cfg.vocab_size <= 32768 else 4)


def selection_bytes(cfg: ModelConfig, tokens: int, encoding: str) -> float:
    """Mean bytes per row of one `tokens`-long sequence's selections."""
    n_sparse = cfg.layer_kinds().count("sparse")
    kb, b = cfg.sparse_selected_blocks, cfg.sparse_block
    id_bytes = 2 if tokens // b <= 32767 else 4
    total = 0.0
    for p in range(tokens):
        past = p // b
        if encoding == "ids, k/B per row (as sent)":
            total += kb * id_bytes
        elif encoding == "ids, no-choice rows implicit":
            total += kb * id_bytes if past > kb else 0
        else:  # bitmap over past blocks, no-choice rows implicit
            total += math.ceil(past / 8) if past > kb else 0
    return n_sparse * cfg.n_kv_groups * total / tokens


SELECTION_ENCODINGS = (
    "ids, k/B per row (as sent)",
    "ids, no-choice rows implicit",
    "bitmap, no-choice rows implicit",
)


def table(name: str, tokens: int, candidates: int) -> list[str]:
    cfg = preset(name)
    per_sample = {}
    lines = [f"\n{name}: {tokens} tokens per sequence, {candidates} candidate ids per policy token"]
    lines.append("| metadata | encoding | bytes/token | MB per sequence |")
    lines.append("|---|---|---|---|")
    rows = [
        ("routes", "ids + fp32 gates (as sent)", route_bytes(cfg, 4)),
        ("routes", "ids + bf16 gates", route_bytes(cfg, 2)),
        ("routes", "ids only (`indices` replay)", route_bytes(cfg, 0)),
        ("candidate sets", "pickled list (as sent)", candidate_bytes(cfg, candidates, True)),
        ("candidate sets", "int16/int32 tensor", candidate_bytes(cfg, candidates, False)),
    ]
    for enc in SELECTION_ENCODINGS:
        rows.append(("selections", enc, selection_bytes(cfg, tokens, enc)))
    for what, enc, b in rows:
        per_sample[(what, enc)] = b
        lines.append(f"| {what} | {enc} | {b:,.0f} | {b * tokens / 1e6:,.1f} |")
    return lines


def measured_small(prompt_len: int, new_tokens: int) -> str:
    """Bytes of the real engine's payload for `small` (random weights), vs the formula."""
    cfg = preset("small")
    torch.manual_seed(0)
    engine_cfg = EngineConfig(max_context_tokens=4096, record_selections=True)
    prompt = torch.randint(0, 256, (prompt_len,)).tolist()
    with InferenceEngine(cfg, engine_cfg) as engine:
        sampling = SamplingConfig(max_tokens_per_turn=new_tokens, top_p=0.9)
        req = GenerationRequest("m", "m", prompt, sampling)
        r = engine.generate(req)
    ctx = r.prompt_routed_experts
    rows = int(ctx["indices"].shape[1]) + len(r.routed_experts)
    routes = sum(ctx[k].nbytes for k in ("indices", "gates"))
    routes += sum(e[k].nbytes for e in r.routed_experts for k in ("indices", "gates"))
    blocks = ctx["blocks"].nbytes + sum(e["blocks"].nbytes for e in r.routed_experts)
    expected = selection_bytes(cfg, rows, SELECTION_ENCODINGS[0])
    sizes = [len(c) for c in r.candidate_ids]
    return (
        f"\nmeasured, small, real engine, {rows} rows: routes {routes / rows:.0f} B/row "
        f"(formula {route_bytes(cfg):.0f}); selections {blocks / rows:.0f} B/row "
        f"(formula {expected:.0f}: every record is as wide as its widest row, "
        f"{int(ctx['blocks'].shape[-1])} ids here); candidate sets of "
        f"{sum(sizes) / len(sizes):.1f} ids on average"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, tokens in (("small", 1024), ("deep-92", 32768)):
        print("\n".join(table(name, tokens, args.candidates)))
    print(measured_small(prompt_len=400, new_tokens=8))


if __name__ == "__main__":
    main()
