"""Registered workflow templates, kept as their source YAML so a restart re-validates them. Writer thread:
every function runs inside the caller's transaction.

Every registration is a version of its workflow (`workflow_versions`: 1, 2, ...); registering the newest
version's text again is the same version (nothing written). The newest version is also the `workflows` row
(what tasks reference). A task is pinned to a version (`tasks.workflow_version`).
"""

from __future__ import annotations

import hashlib

import attrs

from onceflow.store.backends.connection import Connection

MAX_LOADED_VERSIONS = 64
"""At most this many versions of one workflow are loaded at start-up: the newest and those live tasks are
pinned to (beyond it, the oldest pinned ones are left out and logged; their tasks answer not_found until
migrated)."""


@attrs.frozen
class StoredWorkflow:
    """A registered template: its YAML `definition`, the `source` it was read from, its allow-list, and the
    `version` of its workflow it is (0: not stored yet)."""

    workflow_id: str
    source: str
    definition: str
    import_path: bool
    version: int = 0

    @property
    def sha256(self) -> str:
        """The hex SHA-256 of the definition's UTF-8 text."""
        return hashlib.sha256(self.definition.encode("utf-8", "surrogatepass")).hexdigest()


@attrs.frozen
class Saved:
    """What `save_workflow` did: the `version` the text is, and whether it `changed` (a new version)."""

    version: int
    changed: bool


def save_workflow(
    conn: Connection, *, workflow_id: str, name: str, stored: StoredWorkflow, now: float
) -> Saved:
    """Store `stored` as the next version of `workflow_id` (and its newest, in `workflows`), or, when it is
    the newest version's text with the same allow-list, do nothing (the same version)."""
    newest = conn.execute(
        "SELECT version, definition, import_path FROM workflow_versions WHERE workflow_id = ?"
        " ORDER BY version DESC LIMIT 1",
        (workflow_id,),
    ).fetchone()
    if newest is not None and newest[1] == stored.definition and bool(newest[2]) == stored.import_path:
        return Saved(int(newest[0]), changed=False)
    version = 1 if newest is None else int(newest[0]) + 1
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, import_path, registered_at)"
        " VALUES (?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET name = excluded.name, source = excluded.source,"
        " definition = excluded.definition, import_path = excluded.import_path,"
        " registered_at = excluded.registered_at",
        (workflow_id, name, stored.source, stored.definition, int(stored.import_path), now),
    )
    conn.execute(
        "INSERT INTO workflow_versions (workflow_id, version, source, definition, import_path, registered_at)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (workflow_id, version, stored.source, stored.definition, int(stored.import_path), now),
    )
    return Saved(version, changed=True)


def all_workflows(conn: Connection) -> list[StoredWorkflow]:
    """What a start loads, by (id, version): every workflow's newest version and the versions tasks are
    pinned to (at most `MAX_LOADED_VERSIONS` per workflow, the newest ones)."""
    rows = conn.execute(
        "SELECT v.workflow_id, v.source, v.definition, v.import_path, v.version FROM workflow_versions AS v"
        " WHERE v.version = (SELECT MAX(version) FROM workflow_versions WHERE workflow_id = v.workflow_id)"
        " OR EXISTS (SELECT 1 FROM tasks WHERE workflow_id = v.workflow_id AND workflow_version = v.version)"
        " ORDER BY v.workflow_id, v.version DESC"
    ).fetchall()
    loaded: list[StoredWorkflow] = []
    per: dict[str, int] = {}
    for row in rows:
        per[row[0]] = per.get(row[0], 0) + 1
        if per[row[0]] <= MAX_LOADED_VERSIONS:
            loaded.append(StoredWorkflow(row[0], row[1], row[2], bool(row[3]), int(row[4])))
    return sorted(loaded, key=lambda stored: (stored.workflow_id, stored.version))


def get_version(conn: Connection, workflow_id: str, version: int | None) -> StoredWorkflow | None:
    """Version `version` of the workflow (None: its newest), or None when there is no such version."""
    if version is None:
        row = conn.execute(
            "SELECT workflow_id, source, definition, import_path, version FROM workflow_versions"
            " WHERE workflow_id = ? ORDER BY version DESC LIMIT 1",
            (workflow_id,),
        ).fetchone()
    else:
        row = conn.execute(
            "SELECT workflow_id, source, definition, import_path, version FROM workflow_versions"
            " WHERE workflow_id = ? AND version = ?",
            (workflow_id, version),
        ).fetchone()
    return None if row is None else StoredWorkflow(row[0], row[1], row[2], bool(row[3]), int(row[4]))


def live_tasks_by_version(conn: Connection, workflow_id: str | None = None) -> dict[str, dict[str, int]]:
    """workflow id -> {version (as text): how many tasks are pinned to it}, for one workflow or all."""
    where, params = ("WHERE workflow_id = ?", (workflow_id,)) if workflow_id is not None else ("", ())
    rows = conn.execute(
        f"SELECT workflow_id, workflow_version, COUNT(*) FROM tasks {where}"
        " GROUP BY workflow_id, workflow_version ORDER BY workflow_id, workflow_version",
        params,
    ).fetchall()
    counts: dict[str, dict[str, int]] = {}
    for wf, version, count in rows:
        counts.setdefault(wf, {})[str(version)] = int(count)
    return counts


def live_steps(conn: Connection, workflow_id: str) -> dict[str, int]:
    """step id -> how many tasks of the workflow stand at it (on any version)."""
    rows = conn.execute(
        "SELECT workflow_step_id, COUNT(*) FROM tasks WHERE workflow_id = ? GROUP BY workflow_step_id",
        (workflow_id,),
    ).fetchall()
    return {step: int(count) for step, count in rows}


def versions_summary(conn: Connection) -> list[tuple[str, list[int]]]:
    """(workflow id, its versions in order) of every registered workflow, by id."""
    rows = conn.execute("SELECT workflow_id, version FROM workflow_versions ORDER BY workflow_id, version")
    summary: dict[str, list[int]] = {}
    for wf, version in rows.fetchall():
        summary.setdefault(wf, []).append(int(version))
    return list(summary.items())


def live_counts(conn: Connection, workflow_id: str) -> tuple[dict[str, int], dict[str, int]]:
    """(live tasks by version, live tasks by step) of the workflow: what a registration reports."""
    return live_tasks_by_version(conn, workflow_id).get(workflow_id, {}), live_steps(conn, workflow_id)


def summary(conn: Connection) -> tuple[list[tuple[str, list[int]]], dict[str, dict[str, int]]]:
    """`versions_summary` and `live_tasks_by_version` of every workflow, in one transaction."""
    return versions_summary(conn), live_tasks_by_version(conn)
