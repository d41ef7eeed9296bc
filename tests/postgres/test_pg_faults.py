"""Every fault a PostgreSQL connection can raise reaches the host typed, commits nothing of the transaction
that met it, and leaves the connection reset or replaced so that the next command works
(store/backends/postgres.py
`FAULTS` and `Remedy`, store/writer.py `StoreActor._usable`).

Each test brings about the real condition on a throw-away server: a backend terminated from another session
(just before BEGIN, a SAVEPOINT, a statement of a pipelined batch or COMMIT, or while a command waits on a
lock), a backend SIGKILLed with a statement unread (a reset connection, and a crashed server), the server
stopped or restarted at once, a statement timeout and a lock timeout, a serialization failure and a
deadlock between two sessions, the server's prepared statements deallocated behind psycopg's back, a
tablespace on a full tmpfs volume, a backend whose address space is capped, a database made read-only, a
revoked privilege. Each asserts the reply typed (`storage_<kind>` and its
`retryable`), that nothing of the failed transaction committed, and that the command sent once the condition
clears succeeds at the first attempt. No wall-clock bound is asserted (the machine is shared); the restart
test reports how long the runtimes took to serve again. Tests that stop, crash, restart or reconfigure the
server use a server of this module's own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from helpers import FIXTURES, FakeClock, create_task, move, ok, send, setup_office
from pg_support import PostgresServer, limit_memory, start_postgres
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.errors import StorageError, StorageKind
from onceflow.protocol.events import Reply
from onceflow.store.backends import faults, postgres
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.postgres import FAULTS, Remedy
from onceflow.store.writer import StoreActor, open_store

OFFICE = FIXTURES / "kandev" / "office-default.yml"
TURN = {"type": "turn_complete", "task_id": "T1"}
ITEMS = "CREATE TABLE items (id BIGINT PRIMARY KEY)"


# --- support ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_server() -> Iterator[PostgresServer]:
    """A server for the tests that stop, crash, restart or reconfigure it; durable, so that what it
    acknowledged survives its immediate stops."""
    server = start_postgres(durable=True)
    try:
        yield server
    finally:
        server.stop()


_databases = itertools.count(1)


@pytest.fixture
def own_url(own_server: PostgresServer) -> str:
    """A fresh, empty database on the module's own server."""
    return own_server.create_database(f"faults{next(_databases)}")


@contextlib.contextmanager
def session(url: str) -> Iterator[psycopg.Connection[Any]]:
    """Another session on the database (autocommit): an operator's, or another runtime's."""
    conn = psycopg.connect(url, autocommit=True)
    try:
        yield conn
    finally:
        conn.close()


def terminate(url: str, pid: int) -> None:
    """`pg_terminate_backend(pid)` from another session; returns once the backend has exited."""
    with session(url) as other:
        assert other.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone() == (True,)


def database(url: str) -> str:
    return url.rsplit("/", 1)[1]


def waiting_on_a_lock(url: str) -> int:
    """The pid of the backend of the database that waits on a lock (a runtime's, blocked by our row lock)."""
    with session(url) as probe:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            row = probe.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            ).fetchone()
            if row is not None:
                return int(row[0])
            time.sleep(0.02)
    raise AssertionError("no backend came to wait on the lock")


async def writer_pid(store: StoreActor) -> int:
    def pid(conn: Connection) -> int:
        return int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])

    return await store.transact(pid)


def assert_typed(reply: Reply, kind: StorageKind, retryable: bool, sqlstate: str | None = None) -> None:
    assert not reply.ok and reply.error is not None, reply
    assert (reply.error.code, reply.error.retryable) == (f"storage_{kind}", retryable), reply.error
    if sqlstate is not None:
        assert f"sqlstate {sqlstate}" in reply.error.message, reply.error.message


def assert_storage(
    exc: BaseException, kind: StorageKind, retryable: bool, sqlstate: str | None = None
) -> None:
    assert isinstance(exc, StorageError), repr(exc)
    assert (exc.kind, exc.code, exc.retryable) == (kind, f"storage_{kind}", retryable), exc
    root = exc.__cause__.__cause__ if isinstance(exc.__cause__, StorageError) else exc.__cause__
    assert isinstance(exc if root is None else root, StorageError if root is None else psycopg.Error), exc
    if sqlstate is not None:
        assert f"sqlstate {sqlstate}" in str(exc), exc


@contextlib.contextmanager
def nothing_internal() -> Iterator[None]:
    """No command in the block was answered `internal` (logged as command_failed) and no actor crashed."""
    with capture_logs() as logs:
        yield
    crashes = {"command_failed", "task_actor_crashed", "outcome_actor_crashed"}
    assert [record for record in logs if record["event"] in crashes] == []


