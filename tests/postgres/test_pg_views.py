"""The read-only views on PostgreSQL.

`onceflow tasks|runs|entries|decisions|outcomes --db postgresql://…` shows the same rows as on SQLite,
reads beside live runtimes without blocking them, runs in a session that cannot write, and reports each way
a database cannot be read as one `error:` line and exit 2, never with the password. Real server
(tests/pg_support.py), nothing mocked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from helpers import START, FakeClock, decide, ok, register, setup_office, to_review
from pg_support import PostgresServer, freeze_server_clock
from trio.testing import MockClock

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli.main import main
from onceflow.cli.views import TASK_SCOPED, VIEWS, ViewError, open_read_only, rows
from onceflow.store.backends import schema
from onceflow.store.outcomes import outcomes
from onceflow.testing import RecordingCoordinator, RecordingHost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "outcome"))
from outcome_support import ack, envelope, ready, state, within_real_time

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "kandev"
PASSWORD = "s3cr%20et"  # percent-encoded in the URL: libpq sees "s3cr et"


async def _fill(rt: Runtime) -> None:
    """The same commands on either backend: tasks at several steps, runs, entries, decisions, outcomes."""
    await setup_office(rt, TEMPLATES / "office-default.yml")
    await to_review(rt, "T1")
    await decide(rt, "T1", "review", "rev-a", "approved")
    await to_review(rt, "T2")
    await decide(rt, "T2", "review", "rev-a", "approved")
    await decide(rt, "T2", "review", "rev-b", "rejected")
    await ok(
        rt, {"type": "create_task", "task_id": "T3", "workflow_id": "office-default", "title": "a\nb\x1b"}
    )
    first, second = envelope(work_id="gc-1"), envelope(work_id="gc-2")

    async def delivered(outcome_id: str) -> dict[str, Any]:
        while (got := await state(rt, outcome_id))["phase"] != outcomes.NEEDS_ACK:
            await trio.testing.wait_all_tasks_blocked()
        return got

    # One after the other: delivered concurrently, which one the coordinator numbers first depends on the
    # scheduling of the moment, and the two databases' views would differ by that alone.
    await ready(rt, first)
    fence = (await within_real_time(lambda: delivered(first["outcome_id"])))["coordinator_fence"]
    await ready(rt, second)
    await within_real_time(lambda: delivered(second["outcome_id"]))
    await ok(rt, ack(first, fence))


async def _filled(db: Path | str) -> None:
    async with open_runtime(
        db, host=RecordingHost(), clock=FakeClock(), coordinator=RecordingCoordinator()
    ) as rt:
        await _fill(rt)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`onceflow ARGS` in another process, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


async def test_every_view_on_postgres_shows_the_rows_and_table_it_shows_on_sqlite(
    pg_url: str, tmp_path: Path, mock_clock: MockClock
) -> None:
    """Trio's clock stands still and the server's stands at `START`, the wall clock's reading: both
    databases get the same times."""
    freeze_server_clock(pg_url, START)
    sqlite_db = tmp_path / "board.db"
    await _filled(sqlite_db)
    await _filled(pg_url)
    for view in (v for v in VIEWS if v != "queue"):  # the queue's ages are each reader's clock's
        for extra in ([], ["--task", "T2"]) if view in TASK_SCOPED else ([],):
            for shape in (["--json"], []):
                on_sqlite = await trio.to_thread.run_sync(_cli, view, "--db", str(sqlite_db), *extra, *shape)
                on_pg = await trio.to_thread.run_sync(_cli, view, "--db", pg_url, *extra, *shape)
                assert on_sqlite.returncode == on_pg.returncode == 0, (on_sqlite.stderr, on_pg.stderr)
                assert on_pg.stdout == on_sqlite.stdout, (view, extra, shape)
                assert len(on_sqlite.stdout.splitlines()) > (0 if shape else 1), (
                    view,
                    extra,
                )  # never vacuous
    queues = [
        [
            {k: v for k, v in json.loads(line).items() if k != "oldest_age_s"}
            for line in out.stdout.splitlines()
        ]
        for out in (_cli("queue", "--db", str(sqlite_db), "--json"), _cli("queue", "--db", pg_url, "--json"))
    ]
    assert queues[0] == queues[1] and queues[0]
    shown = [json.loads(line) for line in _cli("outcomes", "--db", pg_url, "--json").stdout.splitlines()]
    assert sorted(row["phase"] for row in shown) == sorted([outcomes.ACKNOWLEDGED, outcomes.NEEDS_ACK])


async def test_views_read_beside_live_runtimes_without_blocking_them(pg_url: str) -> None:
    """Two runtimes serve the database. While a view's read transaction is open, both runtimes' commands
    complete (a view takes no lock a runtime waits for); then views run in a loop beside the runtimes'
    commands, and every view and every command succeeds."""
    async with (
        open_runtime(pg_url, host=RecordingHost()) as first,
        open_runtime(pg_url, host=RecordingHost()) as second,
    ):
        await setup_office(first, TEMPLATES / "office-default.yml")
        template = TEMPLATES / "office-default.yml"
        await register(second, template.read_text(encoding="utf-8"), template.name)  # idempotent
        with open_read_only(pg_url) as held:  # a view mid-read: its transaction and snapshot still open
            for view in VIEWS:
                rows(held, view)
            with trio.fail_after(10):  # the runtimes' lock_timeout is 5 s: a lock wait would fail them
                await to_review(first, "held")
                await decide(second, "held", "review", "rev-a", "approved")
            assert rows(held, "tasks") == []  # the view's one snapshot, taken before
        done = trio.Event()
        viewed: list[int] = []

        async def views() -> None:
            while not done.is_set():
                for view in VIEWS:
                    result = await trio.to_thread.run_sync(_cli, view, "--db", pg_url, "--json")
                    assert result.returncode == 0, result.stderr
                    viewed.append(len(result.stdout.splitlines()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(views)
            with trio.fail_after(60):
                for n in range(12):
                    rt = (first, second)[n % 2]
                    await to_review(rt, f"T{n}")
                    await decide((second, first)[n % 2], f"T{n}", "review", "rev-a", "approved")
                    await trio.sleep(0.05)
                while len(viewed) < 2 * len(VIEWS):  # some views ran while the commands did
                    await trio.sleep(0.05)
            done.set()
        final = _cli("tasks", "--db", pg_url, "--json")
        assert len(final.stdout.splitlines()) == 13
        assert max(viewed) > 0


async def test_a_view_session_is_read_only_and_cannot_write(pg_url: str) -> None:
    await _filled(pg_url)
    with open_read_only(pg_url) as conn:
        assert conn.execute("SHOW transaction_read_only").fetchone() == ("on",)
        assert conn.execute("SHOW default_transaction_read_only").fetchone() == ("on",)
        with pytest.raises(Exception, match="read-only transaction"):
            conn.execute("UPDATE tasks SET title = 'x'")
    with open_read_only(pg_url) as conn:  # not even after ending the view's transaction
        conn.execute("ROLLBACK")
        with pytest.raises(Exception, match="read-only transaction"):
            conn.execute("DELETE FROM tasks")
    with psycopg.connect(pg_url) as check:
        assert check.execute("SELECT count(*) FROM tasks WHERE title = 'x'").fetchone() == (0,)
        assert check.execute("SELECT count(*) FROM tasks").fetchone() == (3,)


async def test_views_hold_no_advisory_lock_and_mint_no_epoch(pg_url: str) -> None:
    await _filled(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as check:
        epochs_before = check.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
        with open_read_only(pg_url) as conn:
            conn.execute("SELECT count(*) FROM tasks").fetchone()
            mine = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert mine is not None
            held = check.execute(
                "SELECT locktype, mode FROM pg_locks WHERE pid = %s AND granted", (mine[0],)
            ).fetchall()
            assert ("advisory", "ExclusiveLock") not in held and all(t != "advisory" for t, _ in held)
            assert all(mode in ("AccessShareLock", "ExclusiveLock") for _, mode in held), held
        epochs_after = check.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()
        assert epochs_after == epochs_before


@pytest.fixture
def credentialed(postgres_server: PostgresServer) -> Callable[[str], str]:
    """A role `viewer` whose password the server checks (scram), and a URL for it given a password."""
    admin = postgres_server.url()
    with psycopg.connect(admin, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'viewer'").fetchone() is None:
            conn.execute("CREATE ROLE viewer LOGIN PASSWORD 's3cr et'")
            hba = postgres_server.data / "pg_hba.conf"
            hba.write_text("host all viewer 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
            conn.execute("SELECT pg_reload_conf()")
    return lambda password: f"postgresql://viewer:{password}@127.0.0.1:{postgres_server.port}/postgres"


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


async def test_view_errors_are_one_line_exit_2_never_the_password(
    pg_url: str,
    postgres_server: PostgresServer,
    credentialed: Callable[[str], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    await _filled(pg_url)
    port = postgres_server.port
    cases: list[tuple[str, str, str]] = [
        (f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/postgres", "unreachable", "cannot reach"),
        (
            f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/x?bogus=1",
            "bad_url",
            "not a valid PostgreSQL URL",
        ),
        (f"postgresql://postgres:{PASSWORD}@127.0.0.1:nope/x", "bad_url", "not a valid PostgreSQL URL"),
        (
            f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/postgres",
            "not_onceflow",
            "not an onceflow database",
        ),
        (f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/absent", "missing", "no database at"),
        (credentialed("wrong%20pw"), "credentials", "refused the credentials"),
        (
            f"postgresql://nobody:{PASSWORD}@127.0.0.1:{port}/postgres",
            "credentials",
            "refused the credentials",
        ),
    ]
    for url, kind, words in cases:
        for view in VIEWS:
            line = _one_error_line(capsys, [view, "--db", url])
            assert words in line, (url, line)
            assert "s3cr" not in line and "wrong" not in line, line
        with pytest.raises(ViewError) as caught, open_read_only(url):
            pass
        assert caught.value.kind == kind, (url, str(caught.value))
    # The right password without the right to read the tables: refused too, one line.
    viewer = credentialed("s3cr%20et").rsplit("/", 1)[0] + "/" + pg_url.rsplit("/", 1)[1]
    assert "refused the credentials" in _one_error_line(capsys, ["tasks", "--db", viewer])
    # Granted, it reads the database (so "credentials" above was the password, nothing else).
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("GRANT SELECT ON ALL TABLES IN SCHEMA public TO viewer")
    assert main(["tasks", "--db", viewer, "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


async def test_views_refuse_another_schema_version_on_postgres(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _filled(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE onceflow_meta SET version = %s", (schema.SCHEMA_VERSION + 1,))
    line = _one_error_line(capsys, ["runs", "--db", pg_url])
    assert f"newer than this onceflow's {schema.SCHEMA_VERSION}" in line
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM onceflow_meta").fetchone() == (schema.SCHEMA_VERSION + 1,)
