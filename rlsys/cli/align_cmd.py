"""`rlsys align CONFIG [--tp 1,2,4,8] [--backend threads|gloo|nccl] [--json]`: engine-vs-
trainer log-prob check (on GPUs with `--backend nccl`).

Generates with the native engine under each TP degree (mixed batches, prefix-cache hits),
recomputes with the job's trainer on its RL path (micro-batch packing, chunked LM head,
expert-route and candidate-set replay: `rlsys.trainer.recompute`) and prints, per degree,
`max_abs_logprob_diff` and `num_tokens`. Exits 1 when any difference is not exactly 0.0.
Invariant: importing this module imports click and the standard library only.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from rlsys.cli.errors import UserError

if TYPE_CHECKING:
    from rlsys.config.job import JobConfig
    from rlsys.engine.align import Pairs, Recompute
    from rlsys.model import Transformer


def _degrees(text: str) -> list[int]:
    try:
        degrees = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--tp expects comma-separated integers, got {text!r}") from None
    bad = [d for d in degrees if d not in (1, 2, 4, 8)]
    if not degrees or bad:
        raise UserError(f"--tp degrees must be among 1,2,4,8, got {text!r}")
    return degrees


def _trainer_path(job: JobConfig) -> Recompute:
    """The recompute of `rlsys.engine.align` done by the job's trainer (its replay modes,
    micro-batching and LM-head chunking), not by a bare `Transformer.forward`."""
    from rlsys.trainer.recompute import trainer_logprob_diff
    from rlsys.trainer.trainer import Trainer

    def recompute(model: Transformer, pairs: Pairs, temperature: float) -> tuple[float, int]:
        trainer = Trainer(model, job.trainer, job.algo, temperature=temperature)
        return trainer_logprob_diff(trainer, pairs)

    return recompute


@click.command("align")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--tp", "tp_text", default="1,2,4,8", show_default=True, help="TP degrees.")
@click.option(
    "--backend",
    type=click.Choice(["threads", "gloo", "nccl"]),
    default="threads",
    show_default=True,
    help="TP ranks as shard threads in this process, as gloo processes (CPU), or as NCCL "
    "processes, one GPU each (the engine and the trainer then run on CUDA).",
)
@click.option("--max-tokens", default=8, show_default=True, help="Generated tokens per turn.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def align(config: str, tp_text: str, backend: str, max_tokens: int, as_json: bool) -> None:
    """Check that the trainer reproduces the engine's log-probs bitwise at every TP degree."""
    degrees = _degrees(tp_text)
    from rlsys.cli.job_config import load_job_config

    job = load_job_config(config, places_replicas=False)
    if job.engine.backend != "native":
        raise UserError(
            f"{config}: engine.backend {job.engine.backend!r}: `rlsys align` checks the native "
            "engine's bitwise alignment; this backend's mismatch is measured in the job "
            "(`mismatch` in `rlsys monitor`) and by benchmarks/bench_vllm_backend.py"
        )
    from pydantic import ValidationError

    from rlsys.cli.job_config import config_user_error
    from rlsys.engine.align import alignment_report
    from rlsys.engine.tp_shard import tp_error

    model_cfg = job.model.resolve()
    for degree in degrees:
        if (error := tp_error(model_cfg, degree)) is not None:
            raise UserError(f"{config}: model cannot be split: {error}")
    device = "cuda" if backend == "nccl" else "cpu"
    try:
        engine_cfg = job.engine.copy_with(device=device, tp_backend=backend)
    except ValidationError as err:  # e.g. a CPU-only engine option with --backend nccl
        raise config_user_error(err, "engine") from err
    turn = min(max_tokens, job.sampling.max_tokens_per_turn)
    sampling = job.sampling.model_copy(update={"max_tokens_per_turn": turn})
    rows = alignment_report(
        model_cfg,
        engine_cfg,
        sampling,
        degrees,
        seed=job.seed,
        device=device,
        recompute=_trainer_path(job),
    )
    report = {
        "model": job.model.preset,
        "compute_dtype": model_cfg.compute_dtype,
        "backend": backend,
        "tp": {
            str(r.tp): {
                "max_abs_logprob_diff": r.max_abs_logprob_diff,
                "num_tokens": r.num_tokens,
                "prefix_cache_hit_tokens": r.prefix_cache_hit_tokens,
                "max_batch_rows": r.max_batch_rows,
            }
            for r in rows
        },
    }
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"model {report['model']} ({report['compute_dtype']}), TP backend {backend}")
        click.echo("tp  max_abs_logprob_diff  num_tokens  prefix_hit_tokens")
        for r in rows:
            click.echo(
                f"{r.tp:<3} {r.max_abs_logprob_diff:<21} {r.num_tokens:<11} "
                f"{r.prefix_cache_hit_tokens}"
            )
    if any(r.max_abs_logprob_diff != 0.0 for r in rows):
        click.echo("error: engine and trainer log-probs differ", err=True)
        sys.exit(1)