async def office_task(rt: Runtime) -> dict[str, Any]:
    """The office template with rev-a, rev-b and boss seated, and task T1 in Work, from where `TURN` takes it
    to Review, queueing a run per reviewer in one transaction. Returns T1's `snapshot`."""
    await setup_office(rt, OFFICE)
    await create_task(rt, "T1")
    await move(rt, "T1", "work")
    return await snapshot(rt)


async def snapshot(rt: Runtime, task: str = "T1") -> dict[str, Any]:
    """What a half-applied command would change, read through the protocol."""
    return {
        "task": (await ok(rt, {"type": "get_task", "task_id": task})).result,
        "runs": (await ok(rt, {"type": "list_runs", "task_id": task})).result["runs"],
        "entries": (await ok(rt, {"type": "list_step_entries", "task_id": task})).result["entries"],
    }


async def assert_reviewed_once(rt: Runtime, reviewers: list[str] | None = None) -> None:
    """`TURN` applied exactly once: T1 in Review, one run per reviewer, all from Review's first entry."""
    after = await snapshot(rt)
    assert after["task"]["step_id"] == "review"
    assert sorted(run["agent_profile_id"] for run in after["runs"]) == (reviewers or ["rev-a", "rev-b"])
    assert [entry["entry_seq"] for entry in after["entries"] if entry["step_id"] == "review"] == [1]


def insert(item: int) -> Callable[[Connection], int]:
    def fn(conn: Connection) -> int:
        conn.execute("INSERT INTO items (id) VALUES (?)", (item,))
        return item

    return fn


def items(url: str) -> list[int]:
    """The items committed, read by another session."""
    with session(url) as other:
        return [int(row[0]) for row in other.execute("SELECT id FROM items ORDER BY id")]


# --- the table ----------------------------------------------------------------------------------------------

REPRESENTATIVES = {
    "08": "08006",
    "57": "57P01",
    "40": "40003",
    "53": "53400",
    "58": "58030",
    "28": "28P01",
    "XX": "XX000",
}
"""A code of each class entry of `FAULTS` (a code entry stands for itself)."""


@pytest.mark.parametrize("key", sorted(FAULTS))
def test_every_sqlstate_of_the_table_is_its_storage_kind_with_its_retryable_and_remedy(key: str) -> None:
    code = REPRESENTATIVES.get(key, key)
    error = psycopg.errors.lookup(code)("x")
    assert error.sqlstate == code
    fault = FAULTS[key]
    assert postgres.fault_of(error) == fault
    mapped = postgres.typed(error)
    assert isinstance(mapped, faults.DatabaseFault)
    assert faults.storage_kind(mapped) == fault.kind
    typed = faults.storage_error(mapped)
    assert (typed.code, typed.retryable) == (
        f"storage_{fault.kind}",
        fault.kind not in ("read_only", "corrupt"),
    )


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (psycopg.OperationalError("the connection is closed"), postgres.Fault("io", Remedy.REPLACE)),
        (
            psycopg.errors.ConnectionTimeout("connection timeout expired"),
            postgres.Fault("io", Remedy.REPLACE),
        ),
        (psycopg.errors.PipelineAborted("pipeline aborted"), postgres.Fault("aborted", Remedy.NONE)),
        (psycopg.errors.UniqueViolation("x"), None),
        (psycopg.errors.SyntaxError("x"), None),
        (psycopg.errors.UndefinedTable("x"), None),
        (psycopg.InterfaceError("x"), None),
    ],
)
def test_errors_without_a_table_entry(error: psycopg.Error, fault: postgres.Fault | None) -> None:
    """psycopg's own errors: a connection it lost or cannot use is io (replaced), an aborted pipeline is
    aborted; constraints, SQL errors and misuse are no storage fault: they stay psycopg's own errors."""
    assert postgres.fault_of(error) == fault
    mapped = postgres.typed(error)
    assert faults.storage_kind(mapped) == (None if fault is None else fault.kind)
    assert (mapped is error) == (fault is None)
    assert faults.is_constraint_violation(mapped) == isinstance(error, psycopg.errors.IntegrityError)


