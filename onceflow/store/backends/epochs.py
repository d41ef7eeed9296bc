"""Epoch liveness without leases, and per-task serialization across runtimes. Writer thread (but
`CURRENT_TASK`, which the Trio side sets).

SQLite: one runtime owns the file (store/backends/lock.py), so an epoch other than ours is dead by definition.

PostgreSQL: several runtimes share the database, so liveness must be real. A runtime holds a session-level
advisory lock keyed by its epoch on the writer's own connection, taken before any epoch-stamped write
(`hold_epoch`, at connect), which also sets the session's `onceflow.epoch` (`EPOCH_SETTING`), so every step
entry the writer inserts records its creating epoch (`step_entries.created_epoch`, a column DEFAULT read
from that setting: store/backends/pg_schema.py, migration 15). A marker's or an entry's epoch is stale iff
that lock can be taken: `is_live` tries `pg_try_advisory_xact_lock_shared` inside the reclaiming transaction,
so the answer holds until it commits (the dead epoch's lock is then held shared for the rest of the
transaction, so no session could take it exclusively meanwhile), and runtimes recovering at once, each holding
it shared, all see the epoch dead (an exclusive try would see it live while another recovering transaction
holds it). A SIGKILLed runtime's session ends at once and frees its lock; a partitioned one's ends within
`postgres.PARTITION_BOUND` seconds. A runtime that loses its connection mints a new epoch, never re-locks
the old one (its fresh session gets the new epoch's setting with the lock). Engines whose advisory locks
are stubs that always succeed (CockroachDB's) would make every epoch look dead: `verify_real_locks` refuses
them at connect.

Commands for one task are serialized across runtimes by a transaction-scoped advisory lock keyed by the
task id (`lock_tasks`), in a key space apart from the epochs' (two-int keys vs one bigint).
"""

from __future__ import annotations

import contextvars
import hashlib
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from onceflow.store.backends.connection import Connection, Cursor, scalar
from onceflow.store.backends.urls import on_postgres
from onceflow.store.records import StepEntry

if TYPE_CHECKING:  # psycopg is imported only by a runtime on PostgreSQL
    from onceflow.store.backends.postgres import PgConnection

TASK_NAMESPACE = 0x6F66  # 'of': the first key of every task lock (pg_advisory_xact_lock(int, int))

CURRENT_TASK: contextvars.ContextVar[str | None] = contextvars.ContextVar("onceflow_task", default=None)
"""The task whose commands the current Trio task serves (set by the task actor's supervision loop); the
store takes that task's lock in every transaction it requests on PostgreSQL."""


class AdvisoryLocksUnsupportedError(RuntimeError):
    """The database accepted an advisory lock another session already holds: its advisory locks are not
    real (a stub that always succeeds), so epoch liveness cannot be told. Raised at connect."""


def epoch_key(epoch: str) -> int:
    """The signed 64-bit advisory-lock key of an epoch (a hash of the whole string, so any stored value,
    even one no runtime could hold, has a key)."""
    return int.from_bytes(hashlib.blake2b(epoch.encode(), digest_size=8).digest(), "big", signed=True)


EPOCH_SETTING = "onceflow.epoch"
"""The session setting holding the epoch whose lock the session holds: the DEFAULT of
`step_entries.created_epoch` on PostgreSQL (store/backends/pg_schema.py)."""


def hold_epoch(conn: PgConnection, epoch: str) -> None:
    """Take `epoch`'s session-level lock on `conn` (the writer's connection), without waiting, and with it
    set `EPOCH_SETTING` to `epoch` for the session (one statement; the setting only once the lock is held).
    Called outside a transaction (at connect, and on the fresh connection of an epoch renewal), so the
    setting is the session's for good: a rollback or `PgConnection.reset` (ROLLBACK, DEALLOCATE ALL) keeps it.

    Raises:
        RuntimeError: the lock is held by another session (two epochs sharing 64 bits: never in practice).
    """
    held = conn.scalar(
        "SELECT CASE WHEN pg_try_advisory_lock(?) THEN set_config(?, ?, false) END",
        (epoch_key(epoch), EPOCH_SETTING, epoch),
    )
    if held is None:
        raise RuntimeError(f"the lock of fresh epoch {epoch} is already held by another session")


