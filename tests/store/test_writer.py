"""The store actor against a real SQLite file under a real Trio run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from onceflow.store.backends.lock import DatabaseOwnedError
from onceflow.store.backends.schema import SCHEMA_VERSION
from onceflow.store.writer import Durability, StoreActor, StoreClosedError, open_store


def add_workflow(workflow_id: str) -> Callable[[sqlite3.Connection], str]:
    def fn(conn: sqlite3.Connection) -> str:
        conn.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at)"
            " VALUES (?, 'w', 'test', '{}', 0)",
            (workflow_id,),
        )
        return workflow_id

    return fn


def workflow_ids(conn: sqlite3.Connection) -> set[str]:
    return {row[0] for row in conn.execute("SELECT id FROM workflows")}


def block_writer(store: StoreActor, nursery: trio.Nursery) -> tuple[threading.Event, threading.Event]:
    """Occupy the writer thread until the returned `release` is set; `started` is set once it is busy."""
    started, release = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        started.set()
        release.wait(10)

    nursery.start_soon(store.transact, hold)
    return started, release


async def wait_for(event: threading.Event) -> None:
    with trio.fail_after(5):
        while not event.is_set():
            await trio.sleep(0.001)


async def test_open_applies_migrations_and_pragmas(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db") as store:
        assert re.fullmatch(r"[0-9a-f]{32}", store.epoch)
        assert store.durability is Durability.FULL

        def inspect(conn: sqlite3.Connection) -> tuple[int, str, int, int, set[str]]:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            return (
                conn.execute("PRAGMA user_version").fetchone()[0],
                conn.execute("PRAGMA journal_mode").fetchone()[0],
                conn.execute("PRAGMA foreign_keys").fetchone()[0],
                conn.execute("PRAGMA temp_store").fetchone()[0],
                tables,
            )

        version, mode, fks, temp_store, tables = await store.transact(inspect)
    assert version == SCHEMA_VERSION
    assert mode == "wal"
    assert fks == 1
    assert temp_store == 2  # MEMORY
    assert {"workflows", "tasks", "participants", "decisions", "runs", "step_entries"} <= tables
    assert "step_entry_markers" in tables


def sqlite_temporary_files() -> list[str]:
    """SQLite's temporary files this process holds open (`etilqs_*`: unlinked once created, so seen only
    through their descriptors)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            if "etilqs_" in (target := os.readlink(f"/proc/self/fd/{fd}")):
                found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")
async def test_a_request_savepoint_journal_stays_in_memory(tmp_path: Path) -> None:
    """A request runs in a savepoint whose journal keeps every page the request changes. With
    SQLite's default temp_store it spills past 64 KiB into a temporary file, created and unlinked per spill
    (about one entry in three at 1 task). A request rewriting ~40 pages holds no such file."""
    async with open_store(tmp_path / "o.db") as store:

        def fill(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT INTO workflows (id, name, source, definition, registered_at)"
                " VALUES (?, 'w', ?, '{}', 0)",
                ((f"w{i}", "x" * 3000) for i in range(40)),
            )

        def rewrite(conn: sqlite3.Connection) -> list[str]:
            assert conn.execute("UPDATE workflows SET source = ?", ("y" * 3000,)).rowcount == 40
            return sqlite_temporary_files()  # the savepoint is still open: a spilled journal would be too

        await store.transact(fill)
        assert await store.transact(rewrite) == []


async def test_each_open_mints_a_fresh_epoch(tmp_path: Path) -> None:
    epochs = set()
    for _ in range(3):
        async with open_store(tmp_path / "o.db") as store:
            epochs.add(store.epoch)
    assert len(epochs) == 3


async def test_foreign_keys_cascade_from_tasks(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db") as store:

        def seed(conn: sqlite3.Connection) -> None:
            add_workflow("wf")(conn)
            conn.execute(
                "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
                " VALUES ('t1', 'wf', 's1', 0, 0)"
            )
            conn.execute(
                "INSERT INTO decisions (task_id, step_id, decider_type, decider_id, decision, created_at)"
                " VALUES ('t1', 's1', 'agent', 'a1', 'approved', 0)"
            )

        await store.transact(seed)

        def delete_task(conn: sqlite3.Connection) -> int:
            conn.execute("DELETE FROM tasks WHERE id = 't1'")
            return int(conn.execute("SELECT count(*) FROM decisions").fetchone()[0])

        assert await store.transact(delete_task) == 0

        def orphan(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
                " VALUES ('t2', 'no-such-workflow', 's1', 0, 0)"
            )

        with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
            await store.transact(orphan)


@pytest.mark.parametrize(("durability", "level"), [(Durability.FULL, 2), (Durability.NORMAL, 1)])
async def test_durability_sets_synchronous(tmp_path: Path, durability: Durability, level: int) -> None:
    async with open_store(tmp_path / "o.db", durability=durability) as store:
        assert store.durability is durability
        assert await store.transact(lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0]) == level