# --- connection closed or reset, admin termination ----------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "nth"),
    [("BEGIN", 1), ("SAVEPOINT", 2), ("INSERT", 2), ("COMMIT", 2)],
    ids=["at-begin", "at-a-savepoint", "inside-the-pipelined-batch", "at-commit"],
)
async def test_a_connection_lost_anywhere_in_a_batch_fails_it_as_io_and_the_next_one_reconnects(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, statement: str, nth: int
) -> None:
    """Three requests share one pipelined transaction; its backend is terminated from another session just
    before the connection sends the `nth` `statement` counted from the batch's release (the batch holding
    the writer sends one COMMIT first): its BEGIN, the second request's SAVEPOINT or INSERT, its COMMIT.
    Every request fails `storage_io` (retryable), none of the three rows is committed, and the same requests
    sent again commit on a new connection under a new epoch."""
    armed = threading.Event()
    seen = 0
    original = postgres.PgConnection.execute

    def execute(self: postgres.PgConnection, sql: str, params: Any = ()) -> postgres.PgCursor:
        nonlocal seen
        if armed.is_set() and sql.startswith(statement):
            seen += 1
            if seen == nth:
                terminate(pg_url, self.raw.info.backend_pid)
        return original(self, sql, params)

    async with open_store(pg_url, max_batch=8) as store:
        await store.transact(lambda conn: conn.execute(ITEMS).rowcount)
        old = store.epoch
        monkeypatch.setattr(postgres.PgConnection, "execute", execute)
        holding, gate = threading.Event(), threading.Event()
        results: dict[int, Any] = {}

        def hold(conn: Connection) -> None:
            holding.set()
            gate.wait(10)

        async def request(item: int) -> None:
            try:
                results[item] = await store.transact(insert(item))
            except Exception as exc:
                results[item] = exc

        with nothing_internal():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.transact, hold)  # while it holds the writer, the next three queue
                await trio.to_thread.run_sync(holding.wait, 10)
                for item in (1, 2, 3):
                    nursery.start_soon(request, item)
                await trio.sleep(0.2)
                armed.set()
                gate.set()
        assert seen >= nth
        for item in (1, 2, 3):
            assert_storage(results[item], "io", True)
        assert items(pg_url) == []
        armed.clear()
        assert [await store.transact(insert(item)) for item in (1, 2, 3)] == [1, 2, 3]
        assert store.epoch != old
    assert items(pg_url) == [1, 2, 3]


def test_entering_the_pipeline_on_a_connection_psycopg_knows_lost_is_an_io_fault(pg_url: str) -> None:
    """After psycopg has seen its connection go, `pipelined` (which psycopg refuses with its own
    OperationalError, 'the connection is closed') raises the typed storage fault, and the connection asks
    to be replaced."""
    conn = postgres.connect(pg_url)
    try:
        terminate(pg_url, conn.raw.info.backend_pid)
        with pytest.raises(faults.DatabaseFault) as lost:
            conn.execute("SELECT 1")
        assert faults.storage_kind(lost.value) == "io" and conn.remedy is Remedy.REPLACE
        with pytest.raises(faults.DatabaseFault) as entering, conn.pipelined():
            pass
        assert faults.storage_kind(entering.value) == "io"
        assert isinstance(entering.value.__cause__, psycopg.OperationalError)
    finally:
        conn.close()


def restarted(url: str, bystander: psycopg.Connection[Any]) -> None:
    """Return once the server has gone through its crash restart: the postmaster ends every other session
    (the `bystander`, opened before the crash) when it starts one, so its end is the restart's beginning;
    then it accepts connections again. (Connections accepted before the postmaster noticed the crash would
    be cut by it.)"""
    deadline = time.monotonic() + 60
    while True:
        try:
            bystander.execute("SELECT 1").fetchall()
        except psycopg.OperationalError:
            break
        if time.monotonic() > deadline:
            raise AssertionError("the server did not restart after its backend was killed")
        time.sleep(0.05)
    bystander.close()
    accepting(url)