def verify_real_locks(conn: PgConnection, other: PgConnection) -> None:
    """Check that an advisory lock held by `conn`'s session cannot be taken by `other`'s.

    Raises:
        AdvisoryLocksUnsupportedError: `other` got the lock too.
    """
    probe = secrets.randbits(62)  # random: runtimes starting together never probe the same key
    if not conn.scalar("SELECT pg_try_advisory_lock(?)", (probe,)):
        raise AdvisoryLocksUnsupportedError("a fresh advisory lock could not be taken")
    try:
        if other.scalar("SELECT pg_try_advisory_lock(?)", (probe,)):
            other.execute("SELECT pg_advisory_unlock(?)", (probe,))
            raise AdvisoryLocksUnsupportedError(
                "this database's advisory locks are not exclusive (a lock one session holds was granted to"
                " another): onceflow needs real ones to tell a live runtime's epoch from a dead one, so it"
                " refuses this engine (e.g. CockroachDB, whose advisory locks are stubs)"
            )
    finally:
        conn.execute("SELECT pg_advisory_unlock(?)", (probe,))


class EpochSource(Protocol):
    """What holds the runtime's current epoch (the `StoreActor`): read on the writer thread, inside the
    transaction that claims with it, because on PostgreSQL a reconnect may have replaced it."""

    @property
    def epoch(self) -> str: ...


def is_live(conn: Connection, epoch: str) -> bool:
    """Whether the runtime that wrote `epoch` into a marker may still be running, asked inside the
    reclaiming transaction on `conn`: never on SQLite (the file's owner is the only runtime; the caller
    has already compared with its own epoch); on PostgreSQL iff `epoch`'s lock cannot be taken now, shared
    (only its runtime holds it exclusively; other transactions testing it hold it shared)."""
    if not on_postgres(conn):
        return False
    return not scalar(conn, "SELECT pg_try_advisory_xact_lock_shared(?)", (epoch_key(epoch),))


def lock_tasks(conn: PgConnection, task_ids: Sequence[str]) -> dict[str, bool]:
    """Take the transaction-scoped locks of `task_ids` (distinct) in one round trip: the first is waited
    for, the others only tried, so two runtimes' batches never wait on each other in a cycle; whether each
    is held. Raises what the wait raises (lock_timeout: busy)."""
    if not task_ids:
        return {}
    first = conn.execute("SELECT pg_advisory_xact_lock(?, hashtext(?))", (TASK_NAMESPACE, task_ids[0]))
    held = {task_ids[0]: True}
    if len(task_ids) == 1:
        first.fetchall()
        return held
    tried = conn.execute(
        "SELECT pg_try_advisory_xact_lock(?, hashtext(u.task)) FROM unnest(CAST(? AS text[]))"
        " WITH ORDINALITY AS u(task, n) ORDER BY u.n",
        (TASK_NAMESPACE, list(task_ids[1:])),
    ).fetchall()
    held.update(zip(task_ids[1:], (bool(ok) for (ok,) in tried), strict=True))
    return held


def try_lock_tasks(conn: Connection, task_ids: Sequence[str]) -> Cursor:
    """Try, never wait for, the transaction-scoped locks of `task_ids` (distinct; PostgreSQL), in one
    statement; its rows, when read, are (task_id, held) in `task_ids`' order. The statement is returned
    unread, so that inside a pipeline the caller's next statements go out with it: one round trip. A lock
    already held by this transaction is held again (advisory locks are re-entrant). Never waiting, a caller
    holding many tasks' locks can never be part of a wait cycle with another runtime's batch, which waits for
    one lock only while holding none (`lock_tasks`)."""
    return conn.execute(
        "SELECT u.task, pg_try_advisory_xact_lock(?, hashtext(u.task)) FROM unnest(CAST(? AS text[]))"
        " WITH ORDINALITY AS u(task, n) ORDER BY u.n",
        (TASK_NAMESPACE, list(task_ids)),
    )


