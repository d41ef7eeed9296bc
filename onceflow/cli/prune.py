"""`onceflow prune --db DB [--older-than SECONDS]`: retention on demand. Main thread: one Trio run that
opens the store (on SQLite it takes the database's lock, so it cannot run beside the runtime that owns the
file; on PostgreSQL it runs beside live runtimes) and deletes resolved history in the runtime's bounded
batches (store/retention/retention.py), then prints one JSON object: the rows deleted per kind.

Exit status: 0 once done; 2 when the database cannot be used (missing, owned by a runtime, not a database,
a server that does not answer) or `--older-than` is below the 24 h key window; one `error:` line on
stderr names why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import trio

from onceflow.actors.runtime.retention import prune
from onceflow.protocol.errors import OnceflowError
from onceflow.protocol.runs import DEFAULT_RETENTION, retention_seconds
from onceflow.store.backends import faults
from onceflow.store.backends.lock import DatabaseOwnedError
from onceflow.store.backends.urls import database_arg, is_postgres_url, redacted
from onceflow.store.writer import open_store

CANNOT_RUN = 2


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `prune` to the `onceflow` parser (it sets `handler`: args -> exit status)."""
    parser = sub.add_parser("prune", help="delete resolved history older than the retention, now")
    parser.add_argument("--db", type=database_arg, required=True, help="SQLite file or postgresql:// URL")
    parser.add_argument(
        "--older-than",
        type=float,
        default=DEFAULT_RETENTION,
        metavar="SECONDS",
        help=f"the retention (default {DEFAULT_RETENTION:.0f} s, 7 days; at least 86400, the key window)",
    )
    parser.set_defaults(handler=lambda args: run(args.db, args.older_than))


def run(db: Path | str, older_than: float) -> int:
    """Prune `db` of what is older than `older_than` seconds; print the counts. Returns the exit status."""
    try:
        retention = retention_seconds(older_than)
        if not is_postgres_url(db) and not Path(db).is_file():
            raise FileNotFoundError(f"{db}: no such database file")
        deleted = trio.run(_prune, db, retention)
    except faults.any_database_errors(DatabaseOwnedError, OSError, OnceflowError, ValueError) as exc:
        where = redacted(db) if isinstance(db, str) else str(db)
        print(f"error: {where}: {exc}", file=sys.stderr)
        return CANNOT_RUN
    print(json.dumps(deleted))
    return 0


async def _prune(db: Path | str, retention: float) -> dict[str, int]:
    async with open_store(db) as store:
        return await prune(store, time.time, retention)