def accepting(url: str) -> None:
    """Return once the server accepts connections again (after its crash recovery)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            psycopg.connect(url, autocommit=True).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


async def test_a_connection_reset_by_a_killed_backend_is_io_and_the_store_reconnects_once_the_server_is_back(
    own_url: str,
) -> None:
    """The writer's backend is SIGKILLed while it sleeps with the batch's next statement unread in its
    socket, so the kernel resets the connection (a socket closed with unread data sends RST; libpq reports
    "server closed the connection unexpectedly") and the postmaster restarts the server. The
    request fails `storage_io`, its first insert not committed; once the server accepts connections again
    the next request commits, on a new connection."""
    async with open_store(own_url) as store:
        await store.transact(lambda conn: conn.execute(ITEMS).rowcount)
        old = store.epoch

        def killed(conn: Connection) -> None:
            conn.execute("INSERT INTO items (id) VALUES (1)")
            conn.execute("SELECT pg_sleep(10)")  # unread: the backend sleeps...
            conn.execute("INSERT INTO items (id) VALUES (2)")  # ...with this one waiting in its socket
            time.sleep(0.2)
            os.kill(postgres_connection(conn).raw.info.backend_pid, signal.SIGKILL)
            conn.execute("SELECT 1").fetchall()

        bystander = psycopg.connect(own_url, autocommit=True)
        with nothing_internal(), pytest.raises(StorageError) as caught:
            await store.transact(killed)
        assert_storage(caught.value, "io", True)
        await trio.to_thread.run_sync(restarted, own_url, bystander)
        assert items(own_url) == []
        assert await store.transact(insert(3)) == 3
        assert store.epoch != old
    assert items(own_url) == [3]


def postgres_connection(conn: Connection) -> postgres.PgConnection:
    assert isinstance(conn, postgres.PgConnection)
    return conn


async def test_a_backend_terminated_mid_command_answers_storage_io_and_the_next_command_reconnects(
    pg_url: str, clock: FakeClock
) -> None:
    """An operator's pg_terminate_backend while the runtime's transaction waits on a row lock another
    session holds: 57P01 (admin_shutdown), `storage_io`, nothing committed; the next command runs on a new
    connection."""
    async with open_runtime(pg_url, clock=clock, busy_timeout=30) as rt:
        before = await office_task(rt)
        old = rt.epoch
        replies: list[Reply] = []
        with session(pg_url) as other, nothing_internal():
            other.execute("BEGIN")
            other.execute("SELECT 1 FROM tasks WHERE id = 'T1' FOR UPDATE")

            async def turn() -> None:
                replies.append(await send(rt, TURN))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(turn)
                pid = await trio.to_thread.run_sync(waiting_on_a_lock, pg_url)
                await trio.to_thread.run_sync(terminate, pg_url, pid)
            other.execute("ROLLBACK")
        assert_typed(replies[0], "io", True, "57P01")
        assert await snapshot(rt) == before
        await ok(rt, TURN)
        assert rt.epoch != old
        await assert_reviewed_once(rt)


# --- server shutdown, crash, restart (57P01, 57P02, 57P03) --------------------------------------------------


async def test_a_stopped_server_answers_storage_io_never_internal_and_its_return_serves_the_next_command(
    own_server: PostgresServer, own_url: str, clock: FakeClock
) -> None:
    """`pg_ctl stop -m immediate` under a runtime: the first command finds its connection lost, the next ones
    find no server to connect to (they used to enter the pipeline on the closed connection and be answered
    `internal`); all are `storage_io`, retryable. Once the server is back the next command succeeds, and
    none of the failed ones had committed anything."""
    async with open_runtime(own_url, clock=clock) as rt:
        before = await office_task(rt)
        with nothing_internal():
            await trio.to_thread.run_sync(own_server.halt)
            try:
                for message in (TURN, TURN, {"type": "get_task", "task_id": "T1"}, TURN):
                    assert_typed(await send(rt, message), "io", True)
            finally:
                await trio.to_thread.run_sync(own_server.start)
            assert await snapshot(rt) == before
            await ok(rt, TURN)
        await assert_reviewed_once(rt)


class Traffic:
    """Commands sent to runtimes in a loop (a read and a write, `create_task` with a fresh id, by turns)
    until `stop`, each reply kept with when it came."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, float, dict[str, Any], Reply]] = []
        self.stopped = trio.Event()

    async def drive(self, index: int, rt: Runtime) -> None:
        for n in itertools.count():
            if self.stopped.is_set():
                return
            message: dict[str, Any] = (
                {"type": "get_task", "task_id": "T1"}
                if n % 2
                else {"type": "create_task", "task_id": f"H{index}-{n}", "workflow_id": "office-default"}
            )
            reply = await send(rt, message)
            self.replies.append((index, time.monotonic(), message, reply))
            await trio.sleep(0.005)

    def failures(self) -> list[Reply]:
        return [reply for _, _, _, reply in self.replies if not reply.ok]

    async def failed(self, since: float) -> float:
        """When the first reply after `since` that is a failure came (waiting for it)."""
        with trio.fail_after(60):
            while True:
                times = [at for _, at, _, reply in self.replies if at >= since and not reply.ok]
                if times:
                    return min(times)
                await trio.sleep(0.01)

    def first_success_after(self, index: int, since: float) -> float | None:
        """Seconds from `since` to runtime `index`'s first successful reply after it, if any yet."""
        times = [at for i, at, _, reply in self.replies if i == index and at >= since and reply.ok]
        return min(times) - since if times else None

    async def served_again(self, count: int, since: float) -> None:
        """Wait until every one of `count` runtimes answered a command successfully after `since`."""
        with trio.fail_after(60):  # a hang, not a timing: the measured figure is what the report reads
            while any(self.first_success_after(index, since) is None for index in range(count)):
                await trio.sleep(0.05)

    async def unapplied_after_failure(self, rt: Runtime) -> int:
        """Resend each create_task that failed: it must create the task now, or find it created (a commit
        whose acknowledgement the fault swallowed); returns how many were found created."""
        found = 0
        for _, _, message, reply in self.replies:
            if not reply.ok and message["type"] == "create_task":
                again = await send(rt, message)
                assert again.ok or (again.error is not None and again.error.code == "conflict"), again
                found += not again.ok
        return found


