"""PostgreSQL under the store actor: a connection over psycopg 3 with the API the store's functions use, and
the table from PostgreSQL's errors to the store's typed storage faults.

The store's transaction functions are written once against that API (store/backends/connection.py), in
SQL that is the same on both backends except where `dialect.Dialect` says otherwise: those statements are
written in both forms side by side (store/backends/dialect.py), so nothing in a statement is rewritten here.
`PgConnection` drives them from the writer thread with psycopg's synchronous API (psycopg's async API is
asyncio-only). The one thing it maps is the parameter style (`statement_of`): SQLite's `?` and numbered `?NNN`
placeholders become psycopg's `%s`, with the caller's parameters picked by number, once per statement text
(cached). It reads text as bytes when the caller asks (`text_factory = bytes`).

Errors are typed here, not translated: `FAULTS` is the one table from SQLSTATE (a code, else its class) to
`StorageKind`, and an error it maps is raised as `faults.DatabaseFault` of that kind, a `StorageError`, with
the psycopg error as its `__cause__`: a serialization failure, deadlock, lock or statement timeout is `busy`
(retryable), a lost connection or a server shut down, crashed or starting up `io` (retryable), a full disk
`full`, an exhausted server `out_of_memory`, a read-only transaction or missing privilege `read_only`,
corruption `corrupt`, a transaction the server ended for another reason `aborted`. Any other error (a
constraint violation, SQLSTATE class 23; an SQL error, our own bug) is raised as psycopg's own.

The table also says what the connection needs afterwards (`Remedy`), which the connection records
(`PgConnection.remedy`) and the writer applies before its next transaction: nothing beyond the
transaction's rollback; a reset of a session that survived (`PgConnection.reset`); a new session once one
would be writable, for a session that may be read-only for good; or a new connection, and with it a new
epoch, for a session that is gone or cannot be trusted.

The writer runs each group-commit transaction `pipelined` (psycopg's pipeline mode): statements go out
without waiting, and a round trip is paid only where an answer is read, so a batch is not round-trip bound.
After an error in a pipeline the server skips every statement up to the next sync, among them, possibly, the
PREPARE of a statement psycopg then believes prepared (its automatic prepared statements): the next use of
that statement would fail with "prepared statement does not exist" (26000) for the rest of the session. So
after any error in a pipeline the connection forgets psycopg's prepared statements (later ones are prepared
afresh, under new names) and its reset deallocates the server's before the next transaction.

Epoch liveness lives in store/backends/epochs.py.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple, NoReturn

import psycopg
from psycopg.adapt import Loader
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.types.numeric import IntDumper

from onceflow.protocol.errors import StorageError, StorageKind
from onceflow.store.backends import pg_stats
from onceflow.store.backends.dialect import POSTGRES, Dialect
from onceflow.store.backends.faults import DatabaseFault

# Transaction control the pipelined connection handles itself: the first word(s) of such a statement.
_CONTROL = frozenset({"BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "COMMIT"})


class Statement(NamedTuple):
    """A statement as psycopg takes it: its `text` (`%s` placeholders), when the SQL numbers its parameters
    (`?1`, `?2`), the 0-based index of the caller's parameter for each `%s` in order (`params_for` applies
    it; None: in the caller's order); `prepare` False for a statement the server plans at every execution;
    `control` its verb (BEGIN, SAVEPOINT, RELEASE, ROLLBACK, ROLLBACK TO, COMMIT) and savepoint name for
    transaction control, else None.

    Prepared statements are used deliberately: psycopg prepares a statement at its fifth use, and the server
    then settles on a generic plan after five more, kept until its tables' statistics change. That is the
    plan planning afresh would give when no parameter's value moves the estimates: a statement of one row
    (a key's lookup, a row's insert), and a set-based one over a JSON array (`Dialect.json_rows`: a writer
    batch's rows, a recovery group's), whose rows PostgreSQL estimates at 100 whatever the array holds. A
    statement matching a PostgreSQL array (`= ANY(?)`) is planned for its array at every execution: its
    length and values are what the estimates rest on, and a generic plan made when the batch's tables were
    young (a scan of every open run through another partial index, for a batch's leave) would be kept as
    they grow. Measured interleaved (`bench/multi_runtime.py`'s workload): every set-based statement planned
    afresh cost ~50 µs of server CPU an entry more than this; every one prepared, ~65 µs more."""

    text: str
    order: tuple[int, ...] | None = None
    prepare: bool = True
    control: tuple[str, str] | None = None

    def params_for(self, params: Sequence[Any]) -> Sequence[Any]:
        """The parameters as PostgreSQL takes them: one per `%s`, a numbered one repeated where reused."""
        return params if self.order is None else [params[i] for i in self.order]


@functools.lru_cache(maxsize=2048)
def statement_of(sql: str, has_params: bool = True) -> Statement:
    """`sql` in psycopg's parameter style: `?` and `?NNN` placeholders become `%s` (a bare `?` after
    numbered ones is the next number, as in SQLite); `?` inside quoted literals is left alone; `%` is
    escaped when the statement goes with parameters (psycopg reads placeholders only then). Nothing else
    of the text changes: a statement SQLite alone understands fails on the server, as any SQL error."""
    out: list[str] = []
    order: list[int] = []
    numbered = False
    quote: str | None = None
    index, size = 0, len(sql)
    while index < size:
        char = sql[index]
        index += 1
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "?":
            end = index
            while end < size and sql[end].isdigit():
                end += 1
            if end > index:
                numbered = True
                order.append(int(sql[index:end]) - 1)
                index = end
            else:
                order.append(max(order, default=-1) + 1)
            out.append("%s")
            continue
        out.append("%%" if char == "%" and has_params else char)
    text = "".join(out)
    words = text.split(None, 2)
    control = None
    if words and words[0].upper() in _CONTROL:
        verb = words[0].upper()
        rest = words[1:]
        if verb == "ROLLBACK" and rest and rest[0].upper() == "TO":
            verb, rest = "ROLLBACK TO", text.split()[2:]
        control = (verb, rest[0] if rest and verb in ("SAVEPOINT", "RELEASE", "ROLLBACK TO") else "")
    # Numbered parameters pick the caller's by index; a statement naming none (its time read from the
    # server's clock, store/backends/clock.py) sends none of them.
    return Statement(
        text, tuple(order) if numbered or not order else None, "ANY(" not in text.upper(), control
    )


class PgCursor:
    """The answer of one statement (`connection.Cursor`: fetchone, fetchall, iteration, rowcount). Rows are
    plain tuples. Inside `PgConnection.pipelined` the answer is read from the server only when first asked
    for (one round trip, which also settles every statement sent before it), and a database error of this
    statement, or of an earlier unsettled one, is raised then."""

    __slots__ = ("_conn", "_cur", "_rowcount", "_rows")

    def __init__(self, conn: PgConnection, cur: psycopg.Cursor[Any] | None) -> None:
        self._conn = conn
        self._cur: psycopg.Cursor[Any] | None = cur
        self._rows: list[tuple[Any, ...]] = []
        self._rowcount = -1

    def _answer(self) -> None:
        """Read this statement's answer (once) from its psycopg cursor; raises its error, typed
        (`PgConnection._fault`)."""
        cur, self._cur = self._cur, None
        if cur is None:
            return
        rows = self._conn._fetch(self, cur)
        if self._conn.text_factory is bytes:
            rows = [tuple(v.encode() if isinstance(v, str) else v for v in row) for row in rows]
        self._rows, self._rowcount = rows, cur.rowcount

    @property
    def rowcount(self) -> int:
        self._answer()
        return self._rowcount

    def fetchone(self) -> tuple[Any, ...] | None:
        self._answer()
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        self._answer()
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.fetchall())


class Remedy(enum.IntEnum):
    """What a connection needs after a fault before it serves another transaction. The connection records it
    (`PgConnection.remedy`); the writer applies it between transactions."""

    NONE = 0
    """The transaction's own rollback is enough."""
    RESET = 1
    """The session survives, but not in the state psycopg believes (its prepared statements), or it is
    left inside a transaction: `PgConnection.reset` brings it back, its epoch lock kept."""
    RENEW = 2
    """The session works but may be fixed in a state only a new session leaves: read-only by a per-database
    or per-role default, which a session reads when it starts. It is kept (with its epoch) until a new
    session would be writable, and then replaced by that one, under a new epoch."""
    REPLACE = 3
    """The session is gone or cannot be trusted: the connection is closed at once, and the writer connects
    again, under a new epoch (the old one died with the session)."""


class Fault(NamedTuple):
    """What a PostgreSQL error is: its `kind` of storage fault and the `remedy` its connection needs."""

    kind: StorageKind
    remedy: Remedy


FAULTS: dict[str, Fault] = {
    # Class 08, connection exception: the connection failed, broke or was refused.
    "08": Fault("io", Remedy.REPLACE),
    # Class 57, operator intervention: 57P01 admin_shutdown (a fast or immediate shutdown, or
    # pg_terminate_backend), 57P02 crash_shutdown (another server process crashed), 57P03
    # cannot_connect_now (starting up, in recovery), 57P04 database_dropped, 57P05 idle_session_timeout.
    # The session is over.
    "57": Fault("io", Remedy.REPLACE),
    "57014": Fault("busy", Remedy.NONE),  # query_canceled: statement_timeout, or pg_cancel_backend
    # Class 40, transaction rollback: the server ended the transaction.
    "40": Fault("aborted", Remedy.NONE),
    "40001": Fault("busy", Remedy.NONE),  # serialization_failure (also a standby's recovery conflict)
    "40P01": Fault("busy", Remedy.NONE),  # deadlock_detected
    "55P03": Fault("busy", Remedy.NONE),  # lock_not_available: lock_timeout, the store's busy timeout
    # Class 53, insufficient resources.
    "53": Fault("out_of_memory", Remedy.NONE),
    "53100": Fault("full", Remedy.NONE),  # disk_full
    "53200": Fault("out_of_memory", Remedy.NONE),  # out_of_memory, also "out of shared memory"
    "53300": Fault("io", Remedy.REPLACE),  # too_many_connections: refused at connect
    # Class 58, system error: the server's own file I/O failed (58030 io_error, 58P01 undefined_file).
    "58": Fault("io", Remedy.NONE),
    # read_only_sql_transaction: a server in recovery, or default_transaction_read_only. A session reads the
    # per-database and per-role settings only when it starts, so only a new one may see them lifted.
    "25006": Fault("read_only", Remedy.RENEW),
    "25P02": Fault("aborted", Remedy.NONE),  # in_failed_sql_transaction: an earlier error ended it
    "25P03": Fault("io", Remedy.REPLACE),  # idle_in_transaction_session_timeout: the session is over
    "25P04": Fault("io", Remedy.REPLACE),  # transaction_timeout: the session is over
    # invalid_sql_statement_name: a prepared statement psycopg uses is gone from the server.
    "26000": Fault("aborted", Remedy.RESET),
    "42501": Fault("read_only", Remedy.NONE),  # insufficient_privilege: takes effect in running sessions
    # Class 28, invalid authorization specification (at connect): the role or its password.
    "28": Fault("read_only", Remedy.REPLACE),
    "3D000": Fault("io", Remedy.REPLACE),  # invalid_catalog_name: the database is gone (at connect)
    "72000": Fault("aborted", Remedy.NONE),  # snapshot_too_old
    # Class XX, internal error: XX000 is what the server reports without a code (a file it could not
    # extend past a size limit, a cache lookup that failed).
    "XX": Fault("aborted", Remedy.NONE),
    "XX001": Fault("corrupt", Remedy.NONE),  # data_corrupted
    "XX002": Fault("corrupt", Remedy.NONE),  # index_corrupted
}
"""The one table from SQLSTATE to storage fault: a code's own entry, else its class's (the first two
characters). An error without SQLSTATE is psycopg's own: a pipeline aborted by an earlier statement's error
is `aborted`; any other `psycopg.OperationalError` (the connection closed, lost, timed out, or left in a
state it cannot leave) is `io` with REPLACE (`fault_of`). Class 23 (integrity constraint) is no storage
fault: it stays psycopg's `IntegrityError` (`faults.is_constraint_violation`). Anything else (an SQL or
data error) is our own bug and stays untyped."""

_LOST = Fault("io", Remedy.REPLACE)  # a connection gone, whatever the error that told of it


def fault_of(exc: psycopg.Error) -> Fault | None:
    """The storage fault psycopg's `exc` reports (`FAULTS`), or None when it reports none."""
    state = exc.sqlstate
    if state is not None:
        return FAULTS.get(state) or FAULTS.get(state[:2])
    if isinstance(exc, psycopg.errors.PipelineAborted):
        return Fault("aborted", Remedy.NONE)
    if isinstance(exc, psycopg.OperationalError):
        return _LOST
    return None


def typed(exc: psycopg.Error, fault: Fault | None = None) -> Exception:
    """What the store sees of psycopg's `exc`: for a storage fault (`fault`, else `fault_of(exc)`) a
    `faults.DatabaseFault` of its kind, its detail the server's message and SQLSTATE; else `exc` itself.
    Raise it chained from `exc` (`_raise`)."""
    fault = fault or fault_of(exc)
    if fault is None:
        return exc
    return DatabaseFault(fault.kind, f"{exc} [postgresql sqlstate {exc.sqlstate}]".strip())


def _raise(exc: psycopg.Error, error: Exception) -> NoReturn:
    """Raise `error`, what the store sees of `exc` (`typed`), chained from it (or `exc` itself, as it is)."""
    if error is exc:
        raise exc
    raise error from exc


class PgConnection:
    """A psycopg connection (autocommit; the writer issues BEGIN/SAVEPOINT/COMMIT itself) behind the API the
    store uses (store/backends/connection.py): `execute`, `executemany`, `in_transaction`, `text_factory`,
    `close`. A storage fault is raised as `faults.DatabaseFault`, any other error as psycopg's (`typed`);
    after one, `remedy` says what the connection needs before its next transaction.
    `raw` is the psycopg connection, for PostgreSQL-only statements. `round_trips` counts the waits for the
    server's answer."""

    dialect: ClassVar[Dialect] = POSTGRES
    """What store code that must tell the backends apart reads (`dialect.dialect_of`, `urls.on_postgres`)."""

    errors: ClassVar[tuple[type[Exception], ...]] = (psycopg.Error, StorageError)
    """What an error raised by this connection may be (`faults.database_errors`)."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.text_factory: type = str
        self.round_trips = 0
        self._pipeline: contextlib.AbstractContextManager[psycopg.Pipeline] | None = None  # while pipelined
        self._unsettled: list[PgCursor] = []  # pipelined data statements nobody has read the answer of yet
        self._open = False  # pipelined: BEGIN sent, no COMMIT or ROLLBACK yet
        self._dirty = False  # a fault called for RESET since the last reset
        self._renew = False  # a fault called for RENEW (cleared only by replacing the connection)
        self._statistics = pg_stats.Keeper(self._maintain)  # young tables' first ANALYZE

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

    @property
    def remedy(self) -> Remedy:
        """What the connection needs before it serves another transaction, read between transactions: REPLACE
        once it is lost (a fault calling for REPLACE closes it); else RENEW after a fault that called for it;
        else RESET when `reset_needed`; else NONE."""
        if self.broken:
            return Remedy.REPLACE
        if self._renew:
            return Remedy.RENEW
        return Remedy.RESET if self.reset_needed else Remedy.NONE

    @property
    def reset_needed(self) -> bool:
        """Whether `reset` must run before the next transaction: a fault called for it (every error in a
        pipeline does), or the connection is left inside a transaction or a pipeline."""
        return (
            self._dirty
            or self._pipeline is not None
            or self.raw.info.transaction_status != TransactionStatus.IDLE
        )

    def reset(self) -> None:
        """Bring a session that survived a fault back to a clean idle state, its epoch lock kept: leave the
        pipeline, roll back what is left of a transaction, deallocate every prepared statement on the
        server and forget psycopg's record of them. `reset_needed` is False afterwards.

        Raises:
            DatabaseFault: the session could not be reset (the connection must be replaced).
        """
        if self._pipeline is not None:
            with contextlib.suppress(*PgConnection.errors):
                self._leave()
        self._forget_prepared()
        try:
            if self.raw.info.transaction_status != TransactionStatus.IDLE:
                self.raw.execute("ROLLBACK", prepare=False)
            self.raw.execute("DEALLOCATE ALL", prepare=False)
        except psycopg.Error as exc:
            self._raise(exc, pipelined=False)
        self._dirty = False

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[None]:
        """Within the block, statements are sent in psycopg's pipeline mode without waiting for their
        answers: a round trip is paid only where the caller reads one (rows, rowcount), at
        SAVEPOINT / RELEASE after an unread statement (so an error is raised inside the savepoint that
        issued it, as on SQLite), at `settle`, and at COMMIT, which ends the pipeline. Leaving the block
        by an exception drains the pipeline quietly (the exception propagates).

        Raises:
            DatabaseFault: the pipeline cannot be entered (the connection is closed: an `io` fault).
        """
        self._open = False
        self._enter()
        try:
            yield
        finally:
            if self._pipeline is not None:
                with contextlib.suppress(*PgConnection.errors):
                    self._leave()

    def settle(self) -> None:
        """Wait for every pipelined statement not read yet (no round trip when there is none).

        Raises:
            DatabaseFault, psycopg.Error: the first of them that failed (the pipeline is usable again
                afterwards).
        """
        if self._unsettled:
            self._unsettled[-1]._answer()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> PgCursor:
        PgConnection.total_statements += 1
        statement = statement_of(sql, bool(params))
        args = statement.params_for(params) if params else None
        if self._pipeline is None:
            return self._now(statement, args)
        control = statement.control
        if control is None:
            cursor = self._send(statement.text, args, statement.prepare)
            self._unsettled.append(cursor)
            return cursor
        verb, name = control
        if verb in ("ROLLBACK", "ROLLBACK TO"):  # an error of the statements it undoes no longer matters
            with contextlib.suppress(*PgConnection.errors):
                self.settle()
        elif verb == "RELEASE":
            try:
                self.settle()
            except PgConnection.errors:  # the block failed after all: undo it, as the savepoint would have
                if self._pipeline is not None:  # (else the connection is gone, and the savepoint with it)
                    self._send(f"ROLLBACK TO {name}", None)
                    self._send(f"RELEASE {name}", None)
                raise
        elif verb == "SAVEPOINT":  # an earlier statement's error belongs to the enclosing block
            self.settle()
        if verb == "BEGIN":
            self._open = True
        elif verb in ("COMMIT", "ROLLBACK"):
            self._open = False
        cursor = self._send(statement.text, args)
        if verb == "COMMIT":  # its answer comes with the pipeline's closing sync: one round trip
            self._leave()
            self._statistics.after_commit()
        return cursor

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first column of the first row `sql` answers (None when it answers no row)."""
        row = self.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> PgCursor:
        if self._pipeline is not None:  # each row pipelined like `execute`, all answered by one wait
            cursors = [self.execute(sql, params) for params in seq]
            self.settle()
            total = PgCursor(self, None)
            total._rowcount = sum(max(cursor.rowcount, 0) for cursor in cursors)
            return total
        statement = statement_of(sql, True)
        text = statement.text
        rows = [statement.params_for(params) for params in seq]
        PgConnection.total_statements += len(rows)
        try:
            cur = self.raw.cursor()
            cur.executemany(text, rows)
            self._waited()
        except psycopg.Error as exc:  # psycopg pipelines executemany itself
            self._raise(exc, pipelined=True)
        answered = PgCursor(self, None)
        answered._rowcount = cur.rowcount
        return answered

    def close(self) -> None:
        self.raw.close()

    total_round_trips: ClassVar[int] = 0
    """Round trips of every connection of this process (bench/multi_runtime.py reports them per entry)."""

    total_statements: ClassVar[int] = 0
    """Statements sent by every connection of this process, transaction control and savepoints included
    (bench/multi_runtime.py reports them per entry)."""

    def _waited(self) -> None:
        self.round_trips += 1
        PgConnection.total_round_trips += 1

    # --- internals ---------------------------------------------------------------------------------------

    def _fault(self, exc: psycopg.Error, *, pipelined: bool) -> Exception:
        """`exc` as the store sees it (`typed`), recording the remedy its fault calls for
        (`FAULTS`): REPLACE closes the connection at once (so the rest of the transaction fails as lost too),
        and a lost connection is an `io` fault whatever `exc` says. An error in a pipeline also calls for
        RESET: the statements the server skipped may have included the PREPARE of one psycopg now believes
        prepared, so its prepared statements are forgotten at once (the rest of the transaction prepares
        afresh, under new names)."""
        fault = _LOST if self.broken else fault_of(exc)
        if fault is not None and fault.remedy is Remedy.REPLACE:
            self.raw.close()
        elif fault is not None and fault.remedy is Remedy.RENEW:
            self._renew = True
        elif fault is not None and fault.remedy is Remedy.RESET:
            self._dirty = True
        if pipelined:
            self._forget_prepared()
            self._dirty = True
        return typed(exc, fault)

    def _raise(self, exc: psycopg.Error, *, pipelined: bool, recover: bool = False) -> NoReturn:
        """Raise `exc` as the store sees it (`_fault`); `recover`: after a pipelined statement's error,
        start a fresh pipeline first (`_recover`)."""
        error = self._fault(exc, pipelined=pipelined)
        if recover:
            self._recover()
        _raise(exc, error)

    def _maintain(self, sql: str, params: Sequence[Any] | None) -> list[tuple[Any, ...]]:
        """Run one maintenance statement (`pg_stats`) between transactions, outside the pipeline, unprepared;
        its rows (none for a command). Counted as a statement and a round trip."""
        PgConnection.total_statements += 1
        self._waited()
        cur = self.raw.execute(sql, params, prepare=False)
        return list(cur.fetchall()) if cur.description is not None else []

    def _forget_prepared(self) -> None:
        """Make psycopg forget the statements it prepared on this session: later ones are prepared under new
        names, and `reset` deallocates the forgotten ones on the server. psycopg has no public call for
        this; should its internals differ from what this expects, automatic preparation is switched off on
        the connection instead (nothing prepared, nothing that can be missing)."""
        prepared = getattr(self.raw, "_prepared", None)
        try:
            for known in (prepared._names, prepared._counts, prepared._to_flush):  # type: ignore[union-attr]
                known.clear()
        except AttributeError:
            self.raw.prepare_threshold = None

    def _now(self, statement: Statement, args: Sequence[Any] | None) -> PgCursor:
        try:
            cur = self.raw.execute(statement.text, args, prepare=None if statement.prepare else False)
        except psycopg.Error as exc:
            self._raise(exc, pipelined=False)
        self._waited()
        cursor = PgCursor(self, cur)
        cursor._answer()
        return cursor

    def _send(self, text: str, args: Sequence[Any] | None, prepare: bool = True) -> PgCursor:
        try:
            cur = self.raw.cursor()
            cur.execute(text, args, prepare=None if prepare else False)
        except psycopg.Error as exc:
            self._raise(exc, pipelined=True, recover=True)
        return PgCursor(self, cur)

    def _fetch(self, cursor: PgCursor, cur: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
        """The rows of `cursor`'s psycopg `cur` (empty for a command), waiting for them if pipelined."""
        pipelined = self._pipeline is not None
        if pipelined:
            position = next((i for i, c in enumerate(self._unsettled) if c is cursor), -1)
            if position >= 0:  # answers come in order: those sent before it arrive with it
                self._waited()
                del self._unsettled[: position + 1]
        try:
            if cur.description is None and not pipelined:
                return []
            try:
                return list(cur.fetchall())
            except psycopg.ProgrammingError as exc:
                if exc.sqlstate is not None:
                    raise
                return []  # a command: its answer has arrived and carries no rows
        except psycopg.Error as exc:
            self._raise(exc, pipelined=pipelined, recover=True)

    def _enter(self) -> None:
        pipeline = self.raw.pipeline()
        try:
            pipeline.__enter__()
        except psycopg.Error as exc:
            self._raise(exc, pipelined=False)
        self._pipeline = pipeline

    def _leave(self) -> None:
        """Close the pipeline: one sync (a round trip) answering everything sent. A connection that libpq
        could not take out of pipeline mode is closed (it is then replaced).

        Raises:
            DatabaseFault, psycopg.Error: the first statement that failed among those not read yet."""
        pipeline, self._pipeline = self._pipeline, None
        self._unsettled = []
        if pipeline is None:
            return
        self._waited()
        try:
            pipeline.__exit__(None, None, None)
        except psycopg.Error as exc:
            if not self.raw.closed and self.raw.pgconn.pipeline_status != PipelineStatus.OFF:
                self.raw.close()
            self._raise(exc, pipelined=True)

    def _recover(self) -> None:
        """After a pipelined statement failed: drain what the server skipped and start a fresh pipeline, so
        a ROLLBACK TO can follow (the server ignores everything up to the next sync). A connection on which
        no fresh pipeline can be started is closed (it is then replaced)."""
        if self._pipeline is None:
            return
        with contextlib.suppress(*PgConnection.errors):
            self._leave()
        if not self.broken:
            try:
                self._enter()
            except PgConnection.errors:
                self.raw.close()


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
        DatabaseFault: the server cannot be reached or refuses the session: typed by `FAULTS` (`io` when it
            is down, starting up or in recovery), the psycopg error chained.
    """
    try:
        raw = psycopg.connect(
            url, autocommit=True, connect_timeout=max(1, round(connect_timeout)), **KEEPALIVES
        )
    except psycopg.Error as exc:
        _raise(exc, typed(exc))
    raw.adapters.register_dumper(bool, _BoolAsInt)
    raw.adapters.register_loader("numeric", _NumericLoader)
    conn = PgConnection(raw)
    settings = _SESSION_SETTINGS | {"lock_timeout": str(max(1, round(lock_timeout * 1000)))}
    try:
        for name, value in settings.items():
            conn.execute(f"SET {name} = {value}")
    except BaseException:
        conn.close()
        raise
    return conn
