"""Storage faults: which sqlite3 errors they are, and which of them end the transaction. Pure: asked on the
writer thread.

PostgreSQL's errors reach the store as sqlite3 errors too: store/backends/postgres.py owns the table from
SQLSTATE to
`StorageKind` and gives each mapped error the SQLite code of its kind (`SQLITE_CODES`), so the rules below
hold on both backends.

SQLite may roll a whole transaction back on SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM or SQLITE_CORRUPT (its
"Response To Errors Within A Transaction"); `max_page_count` hitting its cap does. Writes issued after that
would run in autocommit mode, each committed on its own while the request is reported as failed. So code
that catches a database error and carries on must first ask `fails_request` (which includes
`ends_transaction`) and re-raise when it says so, and the writer fails the whole request, and every request
of its batch, once the transaction is gone.
"""

from __future__ import annotations

import sqlite3

from onceflow.protocol.errors import StorageError, StorageKind
from onceflow.store.backends.connection import Connection

_KINDS: dict[int, StorageKind] = {
    sqlite3.SQLITE_BUSY: "busy",
    sqlite3.SQLITE_LOCKED: "busy",
    sqlite3.SQLITE_FULL: "full",
    sqlite3.SQLITE_IOERR: "io",
    sqlite3.SQLITE_CANTOPEN: "io",
    sqlite3.SQLITE_PROTOCOL: "io",
    sqlite3.SQLITE_NOMEM: "out_of_memory",
    sqlite3.SQLITE_READONLY: "read_only",
    sqlite3.SQLITE_PERM: "read_only",
    sqlite3.SQLITE_AUTH: "read_only",
    sqlite3.SQLITE_CORRUPT: "corrupt",
    sqlite3.SQLITE_NOTADB: "corrupt",
    sqlite3.SQLITE_ABORT: "aborted",
}

SQLITE_CODES: dict[StorageKind, int] = {
    "busy": sqlite3.SQLITE_BUSY,
    "full": sqlite3.SQLITE_FULL,
    "io": sqlite3.SQLITE_IOERR,
    "out_of_memory": sqlite3.SQLITE_NOMEM,
    "read_only": sqlite3.SQLITE_READONLY,
    "corrupt": sqlite3.SQLITE_CORRUPT,
    "aborted": sqlite3.SQLITE_ABORT,
}
"""The SQLite primary result code standing for each kind: what another backend's error of that kind
carries as `sqlite_errorcode`, so that `storage_kind` and `ends_transaction` read it as SQLite's own."""

# Errors after which the transaction must not go on, whether or not SQLite already rolled it back.
_ENDS_TRANSACTION = frozenset(
    {
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_CORRUPT,
        sqlite3.SQLITE_NOTADB,
    }
)


def primary_code(exc: BaseException) -> int | None:
    """The primary SQLite result code of `exc` (extended codes folded), or None when it carries none."""
    code = getattr(exc, "sqlite_errorcode", None) if isinstance(exc, sqlite3.Error) else None
    return None if code is None else int(code) & 0xFF


def storage_kind(exc: BaseException) -> StorageKind | None:
    """The `StorageKind` of a sqlite3 error that reports a storage fault; None for anything else (a
    constraint violation, an SQL error, an error raised by our own code)."""
    code = primary_code(exc)
    return None if code is None else _KINDS.get(code)


def ends_transaction(conn: Connection, exc: BaseException) -> bool:
    """Whether the transaction on `conn` is over after `exc`: SQLite already left it (`in_transaction` is
    False), or `exc` is SQLITE_FULL, IOERR, NOMEM, CORRUPT or NOTADB, after which nothing may continue.

    Every handler that catches a database error inside a transaction and continues must re-raise when this
    is True: writes after it would each commit on their own while the request is reported as failed.
    """
    return not conn.in_transaction or primary_code(exc) in _ENDS_TRANSACTION


def fails_request(conn: Connection, exc: BaseException) -> bool:
    """Whether `exc` must fail the whole request rather than the part of it that met it: it ended the
    transaction (`ends_transaction`), or it is a storage fault at all. A storage fault is the database's,
    not the part's (a row locked past the busy timeout, a deadlock, a revoked privilege, a full disk): the
    whole command may succeed once it clears, so no part of it may be recorded as failed, or left out of a
    commit that goes on, for it. On SQLite every storage fault inside a transaction also ends it; on
    PostgreSQL a busy, read-only or aborted one does not.

    Every handler that catches a database error inside a transaction and continues (a per-action or
    per-participant failure, a fast path falling back to the slow one) must re-raise when this is True.
    """
    return ends_transaction(conn, exc) or storage_kind(exc) is not None


def storage_error(exc: BaseException, *, kind: StorageKind | None = None, context: str = "") -> StorageError:
    """A `StorageError` for `exc`: of `kind` when given, else of `exc`'s own kind ("aborted" when it reports
    no storage fault). `context` prefixes the detail (why this request failed). Chain it `from exc`."""
    return StorageError(kind or storage_kind(exc) or "aborted", f"{context}{exc}")