@contextlib.asynccontextmanager
async def runtimes(url: str, clock: FakeClock, count: int) -> AsyncIterator[list[Runtime]]:
    """`count` runtimes on one database, the office task set up by the first before the others start."""
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(open_runtime(url, clock=clock))
        await office_task(first)
        rest = [await stack.enter_async_context(open_runtime(url, clock=clock)) for _ in range(count - 1)]
        yield [first, *rest]


async def test_a_crashed_server_process_every_reply_while_the_server_recovers_is_typed(
    own_server: PostgresServer, own_url: str, clock: FakeClock
) -> None:
    """SIGKILL of another backend: the postmaster ends every session (57P02, crash_shutdown, as a notice
    before it closes them) and refuses connections while it recovers (57P03, cannot_connect_now). Every
    reply meanwhile is `storage_io` (retryable), none `internal`; the runtime serves again once the server
    is back, and a write that failed committed nothing (sent again, it applies now)."""
    traffic = Traffic()
    async with runtimes(own_url, clock, 1) as [rt]:
        with nothing_internal():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(traffic.drive, 0, rt)
                await trio.sleep(0.5)
                with session(own_url) as victim:
                    os.kill(victim.info.backend_pid, signal.SIGKILL)
                crashed = time.monotonic()
                await traffic.served_again(1, await traffic.failed(crashed))
                traffic.stopped.set()
        assert traffic.failures(), "no command met the crash"
        for reply in traffic.failures():
            assert_typed(reply, "io", True)
        assert await traffic.unapplied_after_failure(rt) <= 1  # at most the one in flight at the crash


async def test_three_runtimes_through_an_immediate_restart_answer_nothing_internal_and_serve_again(
    own_server: PostgresServer, own_url: str, clock: FakeClock
) -> None:
    """`pg_ctl restart -m immediate` under three busy runtimes (the operator's 185 `internal` replies within
    a second): every reply during the restart is `storage_io`, retryable; each runtime serves again once
    the server accepts connections (the figure is printed: run with -s to read it)."""
    traffic = Traffic()
    async with runtimes(own_url, clock, 3) as rts:
        with nothing_internal():
            async with trio.open_nursery() as nursery:
                for index, rt in enumerate(rts):
                    nursery.start_soon(traffic.drive, index, rt)
                await trio.sleep(0.5)
                await trio.to_thread.run_sync(own_server.restart)
                back = time.monotonic()
                await traffic.served_again(3, back)
                traffic.stopped.set()
        recovery = [traffic.first_success_after(index, back) for index in range(3)]
        print(f"served again after the server's return: {recovery} s")
        assert traffic.failures(), "no command met the restart"
        for reply in traffic.failures():
            assert_typed(reply, "io", True)
        for rt in rts:
            await ok(rt, {"type": "get_task", "task_id": "T1"})
        assert await traffic.unapplied_after_failure(rts[0]) <= 3  # at most one in flight per runtime


# --- statement timeout, lock timeout, serialization failure, deadlock ---------------------------------------


async def test_a_statement_timeout_is_storage_busy_and_the_command_succeeds_once_the_lock_is_released(
    pg_url: str, clock: FakeClock
) -> None:
    """statement_timeout (set for the database) cancels the runtime's statement waiting on a row lock another
    session holds: 57014, `storage_busy`, retryable, nothing committed."""
    with session(pg_url) as admin:
        admin.execute(f'ALTER DATABASE "{database(pg_url)}" SET statement_timeout = 1000')
    async with open_runtime(pg_url, clock=clock, busy_timeout=30) as rt:
        before = await office_task(rt)
        epoch = rt.epoch
        with session(pg_url) as other, nothing_internal():
            other.execute("BEGIN")
            other.execute("SELECT 1 FROM tasks WHERE id = 'T1' FOR UPDATE")
            reply = await send(rt, TURN)
            other.execute("ROLLBACK")
        assert_typed(reply, "busy", True, "57014")
        assert await snapshot(rt) == before
        await ok(rt, TURN)
        assert rt.epoch == epoch  # the session survived
        await assert_reviewed_once(rt)


async def test_a_lock_timeout_is_storage_busy_and_the_command_succeeds_once_the_lock_is_released(
    pg_url: str, clock: FakeClock
) -> None:
    """A row lock held past the busy timeout (the session's lock_timeout): 55P03, `storage_busy`."""
    async with open_runtime(pg_url, clock=clock, busy_timeout=0.5) as rt:
        before = await office_task(rt)
        with session(pg_url) as other, nothing_internal():
            other.execute("BEGIN")
            other.execute("SELECT 1 FROM tasks WHERE id = 'T1' FOR UPDATE")
            reply = await send(rt, TURN)
            other.execute("ROLLBACK")
        assert_typed(reply, "busy", True, "55P03")
        assert await snapshot(rt) == before
        await ok(rt, TURN)
        await assert_reviewed_once(rt)


