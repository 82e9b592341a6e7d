"""The zero-center projection in bf16: the logit gradient's common mode and the LM head's
mean-row drift over many supervised steps, with and without the projection.

The model (`tiny` or `small`, compute dtype bf16) learns a reversal task (a prompt of 8
random tokens, then the same tokens reversed as policy tokens) through the trainer's own
path: packed forward, chunked LM head, `policy_log_probs` with `zero_center` on or off.
Per step it records, from the gradient that reaches the raw (bf16) LM-head output, each
row's common mode |mean over the vocab| (max and mean over rows), and the LM head's mean
row (mean of the weight rows over the vocab): the direction that shifts every logit alike,
so the loss has no gradient along it and anything that moves it is numerical. Numerics are
deterministic for a given seed; only the timing varies between runs.

Usage: .venv/bin/python benchmarks/bench_zero_center.py [--preset small] [--steps 150]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlsys.config.model import preset
from rlsys.model import Transformer
from rlsys.trainer.batch import pack
from rlsys.trainer.forward import packed_hidden
from rlsys.trainer.logprobs import LogProbOptions, policy_log_probs
from rlsys.trajectory import Segment, Trajectory

OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr * 100),
}


def reversal_demos(vocab: int, n: int, length: int = 8) -> list[Trajectory]:
    rng = random.Random(0)
    demos = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        seg = Segment()
        seg.append(prompt, turn=-1, policy=False)
        seg.append(prompt[::-1], turn=0, policy=True)
        demos.append(Trajectory(f"d{i}", f"g{i}", "reverse", [seg]))
    return demos


def run(name: str, steps: int, optimizer: str, on: bool, lr: float, batch: int) -> dict:
    torch.manual_seed(0)
    model = Transformer(preset(name).with_overrides({"compute_dtype": "bfloat16"}))
    demos = reversal_demos(model.cfg.vocab_size, 64)
    opts = LogProbOptions(valid_vocab=model.cfg.vocab_size, zero_center=on, chunk=64)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr)
    grads: list[torch.Tensor] = []
    head_logits = model.head_logits

    def spy(h: torch.Tensor) -> torch.Tensor:
        out = head_logits(h)
        if out.requires_grad:
            out.register_hook(lambda g: grads.append(g.detach().float()))
        return out

    model.head_logits = spy  # type: ignore[method-assign]
    w0 = model.lm_head.detach().float().clone()
    cm_max, cm_mean, nll = 0.0, 0.0, 0.0
    started = time.perf_counter()
    for step in range(steps):
        chosen = [demos[(step * batch + j) % len(demos)] for j in range(batch)]
        packed = pack([(i, s, t) for i, t in enumerate(chosen) for s in t.segments])
        h = packed_hidden(model, packed, "off")
        out = policy_log_probs(
            model,
            h[packed.pred_rows_P],
            packed.targets_P,
            packed.candidates_PC,
            packed.has_candidates_P,
            opts,
        )
        loss = -out.logp_P.mean()
        grads.clear()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.update_balance()
        common = torch.cat(grads).mean(-1).abs()
        cm_max = max(cm_max, float(common.max()))
        cm_mean += float(common.mean()) / steps
        nll = float(loss.detach())
    elapsed = time.perf_counter() - started
    w = model.lm_head.detach().float()
    return {
        "preset": name,
        "optimizer": optimizer,
        "projection": "on" if on else "off",
        "cm_max": cm_max,
        "cm_mean": cm_mean,
        "mean_row_0": float(w0.mean(0).norm()),
        "mean_row_T": float(w.mean(0).norm()),
        "mean_row_drift": float((w.mean(0) - w0.mean(0)).norm()),
        "row_change": float((w - w0).norm(dim=1).mean()),
        "nll_last": nll,
        "s_per_step": elapsed / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cols = ["optimizer", "projection", "cm_max", "cm_mean", "mean_row_0", "mean_row_T"]
    cols += ["mean_row_drift", "row_change", "nll_last", "s_per_step"]
    print(f"preset {args.preset}, bf16, {args.steps} steps, batch {args.batch}, lr {args.lr}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for optimizer in args.optimizers.split(","):
        for on in (False, True):
            r = run(args.preset, args.steps, optimizer, on, args.lr, args.batch)
            cells = [r[c] if isinstance(r[c], str) else f"{r[c]:.3g}" for c in cols]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
