"""The durable outcome record and its acknowledgement inbox (coordinator-outcome-delivery.md). Writer thread:
every function runs inside the caller's transaction.

One `outcomes` row per outcome holds its whole queryable state (the spec's `CoordinatorOutcomeState`) as
counters, never a row per attempt, so a record does not grow with the number of attempts (AC-CO-13, the
spec's Continue-As-New). `outcome_acks` is a small inbox: an acknowledgement is committed there before its
command is answered and the outcome's actor drains it, so an ack that arrives while the actor is delivering,
just as its timer fires, or before a crash is not lost (AC-CO-8, AC-CO-14). Identical acks share one row
(`copies`); at most MAX_PENDING_ACKS distinct acks wait per outcome. `cycle_in_flight` marks a delivery
cycle begun and not yet ended, so a cycle interrupted by a stop is retried under its own id (AC-CO-17).
Functions run inside a store transaction (`StoreActor.transact`); times are Unix seconds.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

from onceflow.protocol.errors import BusyError, ConflictError, NotFoundError
from onceflow.protocol.outcome import OutcomeAcknowledgement
from onceflow.protocol.results import OutcomeInfo
from onceflow.protocol.times import rfc3339_or_none
from onceflow.store.backends.connection import Connection

Phase = Literal["pending", "needs-coordinator-ack", "acknowledged"]
PENDING: Phase = "pending"
NEEDS_ACK: Phase = "needs-coordinator-ack"
ACKNOWLEDGED: Phase = "acknowledged"

# The spec's last_delivery_error values.
DELIVERY_FAILED = "local-delivery-failed"
ACK_FAILED = "canonical-acknowledgement-failed"
CONFLICTING_READY = "conflicting-outcome-ready-signal"

MAX_PENDING_ACKS = 16

_COLUMNS = (
    "outcome_id, envelope, behavior_version, phase, delivery_attempts, duplicate_signals,"
    " stale_acknowledgements, delivery_ref, coordinator_fence, delivered_at, acknowledged_at,"
    " last_delivery_error, acknowledged_by, cycle_in_flight"
)


@attrs.frozen
class OutcomeRecord:
    """One outcome's durable state; `info` is the `get_outcome` result (AC-CO-3).

    `envelope` is the validated envelope as JSON data. `delivery_attempts` counts delivery cycles, all
    runtimes together; `delivery_ref` and `coordinator_fence` are those of the last successful delivery;
    `delivered_at` is the first success only. `acknowledged_by` is the committed acknowledgement's (None
    until then, and for outcomes acknowledged before the field existed). `cycle_in_flight` is True while
    cycle `delivery_attempts` has begun and not ended (AC-CO-17). `behavior_version` selects the rules the
    record runs under (AC-CO-12).
    """

    outcome_id: str
    envelope: dict[str, Any]
    behavior_version: int
    phase: Phase
    delivery_attempts: int
    duplicate_signals: int
    stale_acknowledgements: int
    delivery_ref: str | None
    coordinator_fence: str | None
    delivered_at: float | None
    acknowledged_at: float | None
    last_delivery_error: str | None
    acknowledged_by: str | None
    cycle_in_flight: bool = attrs.field(converter=bool)

    def info(self) -> OutcomeInfo:
        """Every field, as `get_outcome` replies (times as RFC 3339 UTC)."""
        return OutcomeInfo(
            outcome_id=self.outcome_id,
            envelope=self.envelope,
            behavior_version=self.behavior_version,
            phase=self.phase,
            delivery_attempts=self.delivery_attempts,
            duplicate_signals=self.duplicate_signals,
            stale_acknowledgements=self.stale_acknowledgements,
            delivery_ref=self.delivery_ref,
            coordinator_fence=self.coordinator_fence,
            delivered_at=rfc3339_or_none(self.delivered_at),
            acknowledged_at=rfc3339_or_none(self.acknowledged_at),
            last_delivery_error=self.last_delivery_error,
            acknowledged_by=self.acknowledged_by,
            cycle_in_flight=self.cycle_in_flight,
        )


@attrs.frozen
class PendingAck:
    """An acknowledgement waiting in the inbox; `seq` orders arrival."""

    seq: int
    store_ref: str
    outcome_id: str
    work_id: str
    coordinator_fence: str
    acknowledged_by: str

    def acknowledgement(self) -> OutcomeAcknowledgement:
        """The wire acknowledgement this entry holds."""
        return OutcomeAcknowledgement(
            store_ref=self.store_ref,
            outcome_id=self.outcome_id,
            work_id=self.work_id,
            coordinator_fence=self.coordinator_fence,
            acknowledged_by=self.acknowledged_by,
        )


def load(conn: Connection, outcome_id: str) -> OutcomeRecord | None:
    """The record, or None when there is none."""
    row = conn.execute(f"SELECT {_COLUMNS} FROM outcomes WHERE outcome_id = ?", (outcome_id,)).fetchone()
    if row is None:
        return None
    return OutcomeRecord(row[0], json.loads(row[1]), *row[2:])


def get(conn: Connection, outcome_id: str) -> OutcomeRecord:
    """The record. Raises NotFoundError (field outcome_id) when there is none."""
    record = load(conn, outcome_id)
    if record is None:
        raise NotFoundError(f"no outcome {outcome_id}", field="outcome_id")
    return record


def outcomes_page(conn: Connection, *, after_id: str | None, limit: int) -> tuple[list[OutcomeRecord], bool]:
    """Up to `limit` outcomes with ids after `after_id` (None: from the first), in outcome-id order, and
    whether more follow (the outcomes view's pages)."""
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM outcomes WHERE outcome_id > ? ORDER BY outcome_id LIMIT ?",
        (after_id or "", limit + 1),
    ).fetchall()
    return [OutcomeRecord(row[0], json.loads(row[1]), *row[2:]) for row in rows[:limit]], len(rows) > limit