async def test_a_serialization_failure_is_storage_busy_and_the_retry_commits(pg_url: str) -> None:
    """Under REPEATABLE READ (the session's default), a row another session updated after the transaction's
    snapshot cannot be updated: 40001, `storage_busy`, retryable; the request's other write is not
    committed, and the same request sent again commits."""
    async with open_store(pg_url) as store:

        def setup(conn: Connection) -> None:
            conn.execute("CREATE TABLE items (id BIGINT PRIMARY KEY, name TEXT)")
            conn.execute("INSERT INTO items (id, name) VALUES (1, 'a')")
            conn.execute("SET default_transaction_isolation = 'repeatable read'")  # kept once committed

        await store.transact(setup)
        with session(pg_url) as other:
            interfered = threading.Event()

            def read_then_write(conn: Connection) -> str:
                conn.execute("INSERT INTO items (id, name) VALUES (2, 'new')")  # takes the snapshot
                name = str(conn.execute("SELECT name FROM items WHERE id = 1").fetchone()[0])
                if not interfered.is_set():
                    interfered.set()
                    other.execute("UPDATE items SET name = 'theirs' WHERE id = 1")
                conn.execute("UPDATE items SET name = ? WHERE id = 1", (name + "+mine",))
                return name

            with pytest.raises(StorageError) as caught:
                await store.transact(read_then_write)
            assert_storage(caught.value, "busy", True, "40001")
            rows = other.execute("SELECT id, name FROM items ORDER BY id").fetchall()
            assert rows == [(1, "theirs")]
            assert await store.transact(read_then_write) == "theirs"
            rows = other.execute("SELECT id, name FROM items ORDER BY id").fetchall()
            assert rows == [(1, "theirs+mine"), (2, "new")]


async def test_a_deadlock_is_storage_busy_nothing_committed_and_the_retry_commits(pg_url: str) -> None:
    """Two sessions lock two rows in opposite orders; PostgreSQL aborts the store's with 40P01."""
    async with open_store(pg_url) as store:
        await store.transact(lambda conn: conn.execute(ITEMS).rowcount)
        await store.transact(insert(1))
        await store.transact(insert(2))
        with session(pg_url) as other:
            other.execute("SET deadlock_timeout = '20s'")  # the store's session runs the check, and loses
            other.execute("BEGIN")
            other.execute("UPDATE items SET id = 20 WHERE id = 2")
            locked = threading.Event()

            def one_then_two(conn: Connection) -> None:
                conn.execute("INSERT INTO items (id) VALUES (3)")
                assert conn.execute("UPDATE items SET id = 10 WHERE id = 1").rowcount == 1  # waited for
                locked.set()
                conn.execute("UPDATE items SET id = 200 WHERE id = 2")

            def other_side() -> None:
                locked.wait(10)
                with contextlib.suppress(psycopg.errors.DeadlockDetected):
                    other.execute("UPDATE items SET id = 100 WHERE id = 1")
                other.execute("ROLLBACK")

            thread = threading.Thread(target=other_side)
            thread.start()
            try:
                with pytest.raises(StorageError) as caught:
                    await store.transact(one_then_two)
            finally:
                await trio.to_thread.run_sync(thread.join)
        assert_storage(caught.value, "busy", True, "40P01")
        assert items(pg_url) == [1, 2]
        await store.transact(one_then_two)
    assert items(pg_url) == [3, 10, 200]


# --- prepared statement gone (26000) ------------------------------------------------------------------------


async def test_prepared_statements_deallocated_behind_psycopgs_back_are_storage_aborted_once_then_rebuilt(
    pg_url: str, clock: FakeClock
) -> None:
    """psycopg prepares a statement on its sixth use; the server's prepared statements are then deallocated
    by a DO block psycopg knows nothing of. The transaction that did it fails at its next prepared statement
    (its RELEASE and COMMIT): 26000, `storage_aborted`, retryable, its update not committed. The connection
    is reset (same session, same epoch) and the next command succeeds at once."""
    async with open_runtime(pg_url, clock=clock) as rt:
        before = await office_task(rt)
        for _ in range(6):  # BEGIN, SAVEPOINT, RELEASE, COMMIT and these reads are prepared by now
            await snapshot(rt)
        epoch = rt.epoch

        def deallocate(conn: Connection) -> None:
            conn.execute("UPDATE tasks SET title = 'not committed' WHERE id = 'T1'")
            conn.execute("DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$")

        with nothing_internal():
            with pytest.raises(StorageError) as caught:
                await rt.services.store.transact(deallocate)
            assert_storage(caught.value, "aborted", True, "26000")
            assert await snapshot(rt) == before
            await ok(rt, TURN)
        assert rt.epoch == epoch
        await assert_reviewed_once(rt)
        for _ in range(6):  # and the statements it prepares afresh work
            await snapshot(rt)


