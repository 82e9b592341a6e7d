"""The `rlsys` command line.

Invariant: importing this module imports only click and the standard library, so
`rlsys --help` answers fast; every command imports its heavy modules inside its body.
Each command group lives in its own module and is listed in `COMMAND_MODULES`.
"""

from __future__ import annotations

import importlib
import sys

import click

from rlsys.cli.errors import UserError

# name -> (module, attribute): the registry of top-level commands.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "ledger": ("rlsys.cli.ledger_cmd", "ledger"),
    "sandbox": ("rlsys.cli.sandbox_cmd", "sandbox"),
    "model": ("rlsys.cli.model_cmd", "model"),
    "align": ("rlsys.cli.align_cmd", "align"),
    "run": ("rlsys.cli.run_cmd", "run"),
    "submit": ("rlsys.cli.submit_cmd", "submit"),
    "jobs": ("rlsys.cli.jobs_cmd", "jobs"),
    "monitor": ("rlsys.cli.monitor_cmd", "monitor"),
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlsys")
def cli() -> None:
    """rlsys: asynchronous agentic RL on Ray, with a ledger for every rollout."""


for _name, (_module, _attr) in COMMAND_MODULES.items():
    cli.add_command(getattr(importlib.import_module(_module), _attr), _name)


def main() -> None:
    """Entry point: user errors print one line to stderr and exit 2."""
    try:
        cli.main(standalone_mode=False)
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(2 if isinstance(err, click.UsageError) else err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
