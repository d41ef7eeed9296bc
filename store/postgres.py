"""PostgreSQL under the store actor: an sqlite3-shaped connection over psycopg 3, and the dialect layer.

The store's transaction functions are written once, against the sqlite3 connection API and portable SQL
(`ON CONFLICT`, `RETURNING`, savepoints). `PgConnection` lets the same functions drive PostgreSQL from the
writer thread with psycopg's synchronous API (psycopg's async API is asyncio-only): it rewrites what is not
portable (placeholders `?` and numbered `?NNN` → `%s`, `BEGIN IMMEDIATE` → `BEGIN`, `lastrowid` through an
appended `RETURNING`, `json_each(?)` → `json_array_elements(_text)`, `CROSS JOIN ... ON` → `JOIN ... ON`),
reads text as bytes when the caller asks (`text_factory = bytes`), and raises every database error as the
sqlite3 exception class, with the SQLite result code, that the rest of the store already understands. So
`faults.storage_kind` types PostgreSQL's faults too: a serialization failure, deadlock or lock timeout is
`busy` (retryable), a lost connection `io` (retryable), a full disk `full`, a read-only transaction or missing
privilege `read_only`, corruption `corrupt`; the psycopg error is the `__cause__`.

The writer runs each group-commit transaction `pipelined` (psycopg's pipeline mode): statements go out
without waiting, and a round trip is paid only where an answer is read, so a batch is not round-trip bound.

Epoch liveness lives in store/epochs.py.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

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


# SQLite's json_each(?) over a JSON array: PostgreSQL's json_array_elements when the statement reads into the
# elements (`value ->> n`), else json_array_elements_text (scalars compared as text); `key` is the 0-based
# index, as in SQLite.
_JSON_EACH = re.compile(r"\bjson_each\((\?\d*)\)(?=(\s+AS\b)?)", re.IGNORECASE)
# SQLite accepts `CROSS JOIN t ON ...` (CROSS fixes its join order); PostgreSQL's CROSS JOIN takes no ON.
_CROSS_JOIN_ON = re.compile(r"\bCROSS\s+JOIN\s+(\w+(?:\s+AS\s+\w+)?)\s+ON\b", re.IGNORECASE)


class Statement(NamedTuple):
    """A statement translated for PostgreSQL: its `text`, the identity column appended as RETURNING for
    `lastrowid` (or None), and, when the SQLite text numbers its parameters (`?1`, `?2`), the 0-based index
    of the caller's parameter for each `%s` in order (`params_for` applies it; None: in the caller's
    order)."""

    text: str
    returning: str | None
    order: tuple[int, ...] | None = None

    def params_for(self, params: Sequence[Any]) -> Sequence[Any]:
        """The parameters as PostgreSQL takes them: one per `%s`, a numbered one repeated where reused."""
        return params if self.order is None else [params[i] for i in self.order]


@functools.lru_cache(maxsize=1024)
def translate(sql: str, has_params: bool = True) -> Statement:
    """`sql` (SQLite dialect, `?` or `?NNN` placeholders) as PostgreSQL. `?` inside quoted literals is left
    alone; `%` is escaped when the statement goes with parameters (psycopg reads placeholders only then).
    A bare `?` after numbered ones is the next number, as in SQLite."""
    if sql.strip().upper() == "BEGIN IMMEDIATE":
        return Statement("BEGIN", None)
    sql = _PARAM_IS_NULL.sub(r"CAST(? AS TEXT)\1", sql)
    sql = _IS_PARAM.sub(lambda m: "IS DISTINCT FROM ?" if m.group(1) else "IS NOT DISTINCT FROM ?", sql)
    each = "json_array_elements" if "->>" in sql else "json_array_elements_text"
    sql = _JSON_EACH.sub(
        lambda m: (
            f"(SELECT value, ordinality - 1 AS key FROM {each}(CAST({m.group(1)} AS json))"
            " WITH ORDINALITY AS _each (value, ordinality))" + ("" if m.group(2) else " AS _each")
        ),
        sql,
    )
    sql = _CROSS_JOIN_ON.sub(r"JOIN \1 ON", sql)
    out: list[str] = []
    order: list[int] = []
    numbered = False
    quote: str | None = None
    index = 0
    while index < len(sql):
        char = sql[index]
        index += 1
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "?":
            digits = re.match(r"\d*", sql[index:])
            assert digits is not None
            if digits.group():
                numbered = True
                order.append(int(digits.group()) - 1)
                index += len(digits.group())
            else:
                order.append(max(order, default=-1) + 1)
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
    return Statement(text, returning, tuple(order) if numbered else None)


class PgCursor:
    """The answer of one statement, shaped like a `sqlite3.Cursor` (fetchone, fetchall, iteration, rowcount,
    lastrowid). Rows are plain tuples. Inside `PgConnection.pipelined` the answer is read from the server
    only when first asked for (one round trip, which also settles every statement sent before it), and a
    database error of this statement, or of an earlier unsettled one, is raised then."""

    __slots__ = ("_conn", "_cur", "_lastrowid", "_returning", "_rowcount", "_rows")

    def __init__(self, conn: PgConnection, cur: psycopg.Cursor[Any] | None, returning: str | None) -> None:
        self._conn = conn
        self._cur: psycopg.Cursor[Any] | None = cur
        self._returning = returning
        self._rows: list[tuple[Any, ...]] = []
        self._rowcount = -1
        self._lastrowid: int | None = None

    def _answer(self) -> None:
        """Read this statement's answer (once) from its psycopg cursor; raises its error as sqlite3's."""
        cur, self._cur = self._cur, None
        if cur is None:
            return
        rows = self._conn._fetch(self, cur)
        if self._conn.text_factory is bytes:
            rows = [tuple(v.encode() if isinstance(v, str) else v for v in row) for row in rows]
        if self._returning is not None:
            self._lastrowid = int(rows[0][0]) if rows else None
            rows = []
        self._rows, self._rowcount = rows, cur.rowcount

    @property
    def rowcount(self) -> int:
        self._answer()
        return self._rowcount

    @property
    def lastrowid(self) -> int | None:
        self._answer()
        return self._lastrowid

    def fetchone(self) -> tuple[Any, ...] | None:
        self._answer()
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        self._answer()
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.fetchall())


_CONTROL = re.compile(r"^\s*(BEGIN|SAVEPOINT|RELEASE|ROLLBACK\s+TO|ROLLBACK|COMMIT)\b\s*(\w*)", re.IGNORECASE)


class PgConnection:
    """A psycopg connection (autocommit; the writer issues BEGIN/SAVEPOINT/COMMIT itself) behind the part of
    the `sqlite3.Connection` API the store uses: `execute`, `executemany`, `in_transaction`,
    `text_factory`, `close`. Errors surface as sqlite3 exceptions carrying `sqlite_errorcode` (see the
    module docstring). `raw` is the psycopg connection, for PostgreSQL-only statements. `round_trips`
    counts the waits for the server's answer."""

    dialect: ClassVar[str] = "postgresql"
    """What store code that must tell the backends apart reads (`urls.on_postgres`)."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.text_factory: type = str
        self.round_trips = 0
        self._pipeline: contextlib.AbstractContextManager[psycopg.Pipeline] | None = None  # while pipelined
        self._unsettled: list[PgCursor] = []  # pipelined data statements nobody has read the answer of yet
        self._open = False  # pipelined: BEGIN sent, no COMMIT or ROLLBACK yet

    @property
    def in_transaction(self) -> bool:
        """True inside a transaction, also one failed by an error (a savepoint rollback can still save it);
        False when idle or when the connection is gone. Pipelined, the server reports its state only at a
        sync, so this follows the BEGIN/COMMIT/ROLLBACK sent."""
        if self._pipeline is not None:
            return self._open and not self.broken
        return self.raw.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)

    @property
    def broken(self) -> bool:
        """The connection to the server is lost (closed, or its state unknown after a network error)."""
        return self.raw.closed or self.raw.info.transaction_status == TransactionStatus.UNKNOWN

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[None]:
        """Within the block, statements are sent in psycopg's pipeline mode without waiting for their
        answers: a round trip is paid only where the caller reads one (rows, rowcount, lastrowid), at
        SAVEPOINT / RELEASE after an unread statement (so an error is raised inside the savepoint that
        issued it, as on SQLite), at `settle`, and at COMMIT, which ends the pipeline. Leaving the block
        by an exception drains the pipeline quietly (the exception propagates)."""
        self._enter()
        try:
            yield
        finally:
            if self._pipeline is not None:
                with contextlib.suppress(psycopg.Error, sqlite3.Error):
                    self._leave()

    def settle(self) -> None:
        """Wait for every pipelined statement not read yet (no round trip when there is none).

        Raises:
            sqlite3.Error: the first of them that failed (the pipeline is usable again afterwards).
        """
        if self._unsettled:
            self._unsettled[-1]._answer()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> PgCursor:
        statement = translate(sql, bool(params))
        args = statement.params_for(params) if params else None
        if self._pipeline is None:
            return self._now(statement.text, args, statement.returning)
        control = _CONTROL.match(statement.text)
        if control is None:
            cursor = self._send(statement.text, args, statement.returning)
            self._unsettled.append(cursor)
            return cursor
        verb = control.group(1).upper().split()[0]
        if verb == "ROLLBACK":  # an error of the statements it undoes no longer matters
            with contextlib.suppress(sqlite3.Error):
                self.settle()
        elif verb == "RELEASE":
            try:
                self.settle()
            except sqlite3.Error:  # the block failed after all: undo it, as the savepoint would have
                if self._pipeline is not None:  # (else the connection is gone, and the savepoint with it)
                    name = control.group(2)
                    self._send(f"ROLLBACK TO {name}", None, None)
                    self._send(f"RELEASE {name}", None, None)
                raise
        elif verb == "SAVEPOINT":  # an earlier statement's error belongs to the enclosing block
            self.settle()
        if verb == "BEGIN":
            self._open = True
        elif verb in ("COMMIT", "ROLLBACK") and "TO" not in statement.text.upper():
            self._open = False
        cursor = self._send(statement.text, args, None)
        if verb == "COMMIT":  # its answer comes with the pipeline's closing sync: one round trip
            self._leave()
        return cursor

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row `sql` answers (None when it answers no row)."""
        row = self.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> PgCursor:
        if self._pipeline is not None:  # each row pipelined like `execute`, all answered by one wait
            cursors = [self.execute(sql, params) for params in seq]
            self.settle()
            total = PgCursor(self, None, None)
            total._rowcount = sum(max(cursor.rowcount, 0) for cursor in cursors)
            return total
        statement = translate(sql)
        text = statement.text
        if statement.returning is not None:  # no lastrowid from executemany
            text = text[: text.rindex(" RETURNING ")]
        try:
            cur = self.raw.cursor()
            cur.executemany(text, [statement.params_for(params) for params in seq])
            self._waited()
        except psycopg.Error as exc:
            raise as_sqlite_error(exc) from exc
        answered = PgCursor(self, None, None)
        answered._rowcount = cur.rowcount
        return answered

    def close(self) -> None:
        self.raw.close()

    total_round_trips: ClassVar[int] = 0
    """Round trips of every connection of this process (bench/multi_runtime.py reports them per entry)."""

    def _waited(self) -> None:
        self.round_trips += 1
        PgConnection.total_round_trips += 1

    # --- internals ---------------------------------------------------------------------------------------

    def _now(self, text: str, args: Sequence[Any] | None, returning: str | None) -> PgCursor:
        try:
            cur = self.raw.execute(text, args)
        except psycopg.Error as exc:
            raise as_sqlite_error(exc) from exc
        self._waited()
        cursor = PgCursor(self, cur, returning)
        cursor._answer()
        return cursor

    def _send(self, text: str, args: Sequence[Any] | None, returning: str | None) -> PgCursor:
        try:
            cur = self.raw.cursor()
            cur.execute(text, args)
        except psycopg.Error as exc:
            self._recover()
            raise as_sqlite_error(exc) from exc
        return PgCursor(self, cur, returning)

    def _fetch(self, cursor: PgCursor, cur: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
        """The rows of `cursor`'s psycopg `cur` (empty for a command), waiting for them if pipelined."""
        if self._pipeline is not None:
            position = next((i for i, c in enumerate(self._unsettled) if c is cursor), -1)
            if position >= 0:  # answers come in order: those sent before it arrive with it
                self._waited()
                del self._unsettled[: position + 1]
        try:
            if cur.description is None and self._pipeline is None:
                return []
            try:
                return list(cur.fetchall())
            except psycopg.ProgrammingError as exc:
                if exc.sqlstate is not None:
                    raise
                return []  # a command: its answer has arrived and carries no rows
        except psycopg.Error as exc:
            self._recover()
            raise as_sqlite_error(exc) from exc

    def _enter(self) -> None:
        self._pipeline = self.raw.pipeline()
        self._pipeline.__enter__()

    def _leave(self) -> None:
        """Close the pipeline: one sync (a round trip) answering everything sent.

        Raises:
            sqlite3.Error: the first statement that failed among those not read yet."""
        pipeline, self._pipeline = self._pipeline, None
        self._unsettled = []
        if pipeline is None:
            return
        self._waited()
        try:
            pipeline.__exit__(None, None, None)
        except psycopg.Error as exc:
            raise as_sqlite_error(exc) from exc

    def _recover(self) -> None:
        """After a pipelined statement failed: drain what the server skipped and start a fresh pipeline, so
        a ROLLBACK TO can follow (the server ignores everything up to the next sync)."""
        if self._pipeline is None:
            return
        with contextlib.suppress(psycopg.Error, sqlite3.Error):
            self._leave()
        if not self.broken:
            self._enter()


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
+ 3 x 1 s probes, tcp_user_timeout 5 s, idle_session_timeout 10 s), freeing its epoch lock."""


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
