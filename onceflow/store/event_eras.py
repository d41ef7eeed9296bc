"""The event stream's era counter: one row, bumped once per runtime start and once per renewal, so no two
blocks of event_seqs ever share an era (actors/kernel/event_window.py lays out the seqs). Writer thread.
"""

from __future__ import annotations

from onceflow.store.backends.connection import Connection, scalar


def next_era(conn: Connection) -> int:
    """Allocate the next era: the counter plus one, durable with the transaction (an era the runtime uses
    is never handed out again, whatever happens after the commit). Eras start at 1; an era of 1 means no
    runtime ever allocated one on this database before. Several runtimes on one PostgreSQL database each
    get their own: the UPDATE holds the row until the transaction ends."""
    era = scalar(conn, "UPDATE event_eras SET era = era + 1 WHERE id = 1 RETURNING era")
    if era is None:  # the migration seeds the row, and nothing deletes it
        raise RuntimeError("event_eras has no row: the database was altered by hand")
    return int(era)
