"""`rlsys sandbox`: try a sandbox backend by hand, and reap orphaned sandboxes.

Invariant: importing this module imports only click and the standard library; the sandbox
package is imported inside the commands.
"""

from __future__ import annotations

import json
import sys

import click

from rlsys.cli.errors import UserError

BACKEND_NAMES = ("bwrap", "process", "docker")  # kept equal to the registry by a test


@click.group("sandbox")
def sandbox() -> None:
    """Run commands in sandboxes; clean up after crashed owners."""


@sandbox.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--backend", default="bwrap", show_default=True, help="Sandbox backend.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Wall seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(backend: str, timeout_s: float | None, as_json: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND (after --) in a fresh sandbox; print exit code, output and resource use."""
    if backend not in BACKEND_NAMES:
        raise UserError(f"--backend: unknown {backend!r}; allowed: {', '.join(BACKEND_NAMES)}")
    if timeout_s is not None and timeout_s <= 0:
        raise UserError("--timeout: must be > 0 seconds")

    import warnings

    from rlsys.sandboxes.base import SandboxError
    from rlsys.sandboxes.registry import open_sandbox, parse_sandbox_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the process backend's warning is printed below
        try:
            with open_sandbox(parse_sandbox_config({"type": backend})) as box:
                result = box.run(list(command), timeout_s=timeout_s)
        except SandboxError as err:
            raise click.ClickException(str(err)) from err
    if as_json:
        click.echo(json.dumps(result.summary()))
    else:
        _print_human(result)
    sys.exit(result.exit_code if result.exit_code < 256 else 1)


def _print_human(result) -> None:  # type: ignore[no-untyped-def]
    if not result.isolated:
        click.echo("WARNING: backend 'process' has NO isolation (development only)", err=True)
    for name, text, truncated in (
        ("stdout", result.stdout_text, result.stdout_truncated),
        ("stderr", result.stderr_text, result.stderr_truncated),
    ):
        click.echo(f"--- {name}{' (truncated)' if truncated else ''} ---")
        click.echo(text, nl=not text.endswith("\n"))
    cpu = "n/a" if result.cpu_s is None else f"{result.cpu_s:.3f}s"
    rss = "n/a" if result.max_rss_bytes is None else f"{result.max_rss_bytes / 2**20:.1f} MiB"
    click.echo("--- result ---")
    click.echo(
        f"backend={result.backend} exit_code={result.exit_code} "
        f"killed={result.killed_reason or '-'} wall={result.wall_s:.3f}s cpu={cpu} "
        f"max_rss={rss}"
    )


@sandbox.command("reap")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def reap(as_json: bool) -> None:
    """Remove sandboxes (workspaces, processes) whose owner process has died."""
    from dataclasses import asdict

    from rlsys.sandboxes.reaper import reap_orphans

    report = reap_orphans()
    if as_json:
        click.echo(json.dumps(asdict(report)))
    else:
        click.echo(
            f"removed {len(report.removed_workspaces)} workspaces, "
            f"killed {len(report.killed_groups)} process groups"
        )
