"""PostgreSQL under the store actor: an sqlite3-shaped connection over psycopg 3, and the dialect layer.

The store's transaction functions are written once, against the sqlite3 connection API and portable SQL
(`ON CONFLICT`, `RETURNING`, savepoints). `PgConnection` lets the same functions drive PostgreSQL from the
writer thread with psycopg's synchronous API (psycopg's async API is asyncio-only; issue 15): it rewrites
what is not portable (placeholders `?` → `%s`, `BEGIN IMMEDIATE` → `BEGIN`, `lastrowid` through an appended
`RETURNING`), reads text as bytes when the caller asks (`text_factory = bytes`), and raises every database
error as the sqlite3 exception class, with the SQLite result code, that the rest of the store already
understands. So `faults.storage_kind` types PostgreSQL's faults too: a serialization failure, deadlock or
lock timeout is `busy` (retryable), a lost connection `io` (retryable), a full disk `full`, a read-only
transaction or missing privilege `read_only`, corruption `corrupt`; the psycopg error is the `__cause__`.

Source: issue 15, "What to build" items 1 and 3 (epoch liveness lives in store/epochs.py).
"""

from __future__ import annotations

import functools
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg.adapt import Loader
from psycopg.pq import TransactionStatus
from psycopg.types.numeric import IntDumper

# Tables whose integer key PostgreSQL generates (identity columns): an INSERT into one without its own
# RETURNING gets `RETURNING <column>` appended, which is how `cursor.lastrowid` is answered.
_IDENTITY = {
    "participants": "id",
    "decisions": "id",
    "runs": "id",
    "task_review_runs": "id",
    "outcome_acks": "seq",
}
_INSERT = re.compile(r"^\s*INSERT\s+INTO\s+(\w+)", re.IGNORECASE)
# SQLite's `x IS ?` / `x IS NOT ?` compare NULL-safely with any value; PostgreSQL's IS takes NULL only.
_IS_PARAM = re.compile(r"\bIS\s+(NOT\s+)?\?", re.IGNORECASE)
# A parameter tested for NULL has no type the server could infer: it is cast to text (any scalar casts).
_PARAM_IS_NULL = re.compile(r"\?(\s+IS\s+(?:NOT\s+)?NULL)", re.IGNORECASE)


class Statement(NamedTuple):
    """A statement translated for PostgreSQL: its `text`, and the identity column appended as RETURNING
    for `lastrowid` (or None)."""

    text: str
    returning: str | None


@functools.lru_cache(maxsize=1024)
def translate(sql: str, has_params: bool = True) -> Statement:
    """`sql` (SQLite dialect, `?` placeholders) as PostgreSQL. `?` inside quoted literals is left alone; `%`
    is escaped when the statement goes with parameters (psycopg reads placeholders only then)."""
    if sql.strip().upper() == "BEGIN IMMEDIATE":
        return Statement("BEGIN", None)
    sql = _PARAM_IS_NULL.sub(r"CAST(? AS TEXT)\1", sql)
    sql = _IS_PARAM.sub(lambda m: "IS DISTINCT FROM ?" if m.group(1) else "IS NOT DISTINCT FROM ?", sql)
    out: list[str] = []
    quote: str | None = None
    for char in sql:
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "?":
            out.append("%s")
            continue
        out.append("%%" if char == "%" and has_params else char)
    text = "".join(out)
    returning = None
    match = _INSERT.match(text)
    if match is not None and "RETURNING" not in text.upper():
        returning = _IDENTITY.get(match.group(1).lower())
        if returning is not None:
            text = f"{text.rstrip().rstrip(';')} RETURNING {returning}"
    return Statement(text, returning)


class PgCursor:
    """The answered rows of one statement, shaped like a `sqlite3.Cursor` (fetchone, fetchall, iteration,
    rowcount, lastrowid). Rows are plain tuples."""

    __slots__ = ("_rows", "lastrowid", "rowcount")

    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int, lastrowid: int | None) -> None:
        self._rows = rows
        self.rowcount = rowcount
        self.lastrowid = lastrowid

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.fetchall())


class PgConnection:
    """A psycopg connection (autocommit; the writer issues BEGIN/SAVEPOINT/COMMIT itself) behind the part of
    the `sqlite3.Connection` API the store uses: `execute`, `executemany`, `in_transaction`,
    `text_factory`, `close`. Errors surface as sqlite3 exceptions carrying `sqlite_errorcode` (see the
    module docstring). `raw` is the psycopg connection, for PostgreSQL-only statements."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.text_factory: type = str

    @property
    def in_transaction(self) -> bool:
        """True inside a transaction, also one failed by an error (a savepoint rollback can still save it);
        False when idle or when the connection is gone."""
        return self.raw.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)

    @property
    def broken(self) -> bool:
        """The connection to the server is lost (closed, or its state unknown after a network error)."""
        return self.raw.closed or self.raw.info.transaction_status == TransactionStatus.UNKNOWN

    def execute(self, sql: str, params: Sequence[Any] = ()) -> PgCursor:
        text, returning = translate(sql, bool(params))
        try:
            cur = self.raw.execute(text, params or None)
            rows = cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            raise as_sqlite_error(exc) from exc
        if self.text_factory is bytes:
            rows = [tuple(v.encode() if isinstance(v, str) else v for v in row) for row in rows]
        lastrowid = None
        if returning is not None:
            lastrowid = int(rows[0][0]) if rows else None
            rows = []
        return PgCursor(rows, cur.rowcount, lastrowid)

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row `sql` answers (None when it answers no row)."""
        row = self.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> PgCursor:
        text, returning = translate(sql)
        if returning is not None:  # no lastrowid from executemany
            text = text[: text.rindex(" RETURNING ")]
        try:
            with self.raw.cursor() as cur:
                cur.executemany(text, list(seq))
                return PgCursor([], cur.rowcount, None)
        except psycopg.Error as exc:
            raise as_sqlite_error(exc) from exc

    def close(self) -> None:
        self.raw.close()


