"""Forward and forward+backward wall time of a model preset on CPU at several lengths.

Usage: python benchmarks/model_timing.py [--preset small] [--lengths 1024,16384]
Prints markdown tables; a second table times incremental decode (the engine's path). The forward runs without autograd (inference); forward+backward
uses the LM loss plus aux losses (sparse attention chunks are recomputed in the backward).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from rlsys.config.model import preset
from rlsys.model import AuxLosses, Transformer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--lengths", default="1024,16384")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = preset(args.preset)
    model = Transformer(cfg)
    print(f"preset {args.preset}: {model.num_parameters():,} params, threads {args.threads}")
    print("| tokens | forward s | fwd+bwd s | tokens/s (fwd) | peak RSS GB |")
    print("|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, cfg.vocab_size, (1, length))
        with torch.no_grad():
            start = time.perf_counter()
            model(tokens, with_mtp=False)
            fwd = time.perf_counter() - start
        start = time.perf_counter()
        aux = AuxLosses()
        out = model(tokens, aux=aux, with_mtp=False)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], tokens[0, 1:]) + aux.total()
        loss.backward()
        both = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(
            f"| {length} | {fwd:.2f} | {both:.2f} | {length / fwd:,.0f} | {rss:.2f} |", flush=True
        )
    decode_table(model, cfg.vocab_size, args.decode_context, args.decode_steps)


def decode_table(model: Transformer, vocab: int, context: int, steps: int) -> None:
    """Incremental decode after a prefill of `context` tokens, 1 and 16 sequences per step."""
    print(f"\n| sequences | prefill {context} tok s | decode ms/step | decode tokens/s |")
    print("|---:|---:|---:|---:|")
    model.eval()
    for n_seq in (1, 16):
        prompts = [torch.randint(0, vocab, (context,)) for _ in range(n_seq)]
        caches = [model.new_cache() for _ in range(n_seq)]
        with torch.no_grad():
            start = time.perf_counter()
            model.forward_step(prompts, caches)
            prefill = time.perf_counter() - start
            nxt = [p[-1:] for p in prompts]
            start = time.perf_counter()
            for _ in range(steps):
                logits = model.forward_step(nxt, caches)
                nxt = [lg[-1:].argmax(-1) for lg in logits]
            per_step = (time.perf_counter() - start) / steps
        print(
            f"| {n_seq} | {prefill:.2f} | {1000 * per_step:.1f} | {n_seq / per_step:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
