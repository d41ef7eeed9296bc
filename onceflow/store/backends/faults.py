"""Storage faults: which database errors they are, and which of them end the transaction. Pure: asked on
the writer thread.

On SQLite a fault is a sqlite3 error, typed here by its result code. On PostgreSQL the connection types it
itself (store/backends/postgres.py owns the table from SQLSTATE to `StorageKind`) and raises it as a
`DatabaseFault`, a `StorageError` of its kind with the psycopg error chained; anything else PostgreSQL
reports (a constraint violation, an SQL error) stays the psycopg error. The rules below hold on both.

SQLite may roll a whole transaction back on SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM or SQLITE_CORRUPT (its
"Response To Errors Within A Transaction"); `max_page_count` hitting its cap does. Writes issued after that
would run in autocommit mode, each committed on its own while the request is reported as failed. So code
that catches a database error and carries on must first ask `fails_request` (which includes
`ends_transaction`) and re-raise when it says so, and the writer fails the whole request, and every request
of its batch, once the transaction is gone.
"""

from __future__ import annotations

import sqlite3
import sys

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


class DatabaseFault(StorageError):
    """A storage fault the database reported, typed by its connection (PostgreSQL's SQLSTATE, or the
    transaction found gone inside a savepoint): a `StorageError` of `kind` whose `detail` is the database's
    message. The driver's error, if any, is chained as `__cause__`."""

    def __init__(self, kind: StorageKind, detail: str) -> None:
        super().__init__(kind, detail)
        self.detail = detail


# Kinds after which the transaction must not go on: SQLite's codes below, as every backend reports them.
_ENDING_KINDS: frozenset[StorageKind] = frozenset({"full", "io", "out_of_memory", "corrupt"})

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
    """The `StorageKind` of a database error that reports a storage fault (a `DatabaseFault`, a sqlite3 error
    of a fault's code); None for anything else (a constraint violation, an SQL error, our own code's)."""
    if isinstance(exc, StorageError):
        return exc.kind
    code = primary_code(exc)
    return None if code is None else _KINDS.get(code)


def ends_transaction(conn: Connection, exc: BaseException) -> bool:
    """Whether the transaction on `conn` is over after `exc`: SQLite already left it (`in_transaction` is
    False), or `exc` is SQLITE_FULL, IOERR, NOMEM, CORRUPT or NOTADB, after which nothing may continue.

    Every handler that catches a database error inside a transaction and continues must re-raise when this
    is True: writes after it would each commit on their own while the request is reported as failed.
    """
    if isinstance(exc, StorageError):
        return not conn.in_transaction or exc.kind in _ENDING_KINDS
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
    no storage fault). `context` prefixes the detail (why this request failed). Chain it `from exc`. A
    `DatabaseFault` is its own `StorageError` when neither another kind nor a context is asked for."""
    if isinstance(exc, DatabaseFault):
        if not context and kind in (None, exc.kind):
            return exc
        return StorageError(kind or exc.kind, f"{context}{exc.detail}")
    return StorageError(kind or storage_kind(exc) or "aborted", f"{context}{exc}")


def database_errors(conn: object) -> tuple[type[Exception], ...]:
    """The exceptions a database error on `conn` may be (`PgConnection.errors`: psycopg's and
    `DatabaseFault`; else sqlite3's): what a handler that carries on after one catches."""
    errors: tuple[type[Exception], ...] = getattr(conn, "errors", _SQLITE_ERRORS)
    return errors


_SQLITE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, DatabaseFault)


def any_database_errors(*more: type[Exception]) -> tuple[type[Exception], ...]:
    """What a database error of either backend may be, for a handler with no connection at hand (the CLI),
    and `more`: sqlite3's, `DatabaseFault`, and psycopg's once psycopg is loaded (a PostgreSQL connection was
    opened; a SQLite-only process never imports it)."""
    psycopg = sys.modules.get("psycopg")
    driver: tuple[type[Exception], ...] = () if psycopg is None else (psycopg.Error,)
    return (*_SQLITE_ERRORS, *driver, *more)


def is_constraint_violation(exc: BaseException) -> bool:
    """Whether `exc` is a constraint's violation (a UNIQUE, a foreign key, a NOT NULL) on either backend:
    sqlite3's IntegrityError, or PostgreSQL's SQLSTATE class 23."""
    if isinstance(exc, sqlite3.IntegrityError):
        return True
    state = getattr(exc, "sqlstate", None)
    return isinstance(state, str) and state.startswith("23")