async def test_bad_settings_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        async with open_store(tmp_path / "o.db", durability="OFF"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError):
        async with open_store(tmp_path / "o.db", max_batch=0):
            pass


async def test_raising_fn_rolls_back_and_store_keeps_serving(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db") as store:

        def half_then_fail(conn: sqlite3.Connection) -> None:
            add_workflow("doomed")(conn)
            raise LookupError("boom")

        with pytest.raises(LookupError, match="boom"):
            await store.transact(half_then_fail)
        assert await store.transact(add_workflow("kept")) == "kept"
        assert await store.transact(workflow_ids) == {"kept"}


async def test_setup_failure_is_raised_by_open_and_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this onceflow"):
        async with open_store(path):
            pytest.fail("open must not succeed")
    path.unlink()
    async with open_store(path) as store:
        assert await store.transact(lambda conn: conn.execute("PRAGMA user_version").fetchone()[0]) == (
            SCHEMA_VERSION
        )


async def test_cancelled_caller_still_learns_its_running_transaction_committed(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db") as store:
        started, release = threading.Event(), threading.Event()
        got: list[str] = []

        def slow_insert(conn: sqlite3.Connection) -> str:
            add_workflow("slow")(conn)
            started.set()
            release.wait(10)
            return "committed"

        async def caller(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                got.append(await store.transact(slow_insert))
                await trio.lowlevel.checkpoint()  # the cancellation lands here, after the result
            assert scope.cancelled_caught

        async with trio.open_nursery() as nursery:
            scope = await nursery.start(caller)
            await wait_for(started)
            scope.cancel()
            await trio.sleep(0.05)
            assert got == []  # still waiting, shielded, while its transaction runs
            release.set()
        assert got == ["committed"]
        # Not locked, not half-applied: the next transaction runs and sees the row.
        assert await store.transact(workflow_ids) == {"slow"}
        await store.transact(add_workflow("after"))
    with sqlite3.connect(tmp_path / "o.db") as check:
        assert workflow_ids(check) == {"slow", "after"}
    check.close()


async def test_cancelled_caller_still_learns_its_queued_transaction_committed(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db") as store:
        errors: list[BaseException] = []
        got: list[str | None] = []

        def fails(conn: sqlite3.Connection) -> None:
            add_workflow("never")(conn)
            raise KeyError("queued failure")

        async def caller(
            fn: Callable[[sqlite3.Connection], str | None], task_status: trio.TaskStatus[trio.CancelScope]
        ) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                try:
                    got.append(await store.transact(fn))
                except KeyError as exc:
                    errors.append(exc)

        async with trio.open_nursery() as nursery:
            started, release = block_writer(store, nursery)
            await wait_for(started)
            ok_scope = await nursery.start(caller, add_workflow("queued"))
            bad_scope = await nursery.start(caller, fails)
            ok_scope.cancel()
            bad_scope.cancel()
            await trio.sleep(0.05)
            assert got == [] and errors == []
            release.set()
        assert got == ["queued"]
        assert len(errors) == 1
        assert await store.transact(workflow_ids) == {"queued"}


@pytest.mark.parametrize("max_batch", [1, 32])
async def test_many_concurrent_callers_all_commit(tmp_path: Path, max_batch: int) -> None:
    async with open_store(tmp_path / "o.db", max_batch=max_batch) as store:
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(store.transact, add_workflow(f"wf{i}"))
        assert await store.transact(workflow_ids) == {f"wf{i}" for i in range(200)}


async def test_batch_failure_of_one_fn_keeps_the_others(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db", max_batch=32) as store:
        results: dict[str, object] = {}

        def bad(conn: sqlite3.Connection) -> None:
            add_workflow("bad")(conn)
            raise ValueError("bad fn")

        async def call(name: str, fn: Callable[[sqlite3.Connection], object]) -> None:
            try:
                results[name] = await store.transact(fn)
            except ValueError as exc:
                results[name] = exc

        async with trio.open_nursery() as nursery:
            started, release = block_writer(store, nursery)
            await wait_for(started)
            for i in range(10):
                nursery.start_soon(call, f"ok{i}", add_workflow(f"ok{i}"))
            nursery.start_soon(call, "bad", bad)
            await trio.testing.wait_all_tasks_blocked()  # all 11 are queued behind the blocker: one batch
            release.set()
        assert isinstance(results.pop("bad"), ValueError)
        assert results == {f"ok{i}": f"ok{i}" for i in range(10)}
        assert await store.transact(workflow_ids) == {f"ok{i}" for i in range(10)}


async def test_batch_commit_failure_fails_every_request_in_it(tmp_path: Path) -> None:
    async with open_store(tmp_path / "o.db", max_batch=32) as store:
        outcomes: list[object] = []

        def dangling_task(conn: sqlite3.Connection) -> None:
            # Deferred checks move the foreign key violation to COMMIT, failing the whole batch there.
            conn.execute("PRAGMA defer_foreign_keys = ON")
            conn.execute(
                "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
                " VALUES ('t', 'missing', 's', 0, 0)"
            )

        async def call(fn: Callable[[sqlite3.Connection], object]) -> None:
            try:
                outcomes.append(await store.transact(fn))
            except sqlite3.IntegrityError as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as nursery:
            started, release = block_writer(store, nursery)
            await wait_for(started)
            nursery.start_soon(call, add_workflow("innocent"))
            nursery.start_soon(call, dangling_task)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert len(outcomes) == 2
        assert all(isinstance(o, sqlite3.IntegrityError) for o in outcomes)
        assert await store.transact(workflow_ids) == set()
        assert await store.transact(add_workflow("later")) == "later"


async def test_second_open_fails_at_once_and_reopen_after_close_works(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    async with open_store(path) as store:
        await store.transact(add_workflow("first"))
        began = time.monotonic()
        with pytest.raises(DatabaseOwnedError, match="already owned") as info:
            async with open_store(path):
                pytest.fail("second open must not succeed")
        assert time.monotonic() - began < 1.0
        assert str(path) in str(info.value)
        assert await store.transact(workflow_ids) == {"first"}  # the owner is undisturbed
    async with open_store(path) as again:
        assert await again.transact(workflow_ids) == {"first"}


async def test_a_missing_directory_is_an_error_and_no_folder_is_created(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "o.db"
    with pytest.raises(FileNotFoundError) as info:
        async with open_store(path):
            pytest.fail("a store opened in a folder that does not exist")
    assert info.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []


async def test_close_drains_queued_requests_then_refuses(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    got: list[str] = []

    async def call(store: StoreActor, name: str) -> None:
        got.append(await store.transact(add_workflow(name)))

    async with trio.open_nursery() as nursery, open_store(path) as store:
        started, release = block_writer(store, nursery)
        await wait_for(started)
        for i in range(5):
            nursery.start_soon(call, store, f"q{i}")
        await trio.testing.wait_all_tasks_blocked()

        async def release_soon() -> None:
            await trio.sleep(0.05)
            with pytest.raises(StoreClosedError):  # closing: no longer accepting
                await store.transact(add_workflow("late"))
            release.set()

        nursery.start_soon(release_soon)
    assert sorted(got) == [f"q{i}" for i in range(5)]
    with pytest.raises(StoreClosedError):
        await store.transact(add_workflow("after-close"))
    async with open_store(path) as again:  # leaving the block ran the queued requests before closing
        assert await again.transact(workflow_ids) == {f"q{i}" for i in range(5)}


def test_a_second_interrupt_while_closing_waits_for_the_writer_before_it_is_raised(tmp_path: Path) -> None:
    # KeyboardInterrupt reaches a parked main task even under a shield: the store's exit holds it until the
    # writer has stopped, so the file lock is never released (nor the process left) under a live writer.
    child = Path(__file__).with_name("close_interrupt_child.py")
    result = subprocess.run(
        [sys.executable, str(child), str(tmp_path / "o.db")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"keyboard_interrupt": True, "writer_alive": False}
    conn = sqlite3.connect(tmp_path / "o.db")
    try:
        assert workflow_ids(conn) == {"held"}  # the request ahead of the stop committed
    finally:
        conn.close()
