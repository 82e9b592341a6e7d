"""`rlsys monitor`: per-step staleness, log-prob drift, train/inference mismatch (where
measured), KL, entropy, reward, samples, drop rate, throughput, and the serving side at that
step (admission queue depth, prefix-cache hit rate): the series of `rlsys.tracking.series`,
the same that a job's trackers record.

Read from the ledger (the trainer records every committed step there), so it works for any
job in any ledger, live or finished. `--follow` polls for new steps; `--tensorboard DIR`
writes TensorBoard event files; `--plot FILE.png` draws the same series.
"""

from __future__ import annotations

import time
from typing import Any

import click

from rlsys.cli.ledger_cmd import DB_HELP, _reader
from rlsys.tracking.series import SERIES, lookup, series_name


@click.command()
@click.option("--db", default=None, help=DB_HELP)
@click.option("--job", "job_id", default=None, help="Job id (default: the latest job).")
@click.option("--follow", is_flag=True, help="Keep printing new steps until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per trainer step.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG with the series.")
@click.option("--tensorboard", "tb_dir", default=None, help="Write TensorBoard event files here.")
@click.option("--interval", default=2.0, show_default=True, help="Polling interval with --follow.")
def monitor(
    db: str | None,
    job_id: str | None,
    follow: bool,
    as_json: bool,
    plot_path: str | None,
    tb_dir: str | None,
    interval: float,
) -> None:
    """Watch a job's training signals, read from the ledger."""
    from rlsys.cli.render import print_json
    from rlsys.ledger.queries import trainer_steps

    last, seen = 0, []
    with _reader(db) as ledger:
        while True:
            out = trainer_steps(ledger, job_id, after_step=last)
            job_id = job_id or out["job_id"]
            for m in out["steps"]:
                print_json(m) if as_json else click.echo(_line(m))
                last = m["step"]
            seen += out["steps"]
            if not follow or out.get("job_status") not in ("running", "stopping"):
                break
            time.sleep(interval)
    if tb_dir:
        _tensorboard(tb_dir, seen)
    if plot_path:
        _plot(plot_path, seen, job_id)


def _line(m: dict[str, Any]) -> str:
    parts = [f"step {m['step']:>4} v{m['policy_version']}"]
    for key, label in SERIES:
        value = lookup(m, key)
        if value is not None:
            parts.append(
                f"{label.split(' (')[0] if '(' not in label else label}={value:.4g}"
                if isinstance(value, float)
                else f"{label}={value}"
            )
    return "  ".join(parts)


def _tensorboard(directory: str, steps: list[dict[str, Any]]) -> None:
    from tensorboardX import SummaryWriter

    with SummaryWriter(directory) as writer:
        for m in steps:
            for key, _label in SERIES:
                value = lookup(m, key)
                if isinstance(value, (int, float)):
                    writer.add_scalar(series_name(key), value, m["step"])
    click.echo(f"tensorboard events: {directory}", err=True)


def _plot(path: str, steps: list[dict[str, Any]], job_id: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(SERIES) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3 * rows))
    xs = [m["step"] for m in steps]
    for ax in axes.flat[len(SERIES) :]:
        ax.set_visible(False)
    for ax, (key, label) in zip(axes.flat, SERIES, strict=False):
        # a series an older job did not record is a gap, not an error
        ys = [v if isinstance(v := lookup(m, key), (int, float)) else float("nan") for m in steps]
        ax.plot(xs, ys, marker=".")
        ax.set_title(label)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"rlsys monitor: job {job_id}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    click.echo(f"plot: {path}", err=True)
