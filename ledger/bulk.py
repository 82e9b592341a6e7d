"""Bulk writes that stay fast on both backends.

SQLite's `executemany` is a C loop over one prepared statement: already fast. Through
psycopg it becomes one statement per row, and SQLAlchemy's multi-row VALUES costs a fresh
compile per batch; on PostgreSQL we therefore send each column as one typed array and let
the server `unnest` them: one short statement per batch, whatever its size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Connection,
    Float,
    Integer,
    Table,
    bindparam,
    insert,
    update,
)
from sqlalchemy import func as sa_func

# An assignment: a row key, or (row key, combine) where combine(current_sql, new_sql) -> sql.
Assign = str | tuple[str, str]
COALESCE = "coalesce"


def _pg_array_type(col_type: Any) -> str:
    if isinstance(col_type, Boolean):
        return "bool"
    if isinstance(col_type, Integer):
        return "int8"
    if isinstance(col_type, Float):
        return "float8"
    return "text"  # strings, and JSON passed as its text


def _pg_arrays(table: Table, key_to_col: dict[str, str], rows: Sequence[dict[str, Any]]):  # type: ignore[no-untyped-def]
    params, selects = {}, []
    for i, (key, col) in enumerate(key_to_col.items()):
        is_json = isinstance(table.c[col].type, JSON)
        params[f"a{i}"] = [
            (json.dumps(r[key]) if r[key] is not None else None) if is_json else r[key]
            for r in rows
        ]
        cast = f"CAST(%(a{i})s AS {_pg_array_type(table.c[col].type)}[])"
        selects.append((key, cast, "::json" if is_json else ""))
    return params, selects


def bulk_insert(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert `rows` (all with the same keys, named as the table's columns) into `table`."""
    if not rows:
        return
    if conn.dialect.name != "postgresql":
        conn.execute(insert(table), list(rows))
        return
    keys = list(rows[0])
    params, selects = _pg_arrays(table, {k: k for k in keys}, rows)
    names = ", ".join(f"u_{k}" for k in keys)
    sql = (
        f"INSERT INTO {table.name} ({', '.join(keys)}) "
        f"SELECT {', '.join(f'u_{k}{suffix}' for k, _, suffix in selects)} "
        f"FROM unnest({', '.join(c for _, c, _ in selects)}) AS u({names})"
    )
    _pg_execute(conn, sql, params)


def bulk_update(
    conn: Connection,
    table: Table,
    rows: Sequence[dict[str, Any]],
    *,
    match: dict[str, str],
    assign: dict[str, Assign],
) -> int:
    """Update `table` from `rows`; returns how many rows matched (-1 if unknown).

    `match` maps a table column to the row key it must equal; `assign` maps a table column
    to a row key, or to `(key, "coalesce")` to keep the column's value where the key is None.
    """
    if not rows:
        return 0
    if conn.dialect.name != "postgresql":
        stmt = update(table).where(*(table.c[c] == bindparam(k) for c, k in match.items()))
        values: dict[str, Any] = {}
        for col, spec in assign.items():
            key, how = (spec, None) if isinstance(spec, str) else spec
            values[col] = sa_func.coalesce(bindparam(key), table.c[col]) if how else bindparam(key)
        return conn.execute(stmt.values(values), [dict(r) for r in rows]).rowcount
    key_to_col = {k: c for c, k in match.items()}
    for col, spec in assign.items():
        key_to_col[spec if isinstance(spec, str) else spec[0]] = col
    params, selects = _pg_arrays(table, key_to_col, rows)
    sets = []
    for col, spec in assign.items():
        key, how = (spec, None) if isinstance(spec, str) else spec
        sets.append(f"{col} = COALESCE(u.{key}, t.{col})" if how else f"{col} = u.{key}")
    where = " AND ".join(f"t.{c} = u.{k}" for c, k in match.items())
    sql = (
        f"UPDATE {table.name} AS t SET {', '.join(sets)} "
        f"FROM unnest({', '.join(c for _, c, _ in selects)}) AS u({', '.join(key_to_col)}) "
        f"WHERE {where}"
    )
    return _pg_execute(conn, sql, params)


def coalesce_new(key: str) -> tuple[str, str]:
    """Assignment spec: the row's value when not None, else keep the column's value."""
    return key, COALESCE


def _pg_execute(conn: Connection, sql: str, params: dict[str, Any]) -> int:
    """Run on the driver connection inside SQLAlchemy's transaction, with binary parameters:
    text-mode array dumping (quoting every element) cost as much as the server's work."""
    driver = conn.connection.driver_connection
    with driver.cursor(binary=True) as cur:  # type: ignore[union-attr]
        cur.execute(sql, params)
        return cur.rowcount
