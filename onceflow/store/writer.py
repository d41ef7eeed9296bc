"""The store actor: one writer thread owning the only SQLite connection, fed by a mailbox.

aiosqlite cannot run under Trio, so the store uses stdlib sqlite3 from one dedicated thread. Every write goes
through that one connection, so a single transaction can span every table (on-enter-action-dispatch.md,
"Persistence shape": the step-entry record and its markers share the writer handle with tasks and decisions).
A request is a whole transaction: a plain function run in the writer thread between `BEGIN IMMEDIATE` and
`COMMIT`. The reply wakes the Trio caller through the Trio token, and the caller waits for it even when
cancelled, so it always learns whether its transaction committed.

Given a `postgresql://` URL instead of a file, the same actor drives PostgreSQL through psycopg 3's sync API
(store/backends/postgres.py): no file lock (several runtimes share the database), the epoch held as a session
advisory lock (store/backends/epochs.py), each request's task locked for its transaction, a heartbeat on an
idle connection, and a fresh epoch on a fresh connection after the old one was lost. Before each transaction
(and at each heartbeat) the writer applies what the connection's last fault called for (`postgres.Remedy`): a
reset of the session, a new session once one would be writable after a read-only fault, or a new connection;
while the server cannot be reached, every request fails at once as `StorageError` kind io (retryable), and the
first request after it is back runs on a new connection.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, cast

import outcome
import trio
from trio.lowlevel import enable_ki_protection

from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.protocol.errors import StorageError
from onceflow.store.backends import epochs, faults, schema, urls
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import dialect_of
from onceflow.store.backends.lock import acquire_database_lock

if TYPE_CHECKING:
    from onceflow.store.backends.postgres import PgConnection

log = get_logger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_BUSY_TIMEOUT = 5.0  # seconds
HEARTBEAT = 1.0  # seconds: an idle PostgreSQL writer pings at least this often (idle_session_timeout is 10 s)
FENCE_AFTER = 4.0
"""Seconds without a successful round trip after which a PostgreSQL runtime fences itself
(`StoreActor.fenced`): well inside `postgres.PARTITION_BOUND`, so it stops its side effects before its epoch
can be declared dead."""


class Durability(StrEnum):
    """`PRAGMA synchronous` for the store's WAL database.

    FULL (the default) fsyncs the WAL on every commit: a committed transaction survives power loss.
    NORMAL fsyncs only at checkpoints: a commit survives a process crash but the last few may be lost on
    power loss. Either way the database stays consistent.
    """

    FULL = "FULL"
    NORMAL = "NORMAL"


_NO_PIPELINE = contextlib.nullcontext()
"""What `_commit` enters on SQLite in place of PostgreSQL's pipeline (one for every batch: it keeps no
state)."""


class StoreClosedError(RuntimeError):
    """`transact` was called on a store that is closing or closed."""


class Grouped(Generic[T]):
    """What lets the writer run a request together with others of the same batch: requests
    whose `key`s are equal run as one call `run(conn, [item, ...])`, in one savepoint, which returns each
    request's result in order, or None when it cannot decide them all (its writes are then rolled back and
    each request's own fn runs alone, as without a group): one set of statements for a batch of common
    entries (or task-row reads, or creations) instead of one per entry. On PostgreSQL the groups run once
    the batch holds its requests' task locks (a request whose lock another runtime held has left the batch
    by then).
    `run` follows the rules of a request's fn (plain synchronous code, no BEGIN/COMMIT); an exception from
    it that does not end the transaction counts as None."""

    __slots__ = ("item", "key", "run")

    def __init__(
        self, key: Hashable, item: object, run: Callable[[Connection, list[Any]], list[T] | None]
    ) -> None:
        self.key, self.item, self.run = key, item, run


class _Request(Generic[T]):
    __slots__ = ("args", "fn", "group", "kwargs", "result", "task_id", "waiter")

    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        waiter: trio.lowlevel.Task,
        task_id: str | None,
        group: Grouped[T] | None,
    ) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs  # run as fn(conn, *args, **kwargs)
        self.waiter = waiter  # the Trio task parked in `transact`, rescheduled with `result`
        self.task_id = task_id  # the task whose lock the request runs under (PostgreSQL only)
        self.group = group
        self.result: outcome.Outcome[T] | None = None


class StoreActor:
    """The single writer of one database file. Obtain it from `open_store`; do not construct it directly.

    Attributes:
        path: the database file (absolute, symlinks resolved), or the PostgreSQL URL (password redacted).
        postgres: True when the database is PostgreSQL.
        epoch: 32 hex characters minted fresh for this runtime start; it marks the markers this runtime
            claims (on-enter-action-dispatch.md, "Epoch"). Never reused across starts; on PostgreSQL a new
            one is minted whenever the writer had to reconnect.
        durability: the `PRAGMA synchronous` level in force.
        max_batch: the most requests committed together in one transaction (group commit).
        busy_timeout: seconds a transaction waits for another connection's write lock before it fails
            with `StorageError` kind busy.
    """

    def __init__(self, path: Path | str, durability: Durability, max_batch: int, busy_timeout: float) -> None:
        self.postgres = urls.is_postgres_url(path)
        self._url = str(path)
        self.path: Path | str = urls.redacted(str(path)) if self.postgres else path
        self.epoch = secrets.token_hex(16)
        self._confirmed = time.monotonic()  # the last successful round trip to the server
        self._lost_at: float | None = None  # PostgreSQL: when reconnecting first failed, until it succeeds
        self._reported = 0.0  # when a failed reconnect was last logged
        self._deferred: list[_Request[Any]] = []  # PostgreSQL: left by `_commit` for the next transaction
        self.durability = durability
        self.max_batch = max_batch
        self.busy_timeout = busy_timeout
        self._mailbox: queue.SimpleQueue[_Request[Any] | None] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._accepting = False
        self._stop_sent = False
        self._ready = trio.Event()
        self._stopped = trio.Event()
        self._setup: outcome.Outcome[int] | None = None
        self._thread = threading.Thread(target=self._run, name=f"onceflow-store-writer {path}", daemon=True)

    @enable_ki_protection
    async def transact(
        self, fn: Callable[Concatenate[Connection, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run `fn(conn, *args, **kwargs)` as one transaction in the writer thread and return its result.

        `fn` runs between `BEGIN IMMEDIATE` and `COMMIT` (inside its own SAVEPOINT, which matters only when
        several requests share a commit, see `open_store`'s `max_batch`). It must be plain synchronous code
        (a store function: no Trio calls, no BEGIN/COMMIT/ROLLBACK of its own) and should return plain
        values, not cursors. The wait for the reply is shielded from cancellation: a cancelled caller still
        waits until its transaction has committed or rolled back, gets that result here, and sees the
        cancellation at its next checkpoint. Requests run in arrival order, except that a request
        submitted with `transact_grouped` may run first, together with the batch's other requests of the
        same group key: requests that share a commit were all waiting at once, none having seen another's
        result, so any order of them is one their callers could have observed.

        Raises:
            StoreClosedError: the store is closing or closed; nothing was run.
            StorageError: a storage fault (busy past the busy timeout, disk full, I/O, read-only, corrupt;
                on PostgreSQL also the server unreachable, every fault of `postgres.FAULTS`), raised by `fn`
                or by the transaction itself, or another request of the same batch ended the transaction;
                nothing of this request was committed. The database's error is its cause (on PostgreSQL
                a `faults.DatabaseFault` is itself the StorageError, psycopg's error its cause).
            BaseException: whatever else `fn` raised (its writes are rolled back), or the database error that
                failed the transaction itself (e.g. a deferred constraint at COMMIT), in which case nothing
                of this request was committed.
        """
        self._submit(fn, args, kwargs, None)
        return await trio.lowlevel.wait_task_rescheduled(_refuse_abort)  # type: ignore[no-any-return]

    @enable_ki_protection
    async def transact_grouped(
        self,
        group: Grouped[T],
        fn: Callable[Concatenate[Connection, P], T],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """`transact`, allowing the writer to run this request with others of the same `group.key` in its
        batch (`Grouped`); `fn` runs alone when the group cannot decide it. Raises as `transact`."""
        self._submit(fn, args, kwargs, group)
        return await trio.lowlevel.wait_task_rescheduled(_refuse_abort)  # type: ignore[no-any-return]

    def _submit(
        self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], group: Grouped[T] | None
    ) -> None:
        """Queue the request of the calling Trio task; the caller then parks until the writer answers.
        Refusing the abort (`_refuse_abort`) is what shields that wait: a cancellation stays pending and is
        delivered at the caller's next checkpoint, after it has its answer. (Cheaper than a shielded
        CancelScope + Event per request, which cost ~20 us each at group-commit rates; and a plain call, not
        a coroutine: one frame fewer to suspend and resume per request.) Its callers are KI-protected: a
        KeyboardInterrupt raised between queueing and parking would leave the writer to wake a task that
        is gone (TrioInternalError) or waiting on something else."""
        if not self._accepting:
            raise StoreClosedError(f"store {self.path} is closed")
        task = epochs.CURRENT_TASK.get()
        self._mailbox.put(_Request(fn, args, kwargs, trio.lowlevel.current_task(), task, group))

    @property
    def fenced(self) -> bool:
        """True on PostgreSQL when the writer has had no successful round trip for `FENCE_AFTER` seconds:
        the server may soon end the session and free the epoch, so the runtime must start no side effect on
        the strength of its claims (self-fencing). Always False on SQLite."""
        return self.postgres and time.monotonic() - self._confirmed > FENCE_AFTER

    # --- Trio side -------------------------------------------------------------------------------------

    async def _open(self) -> int:
        self._thread.start()
        await self._ready.wait()
        assert self._setup is not None
        version = self._setup.unwrap()
        self._accepting = True
        return version

    async def _close(self) -> None:
        # Requests already in the mailbox are ahead of the stop marker, so they run before the thread exits.
        self._accepting = False
        if self._thread.ident is None:  # never started
            return
        if not self._stop_sent:
            self._stop_sent = True
            self._mailbox.put(None)
        # A KeyboardInterrupt (a second Ctrl-C) is delivered to a parked main task even under a shield: it is
        # held until the writer has stopped, so the database lock is never released under a live writer.
        interrupt: KeyboardInterrupt | None = None
        while not self._stopped.is_set():
            try:
                await self._stopped.wait()
            except KeyboardInterrupt as exc:
                interrupt = exc
        self._thread.join()
        if interrupt is not None:
            raise interrupt

    def _wake(self, requests: list[_Request[Any]]) -> None:
        for request in requests:
            assert request.result is not None
            trio.lowlevel.reschedule(request.waiter, request.result)

    def _call_trio(self, fn: Callable[..., object], *args: object) -> None:
        try:  # (not `contextlib.suppress`: a context manager built per batch)
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:  # the Trio run is gone; nobody is left waiting
            return

    # --- writer thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        conn: Connection | None = None
        try:
            if self.postgres:
                from onceflow.store.backends import postgres

                conn = postgres.connect(
                    self._url, connect_timeout=self.busy_timeout, lock_timeout=self.busy_timeout
                )
                self._setup = outcome.capture(self._configure_postgres, conn)
            else:
                conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
                self._setup = outcome.capture(self._configure, conn)
        except BaseException as exc:
            self._setup = outcome.Error(exc)
        try:
            self._call_trio(self._ready.set)
            if conn is not None and isinstance(self._setup, outcome.Value):
                conn = self._serve(conn)
        finally:
            if conn is not None:
                conn.close()
            self._call_trio(self._stopped.set)

    def _configure_postgres(self, conn: PgConnection) -> int:
        """Refuse stub advisory locks, hold this epoch's lock, then create or upgrade the schema."""
        from onceflow.store.backends import pg_schema, postgres

        probe = postgres.connect(self._url, connect_timeout=self.busy_timeout, lock_timeout=self.busy_timeout)
        try:
            epochs.verify_real_locks(conn, probe)
        finally:
            probe.close()
        epochs.hold_epoch(conn, self.epoch)
        version = pg_schema.migrate(conn)
        self._confirmed = time.monotonic()
        return version

    def _connect(self) -> PgConnection:
        """A new PostgreSQL connection with the store's timeouts (`postgres.connect`), holding no epoch."""
        from onceflow.store.backends import postgres

        return postgres.connect(self._url, connect_timeout=self.busy_timeout, lock_timeout=self.busy_timeout)

    def _reconnect(self, conn: PgConnection) -> PgConnection:
        """A fresh connection holding a fresh epoch, after `conn` was lost or could not be trusted (its epoch
        died with its session: never re-locked). Raises what connecting raises (a `faults.DatabaseFault`,
        a typed storage fault); the old connection is closed either way."""
        with contextlib.suppress(Exception):
            conn.close()
        try:
            fresh = self._connect()
        except Exception as exc:
            self._unreachable(exc)
            raise
        return self._adopt(fresh)

    def _renewal(self, conn: PgConnection) -> PgConnection:
        """`conn` (read-only, perhaps for good: `Remedy.RENEW`) replaced by a new connection under a new epoch
        if a new session would be writable; else `conn` itself, kept with its epoch (asked again before the
        next transaction)."""
        try:
            fresh = self._connect()
        except Exception as exc:
            log.warning("store_renewal_failed", path=str(self.path), error=str(exc))
            return conn
        try:
            if fresh.scalar("SHOW transaction_read_only") != "off":  # still read-only: keep ours
                fresh.close()
                return conn
            adopted = self._adopt(fresh)
        except Exception as exc:
            fresh.close()
            log.warning("store_renewal_failed", path=str(self.path), error=str(exc))
            return conn
        conn.close()
        return adopted

    def _adopt(self, fresh: PgConnection) -> PgConnection:
        """`fresh`, holding a new epoch, as the writer's connection. Raises what taking the epoch's lock
        raises (`fresh` is then closed)."""
        try:
            epoch = secrets.token_hex(16)
            epochs.hold_epoch(fresh, epoch)
        except BaseException:
            fresh.close()
            raise
        outage = None if self._lost_at is None else round(time.monotonic() - self._lost_at, 3)
        log.warning(
            "store_epoch_renewed",
            path=str(self.path),
            old_epoch=self.epoch,
            epoch=epoch,
            outage_seconds=outage,
        )
        self.epoch = epoch
        self._lost_at = None
        self._confirmed = time.monotonic()
        return fresh

    def _unreachable(self, exc: BaseException) -> None:
        """Log a failed reconnect: at ERROR when the outage begins, then at most once per HEARTBEAT."""
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at = now
        elif now - self._reported < HEARTBEAT:
            return
        self._reported = now
        log.error(
            "store_reconnect_failed",
            path=str(self.path),
            error=str(exc),
            outage_seconds=round(now - self._lost_at, 3),
        )

    def _usable(self, conn: PgConnection) -> PgConnection:
        """`conn` ready for a transaction, as its last faults called for (`PgConnection.remedy`): replaced
        by a new connection under a new epoch once lost; replaced once a new session would be writable after
        a read-only fault (`_renewal`); reset (`PgConnection.reset`) when needed, or replaced if it cannot
        be.

        Raises:
            Exception: no new connection could be made (a `faults.DatabaseFault`, a typed storage fault, for
                the batch's requests); `conn` is then closed, and the next call tries again.
        """
        from onceflow.store.backends.postgres import Remedy

        remedy = conn.remedy
        if remedy is Remedy.REPLACE:
            return self._reconnect(conn)
        if remedy is Remedy.RENEW:
            renewed = self._renewal(conn)
            if renewed is not conn:
                return renewed
        if conn.reset_needed:
            try:
                conn.reset()
            except conn.errors as exc:
                log.warning("store_reset_failed", path=str(self.path), error=str(exc))
                return self._reconnect(conn)
        return conn

    def _heartbeat(self, conn: PgConnection) -> PgConnection:
        """Ping an idle PostgreSQL connection, after applying what its last fault called for (`_usable`);
        one found lost by the ping is replaced at once (under a new epoch)."""
        try:
            conn = self._usable(conn)
            try:
                conn.execute("SELECT 1")
            except conn.errors:
                conn = self._usable(conn)
                conn.execute("SELECT 1")
            self._confirmed = time.monotonic()
        except Exception as exc:
            if self._lost_at is None:  # (else `_unreachable` has reported it)
                log.warning("store_heartbeat_failed", path=str(self.path), error=str(exc))
        return conn

    def _configure(self, conn: sqlite3.Connection) -> int:
        conn.execute(f"PRAGMA busy_timeout={max(1, round(self.busy_timeout * 1000))}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"could not put {self.path} in WAL mode (journal_mode is {mode!r})")
        conn.execute(f"PRAGMA synchronous={self.durability.value}")
        # Every request runs in a savepoint, whose journal keeps each page the request changes; past 64 KiB
        # (one entry touches ~16 pages) SQLite spills it to a temporary file, created and unlinked per spill.
        conn.execute("PRAGMA temp_store=MEMORY")
        # foreign_keys is a no-op inside a transaction, so set it here (autocommit) and read it back.
        conn.execute("PRAGMA foreign_keys=ON")
        if conn.execute("PRAGMA foreign_keys").fetchone()[0] != 1:
            raise RuntimeError("SQLite refused to enable foreign key enforcement")
        return schema.migrate(conn)

    def _serve(self, conn: Connection) -> Connection:
        """Serve the mailbox until the stop marker; return the connection in use (PostgreSQL may replace
        it)."""
        deferred: list[_Request[Any]] = []  # PostgreSQL: requests whose task lock another runtime held
        stop = False
        while True:
            if deferred:
                batch, deferred = deferred, []
            else:
                if stop:
                    return conn
                try:
                    request = self._mailbox.get(timeout=HEARTBEAT) if self.postgres else self._mailbox.get()
                except queue.Empty:
                    conn = self._heartbeat(_pg(conn))
                    continue
                if request is None:
                    return conn
                batch = [request]
            while not stop and len(batch) < self.max_batch:
                try:
                    queued = self._mailbox.get_nowait()
                except queue.Empty:
                    break
                if queued is None:
                    stop = True
                    break
                batch.append(queued)
            if self.postgres:
                try:
                    conn = self._usable(_pg(conn))
                except Exception as exc:
                    self._refuse(batch, exc)
                    self._call_trio(self._wake, batch)
                    continue
            self._commit(conn, batch)  # leaves in `batch` only the requests it ran
            deferred, self._deferred = self._deferred, []
            self._call_trio(self._wake, batch)

    def _commit(self, conn: Connection, batch: list[_Request[Any]]) -> None:
        """Run `batch` as one transaction, one SAVEPOINT per request (per group first, `_run_groups`), and set
        each request's result.

        On PostgreSQL the batch first takes its tasks' locks (store/backends/epochs.py): the first task's
        waits, the others' are only tried, and from the first request whose lock failed, the requests are
        moved from
        `batch` to `self._deferred`, to run first in the next transaction (so no two runtimes' batches wait on
        each other). The transaction runs pipelined (`PgConnection.pipelined`): a statement's answer is waited
        for only where it is read, at each request's end and at COMMIT, so a batch is not round-trip bound.

        A request whose fn raised is rolled back to its savepoint and gets its exception. If the transaction
        itself fails (BEGIN, SAVEPOINT bookkeeping, COMMIT), every other request gets that error. If a
        request's error ends the transaction (`faults.ends_transaction`: SQLite rolled it back, or FULL,
        IOERR, NOMEM, CORRUPT), or a request returns with the transaction gone, nothing of the batch is
        committed and every request of it fails, none told it succeeded: later requests never run in
        autocommit mode. Storage faults reach the callers as `StorageError`. On PostgreSQL a fault anywhere
        (entering the pipeline, BEGIN, a task lock, a SAVEPOINT, a request, COMMIT) is typed the same way by
        the connection (`postgres.FAULTS`), which records what it needs before the next transaction.
        """
        started = time.perf_counter()
        try:
            with _pg(conn).pipelined() if self.postgres else _NO_PIPELINE:
                conn.execute(dialect_of(conn).begin)
                if self.postgres:
                    self._lock_tasks(_pg(conn), batch)
                if len(batch) > 1:
                    self._run_groups(conn, batch)
                for request in batch:
                    if request.result is not None:  # ran in its group
                        continue
                    conn.execute("SAVEPOINT request")
                    error = self._run_request(conn, request)
                    if not conn.in_transaction or (
                        error is not None and faults.ends_transaction(conn, error)
                    ):
                        raise _TransactionEnded(request, error)
                    if error is not None:
                        conn.execute("ROLLBACK TO request")
                    conn.execute("RELEASE request")
                conn.execute("COMMIT")
            self._confirmed = time.monotonic()
            metrics.COMMIT_DURATION.record(time.perf_counter() - started)
            metrics.COMMIT_BATCH_SIZE.record(len(batch))
        except BaseException as exc:
            self._fail(conn, batch, exc)
        for request in batch:
            assert request.result is not None
            request.result = _typed(request.result)

    def _lock_tasks(self, conn: PgConnection, batch: list[_Request[Any]]) -> None:
        """Take the batch's task locks (PostgreSQL), all in one round trip: the first request's waits, the
        others' are only tried; from the first request whose lock another runtime holds, the requests move
        from `batch` to `self._deferred` (locks taken for later tasks are merely held until the commit)."""
        tasks = list(dict.fromkeys(r.task_id for r in batch if r.task_id is not None))
        held = epochs.lock_tasks(conn, tasks)
        for index, request in enumerate(batch):
            if request.task_id is not None and not held[request.task_id]:
                self._deferred = batch[index:]
                del batch[index:]
                return

    def _run_groups(self, conn: Connection, batch: list[_Request[Any]]) -> None:
        """Run each group of two or more of the batch's requests (`Grouped`) in one savepoint and set their
        results; a group that returns None or raises is rolled back, its requests left to run alone.
        Raises `_TransactionEnded` for an error that ended the transaction."""
        groups: dict[Hashable, list[tuple[_Request[Any], Grouped[Any]]]] = {}
        for request in batch:
            if request.group is not None:
                groups.setdefault(request.group.key, []).append((request, request.group))
        for members in groups.values():
            if len(members) < 2:
                continue
            conn.execute("SAVEPOINT request")
            try:
                results = members[0][1].run(conn, [group.item for _, group in members])
                if self.postgres:  # an unread statement's error is the group's, not the next one's
                    _pg(conn).settle()
            except Exception as exc:
                if not conn.in_transaction or faults.ends_transaction(conn, exc):
                    raise _TransactionEnded(members[0][0], exc) from exc
                log.warning("store_group_failed", path=str(self.path), size=len(members), cause=repr(exc))
                results = None
            if not conn.in_transaction:
                raise _TransactionEnded(members[0][0], None)
            if results is None:
                conn.execute("ROLLBACK TO request")
            else:
                for (request, _), result in zip(members, results, strict=True):
                    request.result = outcome.Value(result)
            conn.execute("RELEASE request")

    def _run_request(self, conn: Connection, request: _Request[Any]) -> BaseException | None:
        """Run `request.fn(conn)` and set its result; on PostgreSQL every statement it sent without reading
        the answer is then settled, so that an error among them is this request's (its savepoint is rolled
        back, the batch goes on). Returns what it raised, if anything (inlined `outcome.capture`: it runs once
        per request in the writer thread)."""
        try:
            value = request.fn(conn, *request.args, **request.kwargs)
            if self.postgres:
                _pg(conn).settle()
        except BaseException as exc:
            request.result = outcome.Error(exc)
            return exc
        request.result = outcome.Value(value)
        return None

    def _refuse(self, batch: list[_Request[Any]], exc: BaseException) -> None:
        """Fail every request of a batch that found no usable connection (PostgreSQL): a `StorageError` of the
        connect error's kind, `io` if it reports none (retryable); nothing of the batch ran."""
        kind = faults.storage_kind(exc) or "io"
        for request in batch:
            error = faults.storage_error(exc, kind=kind, context="no connection to the database: ")
            request.result = outcome.Error(_chained(error, exc))

    def _fail(self, conn: Connection, batch: list[_Request[Any]], exc: BaseException) -> None:
        """Fail every request of a batch whose transaction did not commit; roll back what is left of it."""
        if isinstance(exc, _TransactionEnded):
            cause: BaseException = exc.error or exc
            kind = faults.storage_kind(cause) or "aborted"
            for request in batch:
                if request is exc.request:
                    request.result = outcome.Error(_chained(faults.storage_error(cause, kind=kind), cause))
                elif not isinstance(request.result, outcome.Error):
                    context = "another request of its batch ended the transaction: "
                    error = faults.storage_error(cause, kind=kind, context=context)
                    request.result = outcome.Error(_chained(error, cause))
            log.error("store_transaction_ended", path=str(self.path), batch=len(batch), error=str(cause))
        else:
            for request in batch:
                if not isinstance(request.result, outcome.Error):
                    request.result = outcome.Error(exc)  # one each: an Outcome unwraps only once
            log.warning("store_transaction_failed", path=str(self.path), batch=len(batch), error=str(exc))
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except faults.database_errors(conn) as rollback_exc:
                log.error("store_rollback_failed", path=str(self.path), error=str(rollback_exc))


class _TransactionEnded(Exception):
    """Raised in the writer when a request ended the batch's transaction (`error`: what it raised, if any)."""

    def __init__(self, request: _Request[Any], error: BaseException | None) -> None:
        super().__init__("the transaction ended inside a request" if error is None else str(error))
        self.request, self.error = request, error


def _typed(result: outcome.Outcome[T]) -> outcome.Outcome[T]:
    """`result` with a sqlite3 storage fault replaced by its `StorageError` (the fault chained as cause); a
    `StorageError` already (PostgreSQL's typed faults) is kept."""
    if type(result) is outcome.Value:  # (not `isinstance`: an ABC's check runs Python, per request)
        return result
    if (
        isinstance(result, outcome.Error)
        and not isinstance(result.error, StorageError)
        and faults.storage_kind(result.error) is not None
    ):
        return outcome.Error(_chained(faults.storage_error(result.error), result.error))
    return result


def _chained(error: StorageError, cause: BaseException) -> StorageError:
    if error is not cause:  # (a `faults.DatabaseFault` is its own StorageError)
        error.__cause__ = cause
    return error


def _pg(conn: Connection) -> PgConnection:
    """`conn` as what it is when the store is on PostgreSQL (callers check `StoreActor.postgres`)."""
    return cast("PgConnection", conn)


def _refuse_abort(_: Callable[[], object]) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


@asynccontextmanager
@enable_ki_protection
async def open_store(
    path: str | os.PathLike[str],
    *,
    durability: Durability = Durability.FULL,
    max_batch: int = 1,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
) -> AsyncIterator[StoreActor]:
    """Open the database at `path` (created if missing; its directory must exist) and yield its actor.

    `path` may instead be a `postgresql://` (or `postgres://`) URL: the same actor then drives that PostgreSQL
    database. No file lock is taken, since several runtimes may share it; instead the connection is checked
    for real advisory locks, holds this runtime's epoch lock, and the schema is created or upgraded once
    across runtimes. `durability` does not apply (the server's own `synchronous_commit` decides);
    `busy_timeout` bounds the connect and every wait for a lock (a task's lock held by another runtime, a
    row): past it the request fails with `StorageError` kind busy.

    Takes the database's OS lock, starts the writer thread, and returns once the connection is configured
    (WAL, `synchronous` per `durability`, foreign keys verified on, busy timeout) and migrations are
    applied, without blocking the Trio loop. `max_batch` is how many queued requests the writer may commit
    together (group commit); 1 commits each request alone. `busy_timeout` is how many seconds a transaction
    waits for another connection's write lock before failing with `StorageError` kind busy. On exit, new
    requests are refused, requests already queued still run, then the thread stops, the connection closes and
    the lock is released; exit waits for this even when cancelled.

    Raises:
        DatabaseOwnedError: another onceflow runtime owns the database file, under any of its names (at once,
            without waiting). Never for PostgreSQL.
        AdvisoryLocksUnsupportedError: the PostgreSQL-compatible engine's advisory locks are stubs.
        OSError: the file cannot be opened: its directory is missing (a typo in a path must not create
            folders), it is a directory, or permission is denied.
        ValueError: `durability` is not a `Durability`, `max_batch` < 1, or `busy_timeout` is not a finite
            number of seconds > 0.
        sqlite3.Error, RuntimeError: the connection could not be set up or migrated (the thread has exited).
    """
    durability = Durability(durability)
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    if not (math.isfinite(busy_timeout) and busy_timeout > 0):
        raise ValueError(f"busy_timeout must be a finite number of seconds > 0, got {busy_timeout}")
    is_url = urls.is_postgres_url(path)
    db_path: Path | str = str(path) if is_url else Path(path).resolve()
    with contextlib.nullcontext() if is_url else acquire_database_lock(Path(db_path)):
        store = StoreActor(db_path, durability, max_batch, busy_timeout)
        try:
            version = await store._open()
            log.info(
                "store_opened",
                path=str(store.path),
                epoch=store.epoch,
                schema_version=version,
                durability=durability.value,
                max_batch=max_batch,
                busy_timeout=busy_timeout,
            )
            yield store
        finally:
            with trio.CancelScope(shield=True):
                await store._close()
            log.info("store_closed", path=str(store.path), epoch=store.epoch)
