"""Printing reports: one JSON object for machines, rich tables for people.

rich is imported inside the functions: the CLI's start path stays light.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def print_json(obj: Any) -> None:
    """One JSON object on stdout (non-JSON values such as floats of time are stringified)."""
    print(json.dumps(obj, default=str, sort_keys=False))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A titled table; floats are shown with 4 significant digits."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    Console().print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)
