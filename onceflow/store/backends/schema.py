"""The database schema, as ordered migrations keyed by `PRAGMA user_version`. Writer thread (and the read-only
views' own connection).

Migration N (1-based) brings a database from user_version N-1 to N: an SQL script, or a function for a
change SQL cannot express. Append new migrations; never edit one that has shipped. Every task-scoped
table cascades from `tasks` so nothing outlives its task (on-enter-action-dispatch.md, AC-B9(e)); foreign
keys are verified on by the store at connect time.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import attrs

from onceflow.protocol.outcome import derive_outcome_id


def _gascity_envelope(old: dict[str, Any]) -> dict[str, Any]:
    """An envelope stored before migration 8, in Gas City's format (gascity-wire-format.md): `producer_fence`
    is `fence`, `run_id` is `workflow_run_id`, absent optionals are omitted, Unix-seconds `occurred_at` is
    RFC 3339 UTC, and `outcome_id` is derived the Gas City way (the old id hashed other JSON)."""
    at = datetime.fromtimestamp(old["occurred_at"], UTC)
    fraction = f"{at.microsecond:06d}".rstrip("0")
    new: dict[str, Any] = {
        "contract_version": old["contract_version"],
        "outcome_id": derive_outcome_id(
            producer=old["producer"],
            store_ref=old["store_ref"],
            work_id=old["work_id"],
            state=old["state"],
            fence=old["producer_fence"],
        ),
        "producer": old["producer"],
        "store_ref": old["store_ref"],
        "work_id": old["work_id"],
        "source_root_id": old["source_root_id"],
    }
    if old.get("workflow_id"):
        new["workflow_id"] = old["workflow_id"]
        if old.get("run_id"):
            new["workflow_run_id"] = old["run_id"]
    return new | {
        "step_key": old["step_key"],
        "summary": old["summary"],
        "impact": old["impact"],
        "state": old["state"],
        "evidence": old["evidence"],
        "fence": old["producer_fence"],
        "occurred_at": at.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if fraction else "") + "Z",
    }


def _outcomes_speak_gascity(conn: sqlite3.Connection) -> None:
    """Migration 8: outcomes in Gas City's wire format (gascity-wire-format.md).

    Adds `acknowledged_by` and `cycle_in_flight` to `outcomes`; gives the ack inbox `acknowledged_by`. Acks
    waiting from before carry none, so they can never match (Gas City counts an invalid ack stale): they are
    counted in `stale_acknowledgements` and dropped. Every stored envelope is rewritten in the new format and
    its outcome re-keyed under the Gas City outcome id.
    """
    for statement in _statements(
        """
        ALTER TABLE outcomes ADD COLUMN acknowledged_by TEXT;
        ALTER TABLE outcomes ADD COLUMN cycle_in_flight INTEGER NOT NULL DEFAULT 0;
        UPDATE outcomes SET stale_acknowledgements = stale_acknowledgements + (
            SELECT COALESCE(SUM(copies), 0) FROM outcome_acks AS a WHERE a.outcome_id = outcomes.outcome_id
        );
        DROP TABLE outcome_acks;
        CREATE TABLE outcome_acks (
            seq               INTEGER PRIMARY KEY AUTOINCREMENT,
            outcome_id        TEXT NOT NULL REFERENCES outcomes(outcome_id) ON DELETE CASCADE,
            store_ref         TEXT NOT NULL,
            work_id           TEXT NOT NULL,
            coordinator_fence TEXT NOT NULL,
            acknowledged_by   TEXT NOT NULL,
            copies            INTEGER NOT NULL DEFAULT 1,
            UNIQUE (outcome_id, store_ref, work_id, coordinator_fence, acknowledged_by)
        );
        """
    ):
        conn.execute(statement)
    for outcome_id, stored in conn.execute("SELECT outcome_id, envelope FROM outcomes").fetchall():
        envelope = _gascity_envelope(json.loads(stored))
        conn.execute(
            "UPDATE outcomes SET outcome_id = ?, envelope = ? WHERE outcome_id = ?",
            (envelope["outcome_id"], json.dumps(envelope), outcome_id),
        )


@attrs.frozen
class Rebuild:
    """A migration that rebuilds a table (SQLite cannot alter a CHECK constraint): it runs with foreign keys
    off, as SQLite's procedure for a table rebuild requires, and every foreign key is checked before it
    commits."""

    script: str


def _encoded_21(expression: str) -> str:
    """Migration 21's copy of store/runs/keys.py `encoded_sql` (a shipped migration never changes)."""
    return (
        f"CASE WHEN {expression} LIKE '%!%%' ESCAPE '!' OR {expression} LIKE '%:%'"
        f" THEN replace(replace({expression}, '%', '%25'), ':', '%3A') ELSE {expression} END"
    )