def unfinished(conn: Connection) -> list[str]:
    """Ids of every outcome not yet acknowledged, oldest first (resumed at start, AC-CO-14)."""
    rows = conn.execute("SELECT outcome_id FROM outcomes WHERE phase != ? ORDER BY rowid", (ACKNOWLEDGED,))
    return [row[0] for row in rows]


def record_ready(
    conn: Connection, outcome_id: str, envelope: dict[str, Any], behavior_version: int
) -> tuple[Literal["started", "duplicate", "conflict"], OutcomeRecord]:
    """Create the outcome's record (phase pending), or count a repeat of it (AC-CO-11).

    An identical envelope under an existing id adds one to `duplicate_signals`; a different one sets
    `last_delivery_error` to `conflicting-outcome-ready-signal` and changes nothing else.
    """
    existing = load(conn, outcome_id)
    if existing is None:
        conn.execute(
            "INSERT INTO outcomes (outcome_id, envelope, behavior_version, phase) VALUES (?, ?, ?, ?)",
            (outcome_id, json.dumps(envelope), behavior_version, PENDING),
        )
        return "started", get(conn, outcome_id)
    if existing.envelope == envelope:
        conn.execute(
            "UPDATE outcomes SET duplicate_signals = duplicate_signals + 1 WHERE outcome_id = ?",
            (outcome_id,),
        )
        return "duplicate", get(conn, outcome_id)
    return "conflict", record_error(conn, outcome_id, CONFLICTING_READY)


def begin_cycle(conn: Connection, outcome_id: str) -> OutcomeRecord:
    """Count one more delivery cycle, in flight; the new `delivery_attempts` is its number (AC-CO-4)."""
    conn.execute(
        "UPDATE outcomes SET delivery_attempts = delivery_attempts + 1, cycle_in_flight = 1"
        " WHERE outcome_id = ?",
        (outcome_id,),
    )
    return get(conn, outcome_id)


def record_delivery(
    conn: Connection, outcome_id: str, delivery_ref: str, coordinator_fence: str, now: float
) -> OutcomeRecord:
    """A delivery succeeded: phase needs-coordinator-ack under its fence and ref, error cleared, the cycle
    ended (AC-CO-6). An acknowledged outcome stays as it is: acknowledged is terminal (AC-CO-3), whichever
    actor or runtime reports a late delivery."""
    conn.execute(
        "UPDATE outcomes SET phase = ?, delivery_ref = ?, coordinator_fence = ?, cycle_in_flight = 0,"
        " delivered_at = COALESCE(delivered_at, ?), last_delivery_error = NULL"
        " WHERE outcome_id = ? AND phase <> ?",
        (NEEDS_ACK, delivery_ref, coordinator_fence, now, outcome_id, ACKNOWLEDGED),
    )
    return get(conn, outcome_id)


def fail_cycle(conn: Connection, outcome_id: str) -> OutcomeRecord:
    """The cycle in flight failed: `local-delivery-failed`, the cycle ended (AC-CO-7)."""
    conn.execute("UPDATE outcomes SET cycle_in_flight = 0 WHERE outcome_id = ?", (outcome_id,))
    return record_error(conn, outcome_id, DELIVERY_FAILED)


def record_error(conn: Connection, outcome_id: str, error: str) -> OutcomeRecord:
    """Set `last_delivery_error` (one of the spec's values above); nothing else changes."""
    conn.execute("UPDATE outcomes SET last_delivery_error = ? WHERE outcome_id = ?", (error, outcome_id))
    return get(conn, outcome_id)


