"""`rlsys run CONFIG`.

`run` validates everything first (exit 2, nothing started, on any config error), then
starts or joins Ray and runs the job to completion with a progress line per trainer step
and a summary at the end. (`rlsys submit` hands the same command to a Ray cluster.)
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import click

from rlsys.cli.errors import UserError

SET_HELP = "Override a config value: key.path=value (YAML scalar). Repeatable."


def _progress_line(m: dict[str, Any]) -> str:
    st, dr = m.get("staleness", {}), m.get("logprob_drift", {})
    return (
        f"step {m['step']:>4}  v{m['policy_version']:<4} reward {m.get('reward_mean', 0):.3f}  "
        f"{_pass_rate(m.get('task_pass_rate'), m.get('fresh_pass_rate'))}"
        f"{_mix(m.get('prompt_mix'))}{_generation(m)}"
        f"staleness {st.get('mean', 0):.2f}/{st.get('max', 0)}  "
        f"drift {dr.get('mean_abs', 0):.2e}/{dr.get('max_abs', 0):.2e}  "
        f"{_mismatch(m.get('mismatch'))}"
        f"drop {m.get('drop_rate', 0):.3f}  samples {m.get('num_samples', 0)}  "
        f"{m.get('samples_per_s', 0):.1f} samples/s"
    )


def _pass_rate(rate: float | None, fresh: float | None) -> str:
    """The task set's pass rate, and that of prompts at their first draw."""
    out = "" if rate is None else f"pass {rate:.2f}  "
    return out + ("" if fresh is None else f"fresh {fresh:.2f}  ")


def _mix(mix: dict[str, int] | None) -> str:
    """The task set's prompts: retired (solved), drawn rarely (hopeless so far), untried."""
    if not mix:
        return ""
    return f"prompts {mix['retired']} solved/{mix['rare']} rare/{mix['untried']} untried  "


def _generation(m: dict[str, Any]) -> str:
    """What the step's batch cost: groups and rollouts generated, and what was set aside."""
    if "generated_groups" not in m:
        return ""
    return (
        f"gen {m['generated_groups']}g/{m['generated_rollouts']}r "
        f"(zero-var {m.get('filtered_zero_variance', 0)}, stale {m.get('filtered_stale', 0)}, "
        f"failed {m.get('failed_rollouts', 0)})  "
    )


def _mismatch(mm: dict[str, Any] | None) -> str:
    """The train/inference mismatch (max |d|), where the step measured any."""
    return "" if not mm else f"mismatch {mm['max_abs']:.1e} ({mm['tokens']} tok)  "


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, help=SET_HELP)
@click.option("--resume", "resume", default=None, help="Continue job JOB from its last checkpoint.")
@click.option("--job-id", default=None, help="Use this id for a new job (set by `rlsys submit`).")
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as one JSON object.")
def run(
    config: str, sets: tuple[str, ...], resume: str | None, job_id: str | None, as_json: bool
) -> None:
    """Run a job to completion (local Ray, or the cluster in RAY_ADDRESS)."""
    from rlsys.cli.job_config import load_job_config

    cfg = load_job_config(config, sets)
    _prepare_model(cfg.model)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # `ray job stop` sends SIGTERM
    from rlsys.actors.job import run_job
    from rlsys.ledger.errors import LedgerUserError
    from rlsys.ledger.stream import StreamError

    try:
        summary = run_job(
            cfg,
            resume=resume,
            job_id=job_id,
            # with --json, stdout carries the summary object alone (progress goes to stderr)
            on_step=lambda m: click.echo(_progress_line(m), err=as_json),
            on_event=lambda s: click.echo(s, err=True),
        )
    except LedgerUserError as err:
        raise UserError(str(err)) from err
    except StreamError as err:  # the job row says so too: failed, with this reason
        click.echo(f"job failed: {err}", err=True)
        sys.exit(1)
    _print_summary(summary, as_json)
    click.echo(
        f"job {summary['job_id']} {summary['status']}: {summary.get('end_reason')}", err=True
    )
    if summary["status"] != "completed":
        sys.exit(130 if summary["status"] == "stopped" else 1)


def _prepare_model(model: Any) -> None:
    """A Hugging Face model directory must exist before any actor loads it: made here when
    the config asks for a tiny one (`model.make_tiny`), else a missing one is a user error
    that says what to run."""
    if model.kind != "hf" or Path(model.path).exists():
        return
    if model.make_tiny is None:
        raise UserError(
            f"model.path: {model.path} does not exist (a local Hugging Face model directory: "
            "config.json + safetensors); for a tiny random test model, run "
            f"`python -m rlsys.model.hf_tiny {model.path}` or set model.make_tiny: qwen3"
        )
    from rlsys.model.hf_tiny import ensure_tiny

    click.echo(f"model.path {model.path}: making a tiny {model.make_tiny} model", err=True)
    try:
        ensure_tiny(model.path, model.make_tiny)
    except ModuleNotFoundError as err:
        raise UserError(f"model.make_tiny needs {err.name} (the rlsys[vllm] extra)") from err


def _sigterm_as_interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    from rlsys.cli.render import print_json, print_table

    if as_json:
        print_json({k: v for k, v in summary.items() if k != "steps"})
        return
    steps = summary.get("steps", [])
    rewards = [s.get("reward_mean", 0.0) for s in steps]
    k = max(1, len(rewards) // 5)
    generated = sum(s.get("generated_rollouts", 0) for s in steps)
    trained = summary["terminal"].get("trained", 0)
    rows = [
        ("job_id", summary["job_id"]),
        ("status", summary["status"]),
        ("why it ended", summary.get("end_reason")),
        ("task pass rate", summary.get("task_pass_rate")),
        ("rollouts generated per trained sample", generated / trained if trained else None),
        ("trainer steps", len(steps)),
        ("wall time (s)", summary.get("wall_s")),
        ("reward, first 20% of steps", sum(rewards[:k]) / k if rewards else None),
        ("reward, last 20% of steps", sum(rewards[-k:]) / k if rewards else None),
        ("expected rollouts", summary["expected"]),
        (
            "consumed / discarded / dropped",
            f"{summary['consumed']} / {summary['discarded']} / {summary['dropped']}",
        ),
        ("lost", summary["lost"]),
        ("drop rate", summary["drop_rate"]),
        ("worker deaths", summary.get("worker_deaths", 0)),
        ("engine replicas dropped", ", ".join(summary.get("replicas_dropped", [])) or "none"),
    ]
    print_table("run summary", ["", "value"], rows)