_PREFIX_21 = (
    f"('on_enter:' || {_encoded_21('task_id')} || ':' || {_encoded_21('workflow_step_id')}"
    " || ':' || entry_seq || ':')"
)
_REST_21 = f"substr(idempotency_key, length({_PREFIX_21}) + 1)"


def key_parts_21(instr: str, decimal: str) -> tuple[str, str]:
    """Migration 21's (key_position, key_digest) read off an on_enter key, two SQL expressions (NULL for any
    other key); `instr` the dialect's substring search, `decimal` its test that `{}` is all digits."""
    found = (
        f"idempotency_key LIKE 'on_enter:%'"
        f" AND substr(idempotency_key, 1, length({_PREFIX_21})) = {_PREFIX_21}"
    )
    colon = f"{instr}({_REST_21}, ':')"
    position = f"substr({_REST_21}, 1, abs({colon} - 1))"
    when = f"{found} AND {colon} > 1 AND {decimal.format(position)}"
    agent = _encoded_21("agent_profile_id")
    return (
        f"CASE WHEN {when} THEN CAST({position} AS BIGINT) END",
        f"CASE WHEN {when} THEN substr({_REST_21}, {colon} + length({agent}) + 2) END",
    )


_KEY_PARTS_21_SQLITE = ", ".join(key_parts_21("instr", "NOT {} GLOB '*[^0-9]*'"))

KEYS_BY_PARTS_21 = f"""
    UPDATE runs SET key_position = NULL, key_digest = NULL WHERE key_position IS NOT NULL
        AND idempotency_key <> {_PREFIX_21} || key_position || ':' || {_encoded_21("agent_profile_id")}
        || ':' || key_digest;
    UPDATE runs SET idempotency_key = NULL WHERE id IN (SELECT MIN(id) FROM runs
        WHERE key_position IS NOT NULL
        GROUP BY task_id, workflow_step_id, entry_seq, key_position, agent_profile_id);
    UPDATE runs SET key_position = NULL, key_digest = NULL WHERE idempotency_key IS NOT NULL;
    CREATE UNIQUE INDEX runs_by_key ON runs(idempotency_key) WHERE idempotency_key IS NOT NULL;
    CREATE UNIQUE INDEX runs_by_entry_key
        ON runs(task_id, workflow_step_id, entry_seq, key_position, agent_profile_id);
"""
"""Migration 21's statements after the rebuild (both backends): keep the parts only where they give back the
key's bytes, move one run's key per (entry, position, agent) to them, then the two unique indexes."""


_CODES_23 = (
    ("clear_decisions", "c"),
    ("queue_run_for_each_participant", "f"),
    ("queue_run", "q"),
    ("run_code_review", "r"),
    ("ensure_participant_seat", "s"),
)
_OF_ENTRY_23 = (
    "m.task_id = step_entries.task_id AND m.step_id = step_entries.step_id"
    " AND m.entry_seq = step_entries.entry_seq"
)