def enqueue_ack(conn: Connection, ack: OutcomeAcknowledgement) -> tuple[bool, OutcomeRecord]:
    """Put an acknowledgement in the outcome's inbox; return whether it was queued, and the record.

    An ack for an acknowledged outcome is not queued: by the same `acknowledged_by` (or any, when the
    record predates the field) it is a no-op (AC-CO-16). An ack identical to one already waiting adds a
    copy, also when another runtime inserted it concurrently (the insert is an upsert on the inbox's key).

    Raises:
        NotFoundError: no such outcome (field outcome_id).
        ConflictError: the outcome was acknowledged by someone else (field acknowledged_by, AC-CO-16).
        BusyError: MAX_PENDING_ACKS distinct acks already wait (field outcome_id); retry later.
    """
    outcome_id = ack.outcome_id
    record = get(conn, outcome_id)
    if record.phase == ACKNOWLEDGED:
        if record.acknowledged_by not in (None, ack.acknowledged_by):
            raise ConflictError(
                f"outcome {outcome_id} was acknowledged by {record.acknowledged_by}",
                field="acknowledged_by",
            )
        return False, record
    key = (outcome_id, ack.store_ref, ack.work_id, ack.coordinator_fence, ack.acknowledged_by)
    updated = conn.execute(
        "UPDATE outcome_acks SET copies = copies + 1 WHERE outcome_id = ? AND store_ref = ? AND work_id = ?"
        " AND coordinator_fence = ? AND acknowledged_by = ?",
        key,
    )
    if updated.rowcount == 0:
        (waiting,) = conn.execute(
            "SELECT COUNT(*) FROM outcome_acks WHERE outcome_id = ?", (outcome_id,)
        ).fetchone()
        if waiting >= MAX_PENDING_ACKS:
            raise BusyError(
                f"outcome {outcome_id} already has {waiting} acknowledgements waiting",
                field="outcome_id",
            )
        conn.execute(  # an identical ack another runtime inserted meanwhile (PostgreSQL): one more copy
            "INSERT INTO outcome_acks (outcome_id, store_ref, work_id, coordinator_fence, acknowledged_by)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (outcome_id, store_ref, work_id, coordinator_fence,"
            " acknowledged_by) DO UPDATE SET copies = outcome_acks.copies + 1",
            key,
        )
    return True, record


def matches(record: OutcomeRecord, ack: PendingAck) -> bool:
    """AC-CO-9: store ref, outcome id, work id and the current coordinator fence all equal (any
    acknowledged_by)."""
    return (
        ack.store_ref == record.envelope["store_ref"]
        and ack.outcome_id == record.outcome_id
        and ack.work_id == record.envelope["work_id"]
        and ack.coordinator_fence == record.coordinator_fence
    )


def take_matching_ack(conn: Connection, outcome_id: str) -> PendingAck | None:
    """Drain the inbox in arrival order up to the first ack matching the current delivery (AC-CO-9).

    Each ack before it that does not match is removed and counted in `stale_acknowledgements` (once per
    copy). The matching ack stays in the inbox until `record_acknowledged` or `consume_ack` removes it, so
    a crash before its commit finishes loses nothing.
    """
    record = get(conn, outcome_id)
    rows = conn.execute(
        "SELECT seq, store_ref, outcome_id, work_id, coordinator_fence, acknowledged_by, copies"
        " FROM outcome_acks WHERE outcome_id = ? ORDER BY seq",
        (outcome_id,),
    ).fetchall()
    stale = 0
    found = None
    for row in rows:
        ack = PendingAck(*row[:6])
        if matches(record, ack):
            found = ack
            break
        stale += row[6]
        conn.execute("DELETE FROM outcome_acks WHERE seq = ?", (ack.seq,))
    conn.execute(
        "UPDATE outcomes SET stale_acknowledgements = stale_acknowledgements + ? WHERE outcome_id = ?",
        (stale, outcome_id),
    )
    return found


def consume_ack(conn: Connection, ack: PendingAck) -> OutcomeRecord:
    """Committing `ack` failed: remove one copy of it and record `canonical-acknowledgement-failed`."""
    conn.execute("UPDATE outcome_acks SET copies = copies - 1 WHERE seq = ?", (ack.seq,))
    conn.execute("DELETE FROM outcome_acks WHERE seq = ? AND copies <= 0", (ack.seq,))
    return record_error(conn, ack.outcome_id, ACK_FAILED)


def record_acknowledged(conn: Connection, outcome_id: str, acknowledged_by: str, now: float) -> OutcomeRecord:
    """The acknowledgement was committed: phase acknowledged at `now` by `acknowledged_by`; the inbox is
    emptied (AC-CO-15, AC-CO-16)."""
    conn.execute(
        "UPDATE outcomes SET phase = ?, acknowledged_at = ?, acknowledged_by = ? WHERE outcome_id = ?",
        (ACKNOWLEDGED, now, acknowledged_by, outcome_id),
    )
    conn.execute("DELETE FROM outcome_acks WHERE outcome_id = ?", (outcome_id,))
    return get(conn, outcome_id)
