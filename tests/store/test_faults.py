"""Storage faults in the store: their classification, savepoints on a dead transaction, and group commit.

After an error that ends the transaction, the whole request and every request of
its batch fail, none is told it succeeded, and nothing is written outside BEGIN ... COMMIT.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from onceflow.protocol.errors import StorageError
from onceflow.store.backends import faults
from onceflow.store.backends.savepoint import savepoint
from onceflow.store.writer import StoreActor, open_store

BIG = 20_000  # bytes: always needs new (overflow) pages


@contextmanager
def scratch(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A plain WAL connection on a real file with one table `t`, in autocommit mode."""
    conn = sqlite3.connect(tmp_path / "scratch.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
    try:
        yield conn
    finally:
        conn.close()


def fill_up(conn: sqlite3.Connection) -> None:
    """Cap the database at its current size, so any new page is SQLITE_FULL."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages}").fetchone()


def rows(conn: sqlite3.Connection, table: str = "t") -> int:
    return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


# --- classification -------------------------------------------------------------------------------


def test_a_full_database_is_kind_full_ends_the_transaction_and_is_retryable(tmp_path: Path) -> None:
    with scratch(tmp_path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (1)")
        fill_up(conn)
        with pytest.raises(sqlite3.OperationalError) as caught:
            conn.execute("INSERT INTO t VALUES (randomblob(?))", (BIG,))
        assert faults.storage_kind(caught.value) == "full"
        assert faults.ends_transaction(conn, caught.value)
        assert not conn.in_transaction  # SQLite rolled everything back, the first insert too
        assert rows(conn) == 0
        error = faults.storage_error(caught.value)
        assert (error.code, error.kind, error.retryable) == ("storage_full", "full", True)


def test_a_busy_database_is_kind_busy_and_retryable(tmp_path: Path) -> None:
    with scratch(tmp_path) as holder, scratch(tmp_path) as waiter:
        holder.execute("BEGIN IMMEDIATE")
        waiter.execute("PRAGMA busy_timeout=10")
        with pytest.raises(sqlite3.OperationalError) as caught:
            waiter.execute("BEGIN IMMEDIATE")
        assert faults.storage_kind(caught.value) == "busy"
        assert faults.storage_error(caught.value).retryable


def test_errors_that_are_not_storage_faults_keep_their_own_type(tmp_path: Path) -> None:
    with scratch(tmp_path) as conn:
        conn.execute("CREATE TABLE u (x UNIQUE)")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO u VALUES (1)")
        with pytest.raises(sqlite3.IntegrityError) as constraint:
            conn.execute("INSERT INTO u VALUES (1)")
        with pytest.raises(sqlite3.OperationalError) as syntax:
            conn.execute("SELEKT 1")
        for error in (constraint.value, syntax.value, sqlite3.OperationalError("raised by our own code")):
            assert faults.storage_kind(error) is None
            assert not faults.ends_transaction(conn, error)  # the transaction is alive: a savepoint can go on
        conn.execute("ROLLBACK")


@pytest.mark.parametrize(
    ("kind", "retryable"),
    [
        ("busy", True),
        ("full", True),
        ("io", True),
        ("out_of_memory", True),
        ("aborted", True),
        ("read_only", False),
        ("corrupt", False),
    ],
)
def test_storage_error_says_whether_a_retry_can_help(kind: str, retryable: bool) -> None:
    error = StorageError(kind, "detail")  # type: ignore[arg-type]
    assert (error.code, error.retryable) == (f"storage_{kind}", retryable)
    assert "detail" in error.message and ("retry once" in error.message) == retryable


# --- savepoints on a dead transaction ---------------------------------------------------------------


def test_savepoint_reraises_a_transaction_ending_error_without_touching_the_dead_transaction(
    tmp_path: Path,
) -> None:
    with scratch(tmp_path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        fill_up(conn)
        with pytest.raises(sqlite3.OperationalError) as caught, savepoint(conn, "sp"):
            conn.execute("INSERT INTO t VALUES (randomblob(?))", (BIG,))
        # The original SQLITE_FULL, not "no such savepoint" from a ROLLBACK TO on nothing.
        assert faults.primary_code(caught.value) == sqlite3.SQLITE_FULL
        assert not conn.in_transaction


def test_savepoint_whose_block_swallowed_a_transaction_ending_error_does_not_release_as_if_all_were_well(
    tmp_path: Path,
) -> None:
    with scratch(tmp_path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        fill_up(conn)
        with (
            pytest.raises(faults.DatabaseFault, match="transaction ended inside savepoint sp") as ended,
            savepoint(conn, "sp"),
            contextlib.suppress(sqlite3.Error),  # the catch-and-continue shape that once hid a fault
        ):
            conn.execute("INSERT INTO t VALUES (randomblob(?))", (BIG,))
    assert ended.value.kind == "aborted"


def test_savepoint_still_rolls_back_only_its_block_after_an_ordinary_error(tmp_path: Path) -> None:
    with scratch(tmp_path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(ValueError), savepoint(conn, "sp"):
            conn.execute("INSERT INTO t VALUES (2)")
            raise ValueError("one action failed")
        conn.execute("COMMIT")
        assert [r[0] for r in conn.execute("SELECT x FROM t")] == [1]


# --- the writer: group commit --------------------------------------------------------------------


def insert(name: str, size: int = 0) -> Callable[[sqlite3.Connection], str]:
    def fn(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO kv VALUES (?, zeroblob(?))", (name, size))
        return name

    return fn


def swallowing(name: str) -> Callable[[sqlite3.Connection], str]:
    """A request that catches the disk-full error and carries on, as the fan-out once did."""

    def fn(conn: sqlite3.Connection) -> str:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("INSERT INTO kv VALUES (?, zeroblob(?))", (name, BIG))
        return name

    return fn


async def names(store: StoreActor) -> set[str]:
    return await store.transact(lambda conn: {r[0] for r in conn.execute("SELECT name FROM kv")})


async def run_batch(store: StoreActor, fns: list[Callable[[sqlite3.Connection], str]]) -> list[object]:
    """Queue `fns` behind a blocked writer so that they run as one batch; each one's result or error."""
    results: list[object] = [None] * len(fns)
    started, release = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        started.set()
        release.wait(10)

    async def call(index: int) -> None:
        try:
            results[index] = await store.transact(fns[index])
        except Exception as exc:
            results[index] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.transact, hold)
        with trio.fail_after(5):
            while not started.is_set():
                await trio.sleep(0.001)
        for index in range(len(fns)):
            nursery.start_soon(call, index)
            await trio.testing.wait_all_tasks_blocked()  # queued in this order
        release.set()
    return results