def test_a_failed_pipelined_batch_leaves_no_statement_psycopg_believes_prepared(pg_url: str) -> None:
    """psycopg prepares a statement on its sixth use, and records it as prepared when it sends the PREPARE;
    in a pipeline the server skips that PREPARE when an earlier statement failed. The connection forgets
    psycopg's prepared statements after any error in a pipeline, so the seventh use does not fail with
    'prepared statement does not exist' (26000): what a full disk left behind, on the next command."""
    conn = postgres.connect(pg_url)
    try:
        conn.execute("CREATE TABLE items (id BIGINT PRIMARY KEY, name TEXT NOT NULL)")
        for _ in range(7):  # ROLLBACK itself prepared: psycopg's own reset on a rollback no longer runs
            conn.execute("BEGIN")
            conn.execute("ROLLBACK")
        for item in range(5):
            with conn.pipelined():
                conn.execute("BEGIN")
                conn.execute("INSERT INTO items (id, name) VALUES (?, 'x')", (item,))
                conn.execute("COMMIT")
        with pytest.raises(psycopg.errors.NotNullViolation), conn.pipelined():
            conn.execute("BEGIN")
            conn.execute("SAVEPOINT request")
            conn.execute("INSERT INTO items (id, name) VALUES (?, NULL)", (100,))  # fails
            conn.execute("INSERT INTO items (id, name) VALUES (?, 'x')", (101,))  # sixth use: skipped
            conn.execute("RELEASE request")
        assert conn.remedy is Remedy.RESET
        conn.reset()
        assert conn.remedy is Remedy.NONE
        for item in (102, 103):
            conn.execute("INSERT INTO items (id, name) VALUES (?, 'x')", (item,))
        assert conn.scalar("SELECT count(*) FROM items") == 7
    finally:
        conn.close()


# --- disk full (53100) --------------------------------------------------------------------------------------

REVIEWERS = [f"rev-{n:02}" for n in range(30)]
BRIEF = secrets.token_hex(
    4000
)  # 8000 characters pglz cannot shrink: each run's payload is stored out of line
BOARD = f"""
id: board
name: Board
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_turn_complete:
        - type: move_to_next
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {{role: reviewer, reason: review, payload: {{brief: "{BRIEF}"}}}}
"""


@contextlib.contextmanager
def full_tablespace(server: PostgresServer, url: str, size: str) -> Iterator[Path]:
    """A tablespace on a tmpfs volume of `size`, the default tablespace of `url`'s database (so the
    store's tables are created in it); yields the volume. Skips where a tmpfs cannot be mounted (not root).
    Afterwards the database and the tablespace are dropped and the volume unmounted."""
    name = f"small_{database(url)}"
    where = server.root / name
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-capped tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        shutil.chown(where, "postgres", "postgres")
        where.chmod(0o700)
        with session(server.url()) as admin:
            admin.execute(f"CREATE TABLESPACE {name} LOCATION '{where}'")
            admin.execute(f'ALTER DATABASE "{database(url)}" SET default_tablespace = {name}')
        yield where
        with session(server.url()) as admin:
            admin.execute(f'DROP DATABASE "{database(url)}" WITH (FORCE)')
            admin.execute(f"DROP TABLESPACE {name}")
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(volume: Path, leave: int) -> Path:
    """Grow a filler file until the volume is full (ENOSPC), then give `leave` bytes back; return it."""
    filler = volume / "filler"
    with filler.open("ab", buffering=0) as out:
        for chunk in (b"\0" * 65536, b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while True:
                    out.write(chunk)
    os.truncate(filler, filler.stat().st_size - leave)
    return filler


async def test_a_full_disk_is_storage_full_commits_nothing_and_the_command_succeeds_once_space_returns(
    own_server: PostgresServer, own_url: str, clock: FakeClock
) -> None:
    """The store's tables on a full volume: a fan-out of 30 runs fails when a file must grow (53100, at the
    first page or, with some room left, further in), `storage_full`, retryable, nothing committed. The
    failed batches were pipelined; the statements psycopg prepared meanwhile do not outlive them (no
    26000 afterwards). Once space returns the same command succeeds at once, exactly once."""
    with full_tablespace(own_server, own_url, "8m") as volume:
        async with open_runtime(own_url, clock=clock) as rt:
            await ok(rt, {"type": "register_workflow", "yaml": BOARD, "source": "board.yml"})
            for agent in REVIEWERS:
                await ok(
                    rt,
                    {
                        "type": "add_participant",
                        "workflow_id": "board",
                        "step_id": "review",
                        "role": "reviewer",
                        "agent_profile_id": agent,
                    },
                )
            await ok(rt, {"type": "create_task", "task_id": "T1", "workflow_id": "board", "step_id": "work"})
            before = await snapshot(rt)
            with nothing_internal():
                for leave in (0, 0, 32 * 1024, 0):
                    filler = fill(volume, leave)
                    reply = await send(rt, TURN)
                    assert_typed(reply, "full", True, "53100")
                    assert await snapshot(rt) == before, f"a partial commit with {leave} bytes to spare"
                filler.unlink()
                await ok(rt, TURN)
            await assert_reviewed_once(rt, REVIEWERS)


# --- out of memory (53200) ----------------------------------------------------------------------------------


async def test_a_server_out_of_memory_is_storage_out_of_memory_and_the_retry_commits(pg_url: str) -> None:
    """The store's backend may grow its address space by 64 MiB more; a request that needs 200 MB fails
    with 53200, `storage_out_of_memory`, retryable, its other write not committed. With the cap lifted the
    same session (same epoch) commits the next request."""
    async with open_store(pg_url) as store:
        await store.transact(lambda conn: conn.execute(ITEMS).rowcount)
        pid = await writer_pid(store)
        epoch = store.epoch
        status = Path(f"/proc/{pid}/status").read_text()
        size = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))

        def greedy(conn: Connection) -> int:
            conn.execute("INSERT INTO items (id) VALUES (1)")
            return int(conn.execute("SELECT length(repeat('x', 200000000))").fetchone()[0])

        limit_memory(pid, size + 64 * 2**20)
        try:
            with pytest.raises(StorageError) as caught:
                await store.transact(greedy)
        finally:
            limit_memory(pid, None)
        assert_storage(caught.value, "out_of_memory", True, "53200")
        assert items(pg_url) == []
        assert await store.transact(greedy) == 200000000
        assert store.epoch == epoch
    assert items(pg_url) == [1]


