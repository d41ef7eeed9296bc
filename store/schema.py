"""The database schema, as ordered migrations keyed by `PRAGMA user_version`.

Migration N (1-based) brings a database from user_version N-1 to N. Append new migrations; never edit one
that has shipped. Every task-scoped table cascades from `tasks` so nothing outlives its task
(on-enter-action-dispatch.md, AC-B9(e)); foreign keys are verified on by the store at connect time.
"""

from __future__ import annotations

import sqlite3

MIGRATIONS: tuple[str, ...] = (
    # 1: the foundation schema.
    """
    CREATE TABLE workflows (
        id            TEXT PRIMARY KEY,
        name          TEXT NOT NULL,
        source        TEXT NOT NULL,
        definition    TEXT NOT NULL,
        registered_at REAL NOT NULL
    );

    CREATE TABLE tasks (
        id                 TEXT PRIMARY KEY,
        workflow_id        TEXT NOT NULL REFERENCES workflows(id),
        workflow_step_id   TEXT NOT NULL,
        title              TEXT NOT NULL DEFAULT '',
        session_id         TEXT,
        primary_agent_id   TEXT,
        ceo_agent_id       TEXT,
        priority           TEXT NOT NULL DEFAULT 'medium',
        position           INTEGER NOT NULL DEFAULT 0,
        wip_admitted       INTEGER NOT NULL DEFAULT 1,
        queued_for_step_id TEXT,
        queued_at          REAL,
        created_at         REAL NOT NULL,
        updated_at         REAL NOT NULL
    );

    -- task_id NULL = a template-level row for every task of workflow_id at step_id.
    CREATE TABLE participants (
        id                INTEGER PRIMARY KEY AUTOINCREMENT,
        workflow_id       TEXT NOT NULL,
        step_id           TEXT NOT NULL,
        task_id           TEXT REFERENCES tasks(id) ON DELETE CASCADE,
        role              TEXT NOT NULL,
        agent_profile_id  TEXT NOT NULL DEFAULT '',
        decision_required INTEGER NOT NULL DEFAULT 1,
        position          INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX participants_by_step ON participants(workflow_id, step_id);
    CREATE INDEX participants_by_task ON participants(task_id);

    CREATE TABLE decisions (
        id             INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id        TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        step_id        TEXT NOT NULL,
        participant_id INTEGER,
        role           TEXT NOT NULL DEFAULT '',
        decider_type   TEXT NOT NULL CHECK (decider_type IN ('agent', 'user')),
        decider_id     TEXT NOT NULL,
        decision       TEXT NOT NULL CHECK (decision IN ('approved', 'rejected', 'changes_requested')),
        comment        TEXT NOT NULL DEFAULT '',
        created_at     REAL NOT NULL
    );
    CREATE INDEX decisions_by_task_step ON decisions(task_id, step_id);

    -- exclude_from_coalescing is the discrete opt-out field (on-enter-action-dispatch.md AC-H9).
    CREATE TABLE runs (
        id                      INTEGER PRIMARY KEY AUTOINCREMENT,
        agent_profile_id        TEXT NOT NULL,
        task_id                 TEXT REFERENCES tasks(id) ON DELETE CASCADE,
        workflow_step_id        TEXT,
        reason                  TEXT NOT NULL,
        payload                 TEXT,
        idempotency_key         TEXT UNIQUE,
        exclude_from_coalescing INTEGER NOT NULL DEFAULT 0,
        status                  TEXT NOT NULL DEFAULT 'queued'
                                CHECK (status IN ('queued', 'claimed', 'finished', 'failed')),
        coalesced_count         INTEGER NOT NULL DEFAULT 0,
        requested_at            REAL NOT NULL,
        claimed_at              REAL,
        finished_at             REAL
    );
    CREATE INDEX runs_queued_by_agent ON runs(agent_profile_id, status, requested_at);

    -- One durable record per step entry (on-enter-action-dispatch.md, Execution model).
    CREATE TABLE step_entries (
        task_id            TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        step_id            TEXT NOT NULL,
        entry_seq          INTEGER NOT NULL,
        workflow_id        TEXT NOT NULL,
        declaration_digest TEXT NOT NULL,
        entry_path         TEXT NOT NULL,
        terminal           INTEGER NOT NULL DEFAULT 0,
        created_at         REAL NOT NULL,
        UNIQUE (task_id, step_id, entry_seq)
    );
    CREATE INDEX step_entries_open ON step_entries(terminal, task_id, step_id, entry_seq);

    -- Absent = no row. state in_progress carries the claiming runtime's epoch.
    CREATE TABLE step_entry_markers (
        task_id    TEXT NOT NULL,
        step_id    TEXT NOT NULL,
        entry_seq  INTEGER NOT NULL,
        position   INTEGER NOT NULL,
        kind       TEXT NOT NULL,
        state      TEXT NOT NULL CHECK (state IN ('in_progress', 'done', 'skipped', 'failed')),
        epoch      TEXT,
        detail     TEXT NOT NULL DEFAULT '',
        updated_at REAL NOT NULL,
        PRIMARY KEY (task_id, step_id, entry_seq, position, kind),
        FOREIGN KEY (task_id, step_id, entry_seq)
            REFERENCES step_entries(task_id, step_id, entry_seq) ON DELETE CASCADE
    );
    """,
    # 2: workflows registered through the import path keep their wider allow-lists on reload.
    """
    ALTER TABLE workflows ADD COLUMN import_path INTEGER NOT NULL DEFAULT 0;
    """,
    # 3: coordinator outcome delivery (coordinator-outcome-delivery.md): one bounded row per outcome, and a
    # small inbox of acknowledgements waiting for the outcome's actor (store/outcomes.py).
    """
    CREATE TABLE outcomes (
        outcome_id             TEXT PRIMARY KEY,
        envelope               TEXT NOT NULL,
        behavior_version       INTEGER NOT NULL,
        phase                  TEXT NOT NULL
                               CHECK (phase IN ('pending', 'needs-coordinator-ack', 'acknowledged')),
        delivery_attempts      INTEGER NOT NULL DEFAULT 0,
        duplicate_signals      INTEGER NOT NULL DEFAULT 0,
        stale_acknowledgements INTEGER NOT NULL DEFAULT 0,
        delivery_ref           TEXT,
        coordinator_fence      TEXT,
        delivered_at           REAL,
        acknowledged_at        REAL,
        last_delivery_error    TEXT
    );

    CREATE TABLE outcome_acks (
        seq               INTEGER PRIMARY KEY AUTOINCREMENT,
        outcome_id        TEXT NOT NULL REFERENCES outcomes(outcome_id) ON DELETE CASCADE,
        store_ref         TEXT NOT NULL,
        work_id           TEXT NOT NULL,
        coordinator_fence TEXT NOT NULL,
        copies            INTEGER NOT NULL DEFAULT 1,
        UNIQUE (outcome_id, store_ref, work_id, coordinator_fence)
    );
    """,
    # 4: code-review passes started by on_enter run_code_review (on-enter-action-dispatch.md AC-A8).
    """
    CREATE TABLE task_review_runs (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id          TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        workflow_step_id TEXT NOT NULL,
        trigger          TEXT NOT NULL,
        status           TEXT NOT NULL CHECK (status IN ('started', 'start_failed')),
        detail           TEXT NOT NULL DEFAULT '',
        created_at       REAL NOT NULL
    );
    CREATE INDEX task_review_runs_by_task ON task_review_runs(task_id);
    """,
    # 5: a durable receipt per host decision id, kept when clear_decisions deletes the decision itself, so a
    # decision redelivered after a restart (the ledger starts empty) is never counted in a later round.
    """
    CREATE TABLE decision_receipts (
        task_id     TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        step_id     TEXT NOT NULL,
        external_id TEXT NOT NULL,
        decision_id INTEGER NOT NULL,
        PRIMARY KEY (task_id, step_id, external_id)
    );
    """,
    # 6: WIP occupancy and promotion candidates are looked up by step on every move; without this index each
    # lookup scanned every task (issue 7: throughput fell as the task count grew).
    """
    CREATE INDEX tasks_by_step ON tasks(workflow_id, workflow_step_id, wip_admitted);
    """,
    # 7: the recovery scan's index covers open entries only: flagging an entry terminal then removes one small
    # index row instead of moving it within an index over every entry ever made.
    """
    DROP INDEX step_entries_open;
    CREATE INDEX step_entries_open ON step_entries(task_id, step_id, entry_seq) WHERE terminal = 0;
    """,
    # 8: the idempotency key of an enqueue merged into another run by coalescing (issue 12 item 3), with
    # that run: a redelivery of the merged operation is then a no-op like any other. The key of an inserted
    # run stays in runs.idempotency_key; a key lives in one of the two places.
    """
    CREATE TABLE coalesced_keys (
        idempotency_key TEXT PRIMARY KEY,
        run_id          INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        seen_at         REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX coalesced_keys_by_run ON coalesced_keys(run_id);
    """,
    # 9: what a receipted decision said, so a reused decision id with another verdict is a conflict, not a
    # silent replay (issue 12 item 6). '' = written before this column: such a receipt is a replay.
    """
    ALTER TABLE decision_receipts ADD COLUMN content TEXT NOT NULL DEFAULT '';
    """,
    # 10: a review run carries its entry identity, so a launch repeated after a crash reuses its row (the
    # stable review-run id a host deduplicates on) and a new entry gets a new one (issue 12 item 7).
    """
    ALTER TABLE task_review_runs ADD COLUMN entry_seq INTEGER;
    ALTER TABLE task_review_runs ADD COLUMN position INTEGER;
    ALTER TABLE task_review_runs ADD COLUMN agent_profile_id TEXT;
    ALTER TABLE task_review_runs ADD COLUMN launches INTEGER NOT NULL DEFAULT 1;
    CREATE UNIQUE INDEX task_review_runs_by_entry
        ON task_review_runs(task_id, workflow_step_id, entry_seq, position);
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> int:
    """Apply every migration newer than the database's `user_version`; return the resulting version.

    Each migration and its version bump commit in one transaction, so a crash mid-upgrade leaves the
    database at the previous version. `conn` must be in autocommit mode (isolation_level=None).

    Raises:
        RuntimeError: the database is newer than this code (user_version > SCHEMA_VERSION).
    """
    current = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if current > SCHEMA_VERSION:
        raise RuntimeError(
            f"database schema version {current} is newer than this onceflow's {SCHEMA_VERSION}"
        )
    for version in range(current + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(MIGRATIONS[version - 1]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return SCHEMA_VERSION


def _statements(script: str) -> list[str]:
    # executescript() would COMMIT implicitly; split so the migration stays inside our transaction.
    out: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out