@pytest.mark.parametrize("offender", ["raises", "swallows"])
async def test_a_transaction_ending_error_fails_every_request_of_its_batch_and_commits_none(
    tmp_path: Path, offender: str
) -> None:
    async with open_store(tmp_path / "o.db", max_batch=32) as store:
        await store.transact(lambda conn: conn.execute("CREATE TABLE kv (name TEXT, value BLOB)").fetchall())
        await store.transact(fill_up)
        bad = insert("bad", BIG) if offender == "raises" else swallowing("bad")
        results = await run_batch(store, [insert("before"), bad, insert("after")])

        assert all(isinstance(r, StorageError) and r.retryable for r in results), results
        kinds = {r.code for r in results if isinstance(r, StorageError)}
        # A raised SQLITE_FULL is named; a swallowed one is known only by the transaction having ended.
        assert kinds == ({"storage_full"} if offender == "raises" else {"storage_aborted"})
        assert isinstance(results[0], StorageError) and "another request of its batch" in results[0].message
        assert await names(store) == set()  # "after" never ran in autocommit mode; "before" was rolled back

        # The store keeps serving, and a retry once space returns is exact.
        await store.transact(lambda conn: conn.execute(f"PRAGMA max_page_count={2**32 - 2}").fetchone())
        assert await run_batch(store, [insert("before"), insert("bad", BIG), insert("after")]) == [
            "before",
            "bad",
            "after",
        ]
        assert await names(store) == {"before", "bad", "after"}


async def test_an_ordinary_error_in_a_batch_still_fails_only_its_own_request(tmp_path: Path) -> None:
    def broken(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO kv VALUES ('broken', NULL)")
        raise ValueError("not a storage fault")

    async with open_store(tmp_path / "o.db", max_batch=32) as store:
        await store.transact(lambda conn: conn.execute("CREATE TABLE kv (name TEXT, value BLOB)").fetchall())
        results = await run_batch(store, [insert("a"), broken, insert("b")])
        assert results[0] == "a" and results[2] == "b" and isinstance(results[1], ValueError)
        assert await names(store) == {"a", "b"}


async def test_a_busy_database_fails_each_request_as_storage_busy(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    async with open_store(path, max_batch=32, busy_timeout=0.05) as store:
        await store.transact(lambda conn: conn.execute("CREATE TABLE kv (name TEXT, value BLOB)").fetchall())
        results: list[Exception] = []

        async def call(fn: Callable[[sqlite3.Connection], str]) -> None:
            with pytest.raises(StorageError) as caught:
                await store.transact(fn)
            results.append(caught.value)

        other = sqlite3.connect(path, isolation_level=None)  # another writer, not through our store
        other.execute("BEGIN IMMEDIATE")
        try:
            async with trio.open_nursery() as nursery:
                for name in ("a", "b", "c"):
                    nursery.start_soon(call, insert(name))
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert [(getattr(r, "code", r), getattr(r, "retryable", None)) for r in results] == [
            ("storage_busy", True)
        ] * 3
        assert all(isinstance(r.__cause__, sqlite3.OperationalError) for r in results)
        assert await names(store) == set()
        assert await store.transact(insert("a")) == "a"  # the lock is gone: it serves again


@pytest.mark.parametrize("busy_timeout", [0.0, -1.0, math.nan, math.inf])
async def test_busy_timeout_must_be_finite_and_positive(tmp_path: Path, busy_timeout: float) -> None:
    with pytest.raises(ValueError, match="busy_timeout"):
        async with open_store(tmp_path / "o.db", busy_timeout=busy_timeout):
            pass