def done_markers_23(aggregate: str) -> str:
    """Migration 23's move of the done markers written with their entry onto its row (both backends;
    `aggregate` the dialect's string concatenation, `{}` the text): a terminal entry all of whose markers
    are done, with no epoch, an empty detail, an engine-owned kind and its `created_at` as their time gets
    them as `done_markers` (store/entries/step_entries.py `DONE_CODES`), and its rows go."""
    code = " ".join(f"WHEN '{kind}' THEN '{letter}'" for kind, letter in _CODES_23)
    kinds = ", ".join(f"'{kind}'" for kind, _ in _CODES_23)
    text = f"CASE m.kind {code} END || CAST(m.position AS TEXT)"
    return f"""
    ALTER TABLE step_entries ADD COLUMN done_markers TEXT;
    UPDATE step_entries SET done_markers = (SELECT {aggregate.format(text)} FROM step_entry_markers AS m
        WHERE {_OF_ENTRY_23})
        WHERE terminal = 1 AND EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE {_OF_ENTRY_23})
        AND NOT EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE {_OF_ENTRY_23} AND NOT (m.state = 'done'
        AND m.epoch IS NULL AND m.detail = '' AND m.updated_at = step_entries.created_at
        AND m.kind IN ({kinds})));
    DELETE FROM step_entry_markers WHERE EXISTS (SELECT 1 FROM step_entries AS e
        WHERE e.task_id = step_entry_markers.task_id AND e.step_id = step_entry_markers.step_id
        AND e.entry_seq = step_entry_markers.entry_seq AND e.done_markers IS NOT NULL);
    """


_FEWER_BYTES_23 = (
    done_markers_23("group_concat({}, '')")
    + """
    UPDATE runs SET trigger = '' WHERE trigger = reason AND reason <> '';
    CREATE TABLE digests (
        id     INTEGER PRIMARY KEY,
        digest TEXT NOT NULL UNIQUE
    );
    INSERT INTO digests (digest) SELECT DISTINCT key_digest FROM runs WHERE key_digest IS NOT NULL;
    UPDATE runs SET key_digest = (SELECT id FROM digests WHERE digest = runs.key_digest)
        WHERE key_digest IS NOT NULL;
    INSERT INTO digests (digest) SELECT DISTINCT declaration_digest FROM step_entries WHERE true
        ON CONFLICT (digest) DO NOTHING;
    UPDATE step_entries SET declaration_digest = (SELECT id FROM digests
        WHERE digest = step_entries.declaration_digest);
    DROP INDEX runs_by_agent_time;
    CREATE TABLE run_minutes (
        minute   INTEGER PRIMARY KEY,
        first_id INTEGER NOT NULL
    );
    INSERT INTO run_minutes (minute, first_id)
        SELECT CAST(requested_at / 60 AS INTEGER), MIN(id) FROM runs GROUP BY 1;
    CREATE TRIGGER runs_minute_inserted AFTER INSERT ON runs BEGIN
        INSERT INTO run_minutes (minute, first_id) VALUES (CAST(NEW.requested_at / 60 AS INTEGER), NEW.id)
            ON CONFLICT (minute) DO UPDATE SET first_id = MIN(first_id, excluded.first_id);
    END;
    CREATE TRIGGER runs_minute_moved AFTER UPDATE OF requested_at ON runs BEGIN
        INSERT INTO run_minutes (minute, first_id) VALUES (CAST(NEW.requested_at / 60 AS INTEGER), NEW.id)
            ON CONFLICT (minute) DO UPDATE SET first_id = MIN(first_id, excluded.first_id);
    END;
    """
)
"""Migration 23 (see `MIGRATIONS`)."""


