"""Registered workflow templates, kept as their source YAML so a restart re-validates them. Writer thread:
every function runs inside the caller's transaction."""

from __future__ import annotations

import attrs

from onceflow.store.connection import Connection


@attrs.frozen
class StoredWorkflow:
    """A registered template: its YAML `definition`, the `source` it was read from, and its allow-list."""

    workflow_id: str
    source: str
    definition: str
    import_path: bool


def save_workflow(
    conn: Connection, *, workflow_id: str, name: str, stored: StoredWorkflow, now: float
) -> None:
    """Insert or replace a workflow's template text."""
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, import_path, registered_at)"
        " VALUES (?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET name = excluded.name, source = excluded.source,"
        " definition = excluded.definition, import_path = excluded.import_path,"
        " registered_at = excluded.registered_at",
        (workflow_id, name, stored.source, stored.definition, int(stored.import_path), now),
    )


def all_workflows(conn: Connection) -> list[StoredWorkflow]:
    """Every stored workflow, by id."""
    rows = conn.execute("SELECT id, source, definition, import_path FROM workflows ORDER BY id").fetchall()
    return [StoredWorkflow(row[0], row[1], row[2], bool(row[3])) for row in rows]