# SQLSTATE classes and codes → the SQLite primary result code whose StorageKind they are.
_CODES: dict[str, int] = {
    "40001": sqlite3.SQLITE_BUSY,  # serialization_failure
    "40P01": sqlite3.SQLITE_BUSY,  # deadlock_detected
    "55P03": sqlite3.SQLITE_BUSY,  # lock_not_available (lock_timeout)
    "57014": sqlite3.SQLITE_BUSY,  # query_canceled (statement_timeout)
    "53100": sqlite3.SQLITE_FULL,  # disk_full
    "53200": sqlite3.SQLITE_NOMEM,  # out_of_memory
    "53300": sqlite3.SQLITE_IOERR,  # too_many_connections
    "25006": sqlite3.SQLITE_READONLY,  # read_only_sql_transaction
    "42501": sqlite3.SQLITE_READONLY,  # insufficient_privilege
    "XX001": sqlite3.SQLITE_CORRUPT,  # data_corrupted
    "XX002": sqlite3.SQLITE_CORRUPT,  # index_corrupted
}
_CLASSES: dict[str, int] = {
    "08": sqlite3.SQLITE_IOERR,  # connection exception
    "57": sqlite3.SQLITE_IOERR,  # operator intervention (admin shutdown, crash shutdown)
    "58": sqlite3.SQLITE_IOERR,  # system error (I/O)
    "23": sqlite3.SQLITE_CONSTRAINT,  # integrity constraint violation
}


def as_sqlite_error(exc: psycopg.Error) -> sqlite3.Error:
    """The sqlite3 exception standing for psycopg's `exc`, with `sqlite_errorcode` set when it is a
    storage fault or a constraint: IntegrityError for class 23, OperationalError for faults, else
    DatabaseError. A psycopg error without SQLSTATE (the connection dropped) is an I/O fault. Chain it."""
    state = exc.sqlstate
    if state is None:
        code: int | None = sqlite3.SQLITE_IOERR if isinstance(exc, psycopg.OperationalError) else None
    else:
        code = _CODES.get(state, _CLASSES.get(state[:2]))
    cls: type[sqlite3.Error]
    if code == sqlite3.SQLITE_CONSTRAINT:
        cls = sqlite3.IntegrityError
    elif code is not None or isinstance(exc, psycopg.OperationalError):
        cls = sqlite3.OperationalError
    else:
        cls = sqlite3.DatabaseError
    error = cls(f"{exc} [postgresql sqlstate {state}]".strip())
    if code is not None:
        error.sqlite_errorcode = code
    return error


class _BoolAsInt(IntDumper):
    """The schema keeps SQLite's 0/1 integer flags; a Python bool is written as such an integer."""

    def dump(self, obj: Any) -> bytes:
        return b"1" if obj else b"0"


class _NumericLoader(Loader):
    """SUM() over integers is `numeric` in PostgreSQL; the store expects an int (as from SQLite)."""

    def load(self, data: Any) -> int | float:
        text = bytes(data).decode()
        return int(text) if text.lstrip("-").isdigit() else float(text)


# Client-side liveness (libpq): probe an idle connection after 2 s, every 1 s, give up after 3 probes; and
# give up on unacknowledged data after 5 s. Server side the same probes run on the session (set in
# `connect`), so a partitioned runtime's session (and its epoch lock) ends within PARTITION_BOUND seconds.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 2,
    "keepalives_interval": 1,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,  # milliseconds
}
_SESSION_SETTINGS = {
    "tcp_keepalives_idle": "2",
    "tcp_keepalives_interval": "1",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "5000",
    # The writer pings at least every HEARTBEAT seconds (store/writer.py), so a session idle longer than
    # this is a runtime that stopped: the server ends it and frees its epoch lock.
    "idle_session_timeout": "10000",
    # A writer is never idle inside its own transaction (a request is plain code): one that is was frozen.
    "idle_in_transaction_session_timeout": "10000",
}
PARTITION_BOUND = 10.0
"""Seconds after which the server has ended the session of a runtime cut off from it (keepalives: 2 s idle
+ 3 x 1 s probes, tcp_user_timeout 5 s, idle_session_timeout 10 s), freeing its epoch lock (issue 15)."""


def connect(url: str, *, connect_timeout: float = 10.0, lock_timeout: float = 5.0) -> PgConnection:
    """Open an autocommit psycopg connection to `url` with the keepalive settings above, typed for the store.

    `lock_timeout` is how many seconds a statement waits for a lock (a task's, a row's) before it fails with
    55P03, which the store reports as `StorageError` kind busy: SQLite's busy timeout, on PostgreSQL.

    Raises:
        sqlite3.OperationalError: the server cannot be reached (code SQLITE_IOERR), the psycopg error chained.
    """
    try:
        raw = psycopg.connect(
            url, autocommit=True, connect_timeout=max(1, round(connect_timeout)), **KEEPALIVES
        )
    except psycopg.Error as exc:
        raise as_sqlite_error(exc) from exc
    raw.adapters.register_dumper(bool, _BoolAsInt)
    raw.adapters.register_loader("numeric", _NumericLoader)
    conn = PgConnection(raw)
    settings = _SESSION_SETTINGS | {"lock_timeout": str(max(1, round(lock_timeout * 1000)))}
    for name, value in settings.items():
        conn.execute(f"SET {name} = {value}")
    return conn