MIGRATIONS: tuple[str | Rebuild | Callable[[sqlite3.Connection], None], ...] = (
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
    # small inbox of acknowledgements waiting for the outcome's actor (store/outcomes/outcomes.py).
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
    # lookup scanned every task (throughput fell as the task count grew).
    """
    CREATE INDEX tasks_by_step ON tasks(workflow_id, workflow_step_id, wip_admitted);
    """,
    # 7: the recovery scan's index covers open entries only: flagging an entry terminal then removes one small
    # index row instead of moving it within an index over every entry ever made.
    """
    DROP INDEX step_entries_open;
    CREATE INDEX step_entries_open ON step_entries(task_id, step_id, entry_seq) WHERE terminal = 0;
    """,
    # 8: coordinator outcomes speak Gas City's wire format (gascity-wire-format.md).
    _outcomes_speak_gascity,
    # 9: the idempotency key of an enqueue merged into another run by coalescing, with that run: a redelivery
    # of the merged operation is then a no-op like any other. The key of an inserted run stays in
    # runs.idempotency_key; a key lives in one of the two places.
    """
    CREATE TABLE coalesced_keys (
        idempotency_key TEXT PRIMARY KEY,
        run_id          INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        seen_at         REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX coalesced_keys_by_run ON coalesced_keys(run_id);
    """,
    # 10: what a receipted decision said, so a reused decision id with another verdict is a conflict, not a
    # silent replay. '' = written before this column: such a receipt is a replay.
    """
    ALTER TABLE decision_receipts ADD COLUMN content TEXT NOT NULL DEFAULT '';
    """,
    # 11: a review run carries its entry identity, so a launch repeated after a crash reuses its row (the
    # stable review-run id a host deduplicates on) and a new entry gets a new one.
    """
    ALTER TABLE task_review_runs ADD COLUMN entry_seq INTEGER;
    ALTER TABLE task_review_runs ADD COLUMN position INTEGER;
    ALTER TABLE task_review_runs ADD COLUMN agent_profile_id TEXT;
    ALTER TABLE task_review_runs ADD COLUMN launches INTEGER NOT NULL DEFAULT 1;
    CREATE UNIQUE INDEX task_review_runs_by_entry
        ON task_review_runs(task_id, workflow_step_id, entry_seq, position);
    """,
    # 12: a task's admission counter, +1 at every step entry on every path, whether or not the step
    # allocates a step-entry record, so every session-action request of an entry carries an identity a host
    # can deduplicate on (a step declaring only host-owned actions has no record, AC-E5).
    """
    ALTER TABLE tasks ADD COLUMN admissions INTEGER NOT NULL DEFAULT 0;
    """,
    # 13: runs are work (store/runs/runs.py): the cancelled status, a claim's fencing token, attempt and
    # lease, a retry's schedule and count, where a run comes from (trigger, step entry, admission), why it
    # ended, and partial indexes over the unresolved runs only, so resolved history costs no index space but
    # its key's and its task's. Markers become WITHOUT ROWID: their primary key is the table (no second copy
    # of every key in an index). Decision receipts get their time; old receipts and terminal entries an index
    # (retention: store/retention/retention.py).
    Rebuild(
        """
        CREATE TABLE runs_next (
            id                      INTEGER PRIMARY KEY AUTOINCREMENT,
            agent_profile_id        TEXT NOT NULL,
            task_id                 TEXT REFERENCES tasks(id) ON DELETE CASCADE,
            workflow_step_id        TEXT,
            reason                  TEXT NOT NULL,
            payload                 TEXT,
            idempotency_key         TEXT UNIQUE,
            exclude_from_coalescing INTEGER NOT NULL DEFAULT 0,
            status                  TEXT NOT NULL DEFAULT 'queued' CHECK
                (status IN ('queued', 'claimed', 'finished', 'failed', 'cancelled')),
            coalesced_count         INTEGER NOT NULL DEFAULT 0,
            requested_at            REAL NOT NULL,
            claimed_at              REAL,
            finished_at             REAL,
            trigger                 TEXT,
            entry_seq               INTEGER,
            admission_seq           INTEGER,
            attempt                 INTEGER NOT NULL DEFAULT 0,
            retries                 INTEGER NOT NULL DEFAULT 0,
            claim_token             TEXT,
            lease_expires_at        REAL,
            retry_at                REAL,
            superseded              INTEGER NOT NULL DEFAULT 0,
            outcome_reason          TEXT,
            last_error              TEXT
        );
        INSERT INTO runs_next (id, agent_profile_id, task_id, workflow_step_id, reason, payload,
            idempotency_key, exclude_from_coalescing, status, coalesced_count, requested_at, claimed_at,
            finished_at, attempt)
            SELECT id, agent_profile_id, task_id, workflow_step_id, reason, payload, idempotency_key,
            exclude_from_coalescing, status, coalesced_count, requested_at, claimed_at, finished_at,
            CASE WHEN claimed_at IS NULL THEN 0 ELSE 1 END FROM runs;
        DROP TABLE runs;
        ALTER TABLE runs_next RENAME TO runs;
        CREATE INDEX runs_open_by_agent ON runs(agent_profile_id, requested_at, id)
            WHERE status IN ('queued', 'claimed');
        CREATE INDEX runs_by_task ON runs(task_id);
        CREATE INDEX runs_open_by_task ON runs(task_id) WHERE status IN ('queued', 'claimed');
        CREATE INDEX runs_leases ON runs(lease_expires_at) WHERE status = 'claimed';
        CREATE TABLE step_entry_markers_next (
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
        ) WITHOUT ROWID;
        INSERT INTO step_entry_markers_next SELECT task_id, step_id, entry_seq, position, kind, state, epoch,
            detail, updated_at FROM step_entry_markers;
        DROP TABLE step_entry_markers;
        ALTER TABLE step_entry_markers_next RENAME TO step_entry_markers;
        ALTER TABLE decision_receipts ADD COLUMN created_at REAL;
        UPDATE decision_receipts SET created_at = CAST(strftime('%s', 'now') AS REAL);
        CREATE INDEX decision_receipts_by_age ON decision_receipts(created_at);
        CREATE INDEX step_entries_by_age ON step_entries(created_at) WHERE terminal = 1;
        """
    ),
    # 14: a task's history (store/tasks/history.py): what no other table keeps (its creation, transitions,
    # decisions), numbered per task, written in the transaction of the effect; by age for retention.
    """
    CREATE TABLE task_history (
        task_id TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        seq     INTEGER NOT NULL,
        at      REAL NOT NULL,
        kind    TEXT NOT NULL,
        detail  TEXT NOT NULL,
        PRIMARY KEY (task_id, seq)
    ) WITHOUT ROWID;
    CREATE INDEX task_history_by_age ON task_history(at);
    """,
    # 15: the epoch of the runtime that created a step entry, which PostgreSQL's sweep reads to tell a live
    # runtime's claimless entry from a dead one's (store/backends/epochs.py `dead_epoch_entries`). PostgreSQL
    # fills it from the writer's session (store/backends/pg_schema.py); on SQLite it stays NULL, since one
    # runtime owns the file and its start-up scan finishes what a dead one left. Entries from before stay NULL
    # on both.
    """
    ALTER TABLE step_entries ADD COLUMN created_epoch TEXT;
    """,
    # 16: host calls answered over `onceflow serve`'s host role (store/outcomes/host_calls.py): one row per
    # call once it ended, for `list_host_calls` and a task's history; by task, by status and by age
    # (retention).
    """
    CREATE TABLE host_calls (
        id          INTEGER PRIMARY KEY,
        call_id     TEXT NOT NULL,
        kind        TEXT NOT NULL,
        task_id     TEXT,
        status      TEXT NOT NULL,
        attempts    INTEGER NOT NULL,
        host_id     TEXT,
        created_at  REAL NOT NULL,
        answered_at REAL NOT NULL,
        latency     REAL NOT NULL,
        error       TEXT
    );
    CREATE INDEX host_calls_by_task ON host_calls(task_id, id) WHERE task_id IS NOT NULL;
    CREATE INDEX host_calls_by_status ON host_calls(status, id);
    CREATE INDEX host_calls_by_age ON host_calls(answered_at);
    """,
    # 17: the event stream's era counter (store/event_eras.py): one row, bumped at every runtime start and
    # every 2**23 events, so an event_seq is never reused by a later start (actors/kernel/event_window.py).
    """
    CREATE TABLE event_eras (
        id  INTEGER PRIMARY KEY CHECK (id = 1),
        era INTEGER NOT NULL
    );
    INSERT INTO event_eras (id, era) VALUES (1, 0);
    """,
    # 18: how long a run's current wait was set for (a claim's lease, a retry's delay), so a lease or retry
    # time written under an earlier clock is trusted at most that long from now (store/backends/clock.py). A
    # lease held now gets an upper bound (its end less its first claim), a waiting retry none.
    """
    ALTER TABLE runs ADD COLUMN wait_seconds REAL;
    UPDATE runs SET wait_seconds = lease_expires_at - claimed_at WHERE status = 'claimed';
    """,
    # 19: every registration of a workflow is a version (store/tasks/workflows.py): its text kept per version,
    # the newest also in `workflows`; a task is pinned to the version it runs on (`tasks.workflow_version`).
    # What was registered before is version 1, and so is every task.
    """
    CREATE TABLE workflow_versions (
        workflow_id   TEXT NOT NULL REFERENCES workflows(id),
        version       INTEGER NOT NULL,
        source        TEXT NOT NULL,
        definition    TEXT NOT NULL,
        import_path   INTEGER NOT NULL DEFAULT 0,
        registered_at REAL NOT NULL,
        PRIMARY KEY (workflow_id, version)
    );
    INSERT INTO workflow_versions (workflow_id, version, source, definition, import_path, registered_at)
        SELECT id, 1, source, definition, import_path, registered_at FROM workflows;
    ALTER TABLE tasks ADD COLUMN workflow_version INTEGER NOT NULL DEFAULT 1;
    CREATE INDEX tasks_by_workflow_version ON tasks(workflow_id, workflow_version);
    """,
    # 20: flow control (store/runs/flow.py): a run's priority class, causation (its parent, depth, chain,
    # whether a human rooted it, whether it re-triggers its parent's agent), the run it retries, its stored
    # result and the limit that refused its enqueue (a refused enqueue is kept as a cancelled run, key-less);
    # ceilings and hourly rates, pauses, and each agent's turn (its last claim across agents: fairness).
    """
    ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 2;
    ALTER TABLE runs ADD COLUMN parent_run_id INTEGER;
    ALTER TABLE runs ADD COLUMN causation_depth INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN chain_id INTEGER;
    ALTER TABLE runs ADD COLUMN human_rooted INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN self_trigger INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN retry_of INTEGER;
    ALTER TABLE runs ADD COLUMN result TEXT;
    ALTER TABLE runs ADD COLUMN rate_limit TEXT;
    CREATE INDEX runs_self_triggers ON runs(chain_id, agent_profile_id, reason) WHERE self_trigger = 1;
    CREATE INDEX runs_by_agent_time ON runs(agent_profile_id, requested_at);
    CREATE TABLE run_limits (
        scope          TEXT NOT NULL,
        target_id      TEXT NOT NULL,
        max_concurrent INTEGER,
        runs_per_hour  INTEGER,
        updated_at     REAL NOT NULL,
        PRIMARY KEY (scope, target_id)
    );
    CREATE TABLE run_pauses (
        scope     TEXT NOT NULL,
        target_id TEXT NOT NULL,
        reason    TEXT NOT NULL,
        paused_at REAL NOT NULL,
        PRIMARY KEY (scope, target_id)
    );
    CREATE TABLE run_turns (
        agent_profile_id TEXT PRIMARY KEY,
        turn             INTEGER NOT NULL
    );
    """,
    # 21: an on_enter run's idempotency key is stored by its parts (store/runs/keys.py): the run's task, step,
    # entry_seq and agent, and its position and config digest, unique over all but the digest, which also
    # serves what runs_by_task did (its first column); any other key stays text, unique where not NULL (a
    # NULL costs no index row). An old on_enter key moves to its parts only where they give back its exact
    # bytes, and for one run of its (entry, position, agent); the rest keep their text. The AUTOINCREMENT
    # high-water mark is carried over, so no run id is ever reused (an escalation key names one).
    Rebuild(
        f"""
        CREATE TABLE runs_next (
            id                      INTEGER PRIMARY KEY AUTOINCREMENT,
            agent_profile_id        TEXT NOT NULL,
            task_id                 TEXT REFERENCES tasks(id) ON DELETE CASCADE,
            workflow_step_id        TEXT,
            reason                  TEXT NOT NULL,
            payload                 TEXT,
            idempotency_key         TEXT,
            exclude_from_coalescing INTEGER NOT NULL DEFAULT 0,
            status                  TEXT NOT NULL DEFAULT 'queued' CHECK
                (status IN ('queued', 'claimed', 'finished', 'failed', 'cancelled')),
            coalesced_count         INTEGER NOT NULL DEFAULT 0,
            requested_at            REAL NOT NULL,
            claimed_at              REAL,
            finished_at             REAL,
            trigger                 TEXT,
            entry_seq               INTEGER,
            admission_seq           INTEGER,
            attempt                 INTEGER NOT NULL DEFAULT 0,
            retries                 INTEGER NOT NULL DEFAULT 0,
            claim_token             TEXT,
            lease_expires_at        REAL,
            retry_at                REAL,
            superseded              INTEGER NOT NULL DEFAULT 0,
            outcome_reason          TEXT,
            last_error              TEXT,
            wait_seconds            REAL,
            priority                INTEGER NOT NULL DEFAULT 2,
            parent_run_id           INTEGER,
            causation_depth         INTEGER NOT NULL DEFAULT 0,
            chain_id                INTEGER,
            human_rooted            INTEGER NOT NULL DEFAULT 0,
            self_trigger            INTEGER NOT NULL DEFAULT 0,
            retry_of                INTEGER,
            result                  TEXT,
            rate_limit              TEXT,
            key_position            INTEGER,
            key_digest              TEXT
        );
        INSERT INTO runs_next SELECT *, {_KEY_PARTS_21_SQLITE} FROM runs;
        UPDATE sqlite_sequence SET seq = (SELECT seq FROM sqlite_sequence WHERE name = 'runs')
            WHERE name = 'runs_next';
        DROP TABLE runs;
        ALTER TABLE runs_next RENAME TO runs;
        {KEYS_BY_PARTS_21}
        CREATE INDEX runs_open_by_agent ON runs(agent_profile_id, requested_at, id)
            WHERE status IN ('queued', 'claimed');
        CREATE INDEX runs_open_by_task ON runs(task_id) WHERE status IN ('queued', 'claimed');
        CREATE INDEX runs_leases ON runs(lease_expires_at) WHERE status = 'claimed';
        CREATE INDEX runs_self_triggers ON runs(chain_id, agent_profile_id, reason) WHERE self_trigger = 1;
        CREATE INDEX runs_by_agent_time ON runs(agent_profile_id, requested_at);
        """
    ),
    # 22: nothing on SQLite. PostgreSQL keeps runs.task_id's foreign key by triggers checking a statement's
    # rows at once (store/backends/pg_schema.py's 22); SQLite's check of a row is an index probe in process.
    "",
    # 23: fewer bytes per step entry. The done markers a common entry writes with its entry live on the entry
    # row (`done_markers`, store/entries/step_entries.py): two rows fewer per entry. The hourly rates count
    # an agent's runs over the id range of the last hour (store/runs/flow.py), which `run_minutes` bounds:
    # per minute of `requested_at` the smallest id of a run requested in it, kept by two triggers (a run's
    # insert and a change of its `requested_at`), so runs_by_agent_time (one index row per run) goes. A run's
    # trigger is '' where it is its reason (store/runs/runs.py `TRIGGER`). An on_enter run's config digest is
    # the id of its row in `digests` (store/runs/digests.py), one row per digest, and so is an entry's
    # declaration digest.
    _FEWER_BYTES_23,
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
        migration = MIGRATIONS[version - 1]
        rebuild = isinstance(migration, Rebuild)
        if rebuild:
            (enforced,) = conn.execute("PRAGMA foreign_keys").fetchone()
            conn.execute("PRAGMA foreign_keys=OFF")  # outside a transaction, as SQLite requires
        conn.execute("BEGIN IMMEDIATE")
        try:
            if isinstance(migration, str | Rebuild):
                for statement in _statements(migration if isinstance(migration, str) else migration.script):
                    conn.execute(statement)
            else:
                migration(conn)
            if rebuild and conn.execute("PRAGMA foreign_key_check").fetchone() is not None:
                raise RuntimeError(f"migration {version} would leave a foreign key broken")
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        finally:
            if rebuild:
                conn.execute(f"PRAGMA foreign_keys={'ON' if enforced else 'OFF'}")
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