def dead_epoch_entries(
    conn: Connection, source: EpochSource, created_before: float, limit: int
) -> list[tuple[StepEntry, int]]:
    """The open entries a live runtime should finish, PostgreSQL only: those holding no in_progress marker
    of a live epoch (`source.epoch`, ours, or one whose lock `is_live` finds held) and either

    - holding one of a dead epoch (a dead runtime's claim), or
    - created by a dead epoch (`created_epoch`): a dead runtime's entry it committed and left without a
      claim (a promotion's E3 entry, a dispatch that had not begun or waited on a host action), taken as soon
      as that epoch is dead, however young; an entry whose creating epoch lives is its runtime's to finish,
      however long its dispatch waits on a host action; or
    - of unknown creating epoch (NULL: created before migration 15, or on a session holding no epoch) and
      created before `created_before` (Unix seconds): the grace rule, under which a live runtime's dispatch
      waiting that long may be raced (each engine action still runs once, by the markers' compare-and-set).

    An epoch that died while its runtime lives (a lost connection: the writer renews its epoch) forfeits
    its entries like its claims: their remaining engine actions may run before a host action its dispatch
    still waits on completes. Each entry comes with the greatest entry_seq of its pair, in (task_id, step_id,
    entry_seq) order, at most `limit` of them.

    One statement asks which epochs holding a claim (the partial index on in_progress markers) or having
    created an open entry (the partial index of open entries) are not ours, `is_live` one statement each
    for those, and one reads the entries (the partial index of open entries, each marker probe by primary
    key).
    """
    own_epoch = source.epoch
    epochs_seen = conn.execute(
        "SELECT epoch FROM step_entry_markers"
        " WHERE state = 'in_progress' AND epoch IS NOT NULL AND epoch <> ?"
        " UNION SELECT created_epoch FROM step_entries"
        " WHERE terminal = 0 AND created_epoch IS NOT NULL AND created_epoch <> ?",
        (own_epoch, own_epoch),
    ).fetchall()
    dead = [epoch for (epoch,) in epochs_seen if not is_live(conn, epoch)]
    of_entry = "m.task_id = e.task_id AND m.step_id = e.step_id AND m.entry_seq = e.entry_seq"
    rows = conn.execute(
        "SELECT e.task_id, e.step_id, e.entry_seq, e.workflow_id,"
        " (SELECT dg.digest FROM digests AS dg WHERE dg.id = e.declaration_digest), e.entry_path,"
        " (SELECT MAX(later.entry_seq) FROM step_entries AS later"
        "  WHERE later.task_id = e.task_id AND later.step_id = e.step_id),"
        " COALESCE((SELECT t.workflow_version FROM tasks AS t WHERE t.id = e.task_id), 1)"
        " FROM step_entries AS e WHERE e.terminal = 0"
        # an epoch not known dead (ours, a live one, one claiming since the first statement) is live
        f" AND NOT EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE {of_entry}"
        "  AND m.state = 'in_progress' AND NOT COALESCE(m.epoch = ANY(CAST(? AS text[])), FALSE))"
        " AND (e.created_epoch = ANY(CAST(? AS text[]))"
        "  OR (e.created_epoch IS NULL AND e.created_at < ?)"
        f"  OR EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE {of_entry}"
        "   AND m.state = 'in_progress' AND m.epoch = ANY(CAST(? AS text[]))))"
        " ORDER BY e.task_id, e.step_id, e.entry_seq LIMIT ?",
        (dead, dead, created_before, dead, limit),
    ).fetchall()
    return [
        (
            StepEntry(task_id, step_id, int(seq), workflow_id, digest, path, False, int(version)),
            int(latest),
        )
        for task_id, step_id, seq, workflow_id, digest, path, latest, version in rows
    ]
