"""Which runtime delivers an outcome, when several share one PostgreSQL database. Writer thread: every
function runs inside the caller's transaction.

coordinator-outcome-delivery.md has one workflow per outcome; onceflow runs it as one `OutcomeActor`. With
several runtimes on one database, any of them may resume an unfinished outcome (at its start, or when the
runtime delivering it died), so two actors could run the same outcome at once: both deliver, both take the
matching ack from the inbox and both commit it through the host (an outcome acknowledged twice). So an actor
delivers only while its runtime holds the outcome's claim: a session-level advisory lock keyed by the
outcome id on the writer's connection, like an epoch's (store/backends/epochs.py). A SIGKILLed runtime's
session ends at once and frees its claims; a partitioned one's within `postgres.PARTITION_BOUND`; a runtime
that lost its connection holds none of its old claims on the new one. Every transaction of an actor checks the
claim (`held`) and the actor stops when it is gone; live runtimes resume the outcomes nobody claims
(`unclaimed_unfinished`) every few seconds.

SQLite: one runtime owns the file and its outcome supervisor runs at most one actor per outcome, so every
claim is granted and nothing is locked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

from onceflow.store.backends.connection import Connection, scalar
from onceflow.store.backends.urls import on_postgres
from onceflow.store.outcomes import outcomes
from onceflow.store.outcomes.outcomes import OutcomeRecord

T = TypeVar("T")

_DOMAIN = b"onceflow-outcome:"  # a key space apart from the epochs' (same bigint locks, other hash input)


def claim_key(outcome_id: str) -> int:
    """The signed 64-bit advisory-lock key of an outcome's claim."""
    digest = hashlib.blake2b(_DOMAIN + outcome_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _held_keys(conn: Connection) -> set[int]:
    """The advisory bigint keys some session holds in this database (this one's included)."""
    rows = conn.execute(
        "SELECT classid::bigint, objid::bigint FROM pg_locks"
        " WHERE locktype = 'advisory' AND objsubid = 1 AND granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchall()
    return {_signed((high << 32) | low) for high, low in rows}


def _signed(key: int) -> int:
    return key - (1 << 64) if key >= 1 << 63 else key


def held(conn: Connection, outcome_id: str) -> bool:
    """Whether this connection's session holds the outcome's claim (always on SQLite)."""
    if not on_postgres(conn):
        return True
    return bool(
        scalar(
            conn,
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted"
            " AND pid = pg_backend_pid() AND classid::bigint = ? AND objid::bigint = ?)",
            _split(claim_key(outcome_id)),
        )
    )


def _split(key: int) -> tuple[int, int]:
    unsigned = key & ((1 << 64) - 1)
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def claim(conn: Connection, outcome_id: str) -> bool:
    """Take the outcome's claim for this connection's session unless it holds it already; True when held
    afterwards, False when another live runtime holds it. Taken once per session (a session lock counts
    re-takes, and one release must free it), and kept even if the transaction rolls back."""
    if held(conn, outcome_id):
        return True
    return bool(scalar(conn, "SELECT pg_try_advisory_lock(?)", (claim_key(outcome_id),)))


def release(conn: Connection, outcome_id: str) -> None:
    """Give the claim up (the outcome is acknowledged); nothing when not held, nothing on SQLite."""
    if on_postgres(conn) and held(conn, outcome_id):
        conn.execute("SELECT pg_advisory_unlock(?)", (claim_key(outcome_id),))


def unclaimed_unfinished(conn: Connection) -> list[str]:
    """The unacknowledged outcomes, oldest first, whose claim no session holds (on SQLite: all of them)."""
    ids = outcomes.unfinished(conn)
    if not on_postgres(conn) or not ids:
        return ids
    taken = _held_keys(conn)
    return [outcome_id for outcome_id in ids if claim_key(outcome_id) not in taken]


class ClaimLostError(Exception):
    """This runtime no longer holds the outcome's claim (its connection was replaced): another runtime may
    be delivering it, so the outcome's actor stops; what it committed stays."""


def start(conn: Connection, outcome_id: str) -> OutcomeRecord | None:
    """The outcome's record, claimed for delivery by this runtime unless it is acknowledged already; None
    when another runtime holds the claim. Raises NotFoundError for an unknown outcome."""
    record = outcomes.get(conn, outcome_id)
    if record.phase != outcomes.ACKNOWLEDGED and not claim(conn, outcome_id):
        return None
    return record


def while_held(conn: Connection, outcome_id: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(conn, *args)`, provided this runtime still holds the outcome's claim.

    Raises:
        ClaimLostError: it does not (nothing of `fn` ran).
    """
    if not held(conn, outcome_id):
        raise ClaimLostError(f"outcome {outcome_id}: this runtime's claim is gone")
    return fn(conn, *args)


def acknowledge_and_release(
    conn: Connection, outcome_id: str, acknowledged_by: str, now: float
) -> OutcomeRecord:
    """`outcomes.record_acknowledged`, and the claim given up: nobody needs to deliver it any more."""
    record = outcomes.record_acknowledged(conn, outcome_id, acknowledged_by, now)
    release(conn, outcome_id)
    return record
