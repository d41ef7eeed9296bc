"""Registered workflow templates, kept as their source YAML so a restart re-validates them."""

from __future__ import annotations

import sqlite3


def save_workflow(
    conn: sqlite3.Connection, *, workflow_id: str, name: str, source: str, definition: str, now: float
) -> None:
    """Insert or replace a workflow's template text (`definition` is the YAML as registered)."""
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET name = excluded.name, source = excluded.source,"
        " definition = excluded.definition, registered_at = excluded.registered_at",
        (workflow_id, name, source, definition, now),
    )


def all_workflows(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """Every stored workflow as (id, source, definition YAML), by id."""
    rows = conn.execute("SELECT id, source, definition FROM workflows ORDER BY id").fetchall()
    return [(row[0], row[1], row[2]) for row in rows]