# --- read-only transaction (25006), insufficient privilege (42501) ------------------------------------------


async def test_a_database_made_read_only_is_storage_read_only_and_lifting_it_lets_the_next_command_through(
    pg_url: str, clock: FakeClock
) -> None:
    """default_transaction_read_only set on the database reaches only sessions started after it: the runtime
    reconnects into one (its session is terminated; its heartbeat reconnects). A write is 25006,
    `storage_read_only`, not retryable, nothing committed; while a new session would still be read-only the
    runtime keeps its own (and its epoch). Once the setting is lifted, the next command succeeds at once:
    the writer first replaces its session, read-only for good, by a new one."""
    db = database(pg_url)
    async with open_runtime(pg_url, clock=clock) as rt:
        before = await office_task(rt)
        with session(pg_url) as admin:
            admin.execute(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
            try:
                old = rt.epoch
                await trio.to_thread.run_sync(terminate, pg_url, await writer_pid(rt.services.store))
                with trio.fail_after(30):
                    while rt.epoch == old:
                        await trio.sleep(0.05)
                read_only_epoch = rt.epoch
                with nothing_internal():
                    reply = await send(rt, TURN)
                assert_typed(reply, "read_only", False, "25006")
                assert await snapshot(rt) == before
                assert_typed(await send(rt, TURN), "read_only", False, "25006")
                assert rt.epoch == read_only_epoch
            finally:
                admin.execute(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')
        await ok(rt, TURN)
        assert rt.epoch != read_only_epoch
        await assert_reviewed_once(rt)


async def test_a_revoked_privilege_is_storage_read_only_and_a_grant_lets_the_next_command_through(
    postgres_server: PostgresServer, clock: FakeClock
) -> None:
    """The runtime connects as a role of its own; INSERT on runs revoked from it: 42501, `storage_read_only`,
    not retryable, nothing committed. Granted again, the next command succeeds at once, in the same
    session."""
    name = f"priv_{secrets.token_hex(4)}"
    with session(postgres_server.url()) as admin:
        admin.execute(f'CREATE ROLE "{name}" LOGIN')
        admin.execute(f'CREATE DATABASE "{name}" OWNER "{name}"')
    async with open_runtime(
        f"postgresql://{name}@127.0.0.1:{postgres_server.port}/{name}", clock=clock
    ) as rt:
        before = await office_task(rt)
        epoch = rt.epoch
        with session(postgres_server.url(name)) as admin:
            admin.execute(f'REVOKE INSERT ON runs FROM "{name}"')
            with nothing_internal():
                reply = await send(rt, TURN)
            assert_typed(reply, "read_only", False, "42501")
            assert await snapshot(rt) == before
            admin.execute(f'GRANT INSERT ON runs TO "{name}"')
        await ok(rt, TURN)
        assert rt.epoch == epoch
        await assert_reviewed_once(rt)
