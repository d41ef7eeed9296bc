"""Read-only views of a live database, and the paged `list_tasks` query."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import create_task, decide, ok, send, to_review
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli import views
from onceflow.cli.main import main
from onceflow.store import bulk
from onceflow.store.backends import schema
from onceflow.store.backends.lock import DatabaseOwnedError
from onceflow.store.tasks import tasks


async def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """`onceflow ARGS` in another process (as an operator would run it beside a live host)."""
    return await trio.run_process(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_views_read_a_database_while_a_runtime_owns_it(office: Runtime, db_path: Path) -> None:
    await to_review(office, "T1")
    await decide(office, "T1", "review", "rev-a", "approved")
    await create_task(office, "T2")

    listed = await _cli("tasks", "--db", str(db_path), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.decode().splitlines()]
    assert [(r["task_id"], r["step_id"]) for r in rows] == [("T1", "review"), ("T2", "backlog")]

    runs = await _cli("runs", "--db", str(db_path), "--task", "T1")
    table = runs.stdout.decode().splitlines()
    assert runs.returncode == 0, runs.stderr
    assert table[0].split()[:4] == ["id", "task_id", "step_id", "agent_profile_id"]
    assert sorted(line.split()[3] for line in table[1:]) == ["rev-a", "rev-b"]

    decisions = await _cli("decisions", "--db", str(db_path), "--json")
    assert [json.loads(line)["decider_id"] for line in decisions.stdout.decode().splitlines()] == ["rev-a"]
    entries = await _cli("entries", "--db", str(db_path), "--task", "T1", "--json")
    shown = [json.loads(line) for line in entries.stdout.decode().splitlines()]
    assert [(e["step_id"], e["entry_seq"]) for e in shown] == [
        ("review", 1),
        ("work", None),
    ]  # work: no record

    # The runtime still owns the file and keeps serving: the views took no lock and wrote nothing.
    with pytest.raises(DatabaseOwnedError):
        async with open_runtime(db_path):
            pass
    await decide(office, "T1", "review", "rev-b", "approved")
    after = await _cli("tasks", "--db", str(db_path), "--task", "T1", "--json")
    assert json.loads(after.stdout)["step_id"] == "approval"


@pytest.mark.parametrize(("version", "word"), [(3, "older"), (schema.SCHEMA_VERSION + 1, "newer")])
def test_views_refuse_another_schema_version_and_never_migrate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: int, word: str
) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    assert main(["tasks", "--db", str(db)]) == 2  # exit 2: the CLI's "cannot run"
    err = capsys.readouterr().err
    assert f"schema version {version}, {word} than this onceflow's {schema.SCHEMA_VERSION}" in err
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == version
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


def test_views_name_a_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["outcomes", "--db", str(tmp_path / "absent.db")]) == 2
    assert "no database at" in capsys.readouterr().err
    assert not (tmp_path / "absent.db").exists()


async def test_view_tables_escape_control_characters(
    office: Runtime, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await ok(
        office,
        {
            "type": "create_task",
            "task_id": "T-1",  # ids refuse control characters; free text keeps them
            "workflow_id": "office-default",
            "title": "a\nb\tc\x9b\x1b[2J",
        },
    )
    assert main(["tasks", "--db", str(db_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x9b" not in out and "\t" not in out
    assert len(out.splitlines()) == 2  # header and one row: the newline in the title is escaped
    assert "a\\nb\\tc\\x9b\\x1b[2J" in out


async def test_list_tasks_pages_in_task_id_order(office: Runtime) -> None:
    for task_id in ("T3", "T1", "T5", "T2", "T4"):
        await create_task(office, task_id)
    pages, after = [], None
    while True:
        reply = await ok(office, {"type": "list_tasks", "limit": 2, "after_task_id": after})
        pages.append([task["task_id"] for task in reply.result["tasks"]])
        after = reply.result["next_after_task_id"]
        if after is None:
            break
    assert pages == [["T1", "T2"], ["T3", "T4"], ["T5"]]
    default = await ok(office, {"type": "list_tasks"})
    assert len(default.result["tasks"]) == 5
    assert default.result["tasks"][0] == (await ok(office, {"type": "get_task", "task_id": "T1"})).result


@pytest.mark.parametrize("limit", [0, 1001, -1])
async def test_list_tasks_limit_is_bounded(office: Runtime, limit: int) -> None:
    reply = await send(office, {"type": "list_tasks", "limit": limit})
    assert not reply.ok
    assert (reply.error.code, reply.error.field) == ("invalid_message", "limit")


@settings(max_examples=60, deadline=None)
@given(
    ids=st.sets(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6), max_size=12),
    limit=st.integers(min_value=1, max_value=5),
)
def test_list_tasks_pages_cover_every_task_once(ids: set[str], limit: int) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    schema.migrate(conn)
    for task_id in ids:
        tasks.insert_task(
            conn, task_id=task_id, workflow_id="w", step_id="s", title="", session_id=None,
            primary_agent_id=None, ceo_agent_id=None, priority="medium", now=1.0,
        )  # fmt: skip
    seen: list[str] = []
    after: str | None = None
    while True:
        page, more = tasks.list_tasks(conn, after_task_id=after, limit=limit)
        assert len(page) <= limit
        seen += [task.id for task in page]
        if not more:
            break
        after = page[-1].id
    assert seen == sorted(ids)


def _board(path: Path, tasks_: int = 700) -> Path:
    """A board of `tasks_` tasks with 3 entries each and 2 runs per entry (several view pages of each)."""
    conn = sqlite3.connect(path, isolation_level=None)
    schema.migrate(conn)
    conn.execute("BEGIN")
    bulk.fill_history(
        conn, workflow_id="w", step_ids=("a", "b", "c"), tasks=tasks_, entries_per_task=3, runs_per_entry=2,
        now=1_700_000_000.0,
    )  # fmt: skip
    conn.execute("COMMIT")
    conn.close()
    return path


def test_views_stream_every_row_once_in_order_across_pages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _board(tmp_path / "big.db")
    expected = {"runs": 4200, "entries": 2100, "decisions": 2100, "tasks": 700}
    assert all(count > views.PAGE for count in expected.values())  # more than one page of each
    for view, count in expected.items():
        assert main([view, "--db", str(db), "--json"]) == 0
        shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(shown) == count, view
        keys = [
            (row["task_id"], row["step_id"], row["entry_seq"]) if view == "entries"
            else row["task_id"] if view == "tasks" else row["id"]
            for row in shown
        ]  # fmt: skip
        assert keys == sorted(keys) and len(set(keys)) == count, view
    assert main(["entries", "--db", str(db), "--json", "--task", "bulk-123"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["step_id"], [m["state"] for m in e["markers"]]) for e in entries] == [
        ("a", ["done"]), ("b", ["done"]), ("c", ["done"])
    ]  # fmt: skip


def test_views_limit_bounds_the_rows_and_the_table_has_one_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _board(tmp_path / "big.db")
    assert main(["runs", "--db", str(db), "--json", "--limit", "7"]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == list(range(1, 8))
    assert main(["runs", "--db", str(db), "--limit", "600"]) == 0  # more than one page, as a table
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 601 and table[0].split()[:2] == ["id", "task_id"]
    assert sum(line.startswith("id ") for line in table) == 1
    assert main(["runs", "--db", str(db), "--task", "bulk-005", "--json", "--limit", "4"]) == 0
    assert {json.loads(line)["task_id"] for line in capsys.readouterr().out.splitlines()} == {"bulk-005"}
    with pytest.raises(SystemExit):
        main(["runs", "--db", str(db), "--limit", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_views_read_page_by_page_never_everything_first(tmp_path: Path) -> None:
    """The first row of a view costs one bounded query: no statement reads the whole table."""
    db = _board(tmp_path / "big.db")
    for view in ("runs", "entries", "decisions", "tasks", "outcomes"):
        with views.open_read_only(db) as conn:
            statements: list[str] = []
            assert isinstance(conn, sqlite3.Connection)
            conn.set_trace_callback(statements.append)
            rows = views.stream(conn, view)
            next(rows, None)
            assert statements and all("LIMIT" in sql for sql in statements if "step_entry_markers" not in sql)
            assert len(statements) <= (3 if view == "entries" else 2), (
                view,
                statements,
            )  # entries: +recordless


def test_views_exit_quietly_when_the_reader_goes_away(tmp_path: Path) -> None:
    """`onceflow runs --json | head -1`: the view ends with 0 or 141 and no traceback on stderr."""
    db = _board(tmp_path / "big.db")  # ~1.5 MB of JSON lines: far more than a pipe holds
    for args in (["runs", "--json"], ["runs"]):
        child = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", *args, "--db", str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline()
        child.stdout.close()  # as `head -1` exits
        err = child.stderr.read().decode()
        assert child.wait(timeout=60) in (0, 141)
        assert err == "", err


async def _pages(rt: Runtime, command: dict[str, Any], rows: str, *cursor: str) -> list[list[Any]]:
    pages = []
    while True:
        page = (await ok(rt, command)).result
        pages.append(page[rows])
        following = {field: page[f"next_{field}"] for field in cursor}
        if all(value is None for value in following.values()):
            return pages
        command = {**command, **following}


async def test_list_runs_of_one_task_pages_by_run_id_with_a_bounded_limit(office: Runtime) -> None:
    await to_review(office, "T1")
    for round_ in range(3):  # three more review rounds of T1, and T2's runs among its runs
        await decide(office, "T1", "review", "rev-a", "rejected")
        await send(office, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        await to_review(office, f"T2-{round_}")
    everything = (await ok(office, {"type": "list_runs", "task_id": "T1", "limit": 1000})).result
    assert everything["next_after_run_id"] is None
    ids = [run["id"] for run in everything["runs"]]
    assert len(ids) >= 6 and ids == sorted(ids)
    pages = await _pages(office, {"type": "list_runs", "task_id": "T1", "limit": 4}, "runs", "after_run_id")
    assert [len(page) for page in pages[:-1]] == [4] * (len(pages) - 1) and 0 < len(pages[-1]) <= 4
    assert [run["id"] for page in pages for run in page] == ids  # every run of T1 once, in order
    assert {run["task_id"] for page in pages for run in page} == {"T1"}
    default = (await ok(office, {"type": "list_runs"})).result
    assert len(default["runs"]) <= 100
    for limit in (0, 1001):
        refused = await send(office, {"type": "list_runs", "task_id": "T1", "limit": limit})
        assert refused.error is not None and (refused.error.code, refused.error.field) == (
            "invalid_message",
            "limit",
        )


async def test_list_decisions_and_step_entries_page_with_their_cursors(office: Runtime) -> None:
    await to_review(office, "T1")
    for _ in range(3):
        await decide(office, "T1", "review", "rev-a", "rejected")  # back to work: a new review entry each
        await send(office, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    entries = await _pages(
        office,
        {"type": "list_step_entries", "task_id": "T1", "limit": 2},
        "entries",
        "after_step_id",
        "after_entry_seq",
    )
    keys = [(e["step_id"], e["entry_seq"]) for page in entries for e in page]
    assert len(entries) > 1 and keys == sorted(keys) and len(set(keys)) == len(keys) >= 4
    one = (await ok(office, {"type": "list_step_entries", "task_id": "T1", "limit": 1000})).result
    assert [(e["step_id"], e["entry_seq"]) for e in one["entries"]] == keys
    half = await send(office, {"type": "list_step_entries", "task_id": "T1", "after_step_id": "review"})
    assert half.error is not None and half.error.code == "invalid_message"

    decisions = await _pages(
        office, {"type": "list_decisions", "task_id": "T1", "limit": 2}, "decisions", "after_decision_id"
    )
    ids = [d["id"] for page in decisions for d in page]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_list_review_runs_pages(office: Runtime) -> None:
    page = (await ok(office, {"type": "list_review_runs", "limit": 1})).result
    assert page == {"review_runs": [], "next_after_review_run_id": None}


async def test_the_queue_view_shows_each_agent_its_ceiling_and_the_global_line(
    office: Runtime, db_path: Path
) -> None:
    await to_review(office, "T1")  # a run queued for each reviewer
    await ok(office, {"type": "set_limits", "scope": "agent", "id": "rev-a", "max_concurrent": 2})
    await ok(office, {"type": "set_limits", "scope": "global", "runs_per_hour": 50})
    await ok(office, {"type": "pause", "scope": "agent", "id": "rev-b", "reason": "quota"})
    await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})
    shown = await _cli("queue", "--db", str(db_path), "--json")
    assert shown.returncode == 0, shown.stderr
    rows = {r["agent_profile_id"]: r for r in map(json.loads, shown.stdout.decode().splitlines())}
    assert (rows["rev-a"]["claimed"], rows["rev-a"]["max_concurrent"], rows["rev-a"]["paused"]) == (
        1,
        2,
        False,
    )
    assert (rows["rev-b"]["queued"], rows["rev-b"]["paused"]) == (1, True)
    assert (rows["(global)"]["runs_per_hour"], rows["(global)"]["claimed"]) == (50, 1)
    table = (await _cli("queue", "--db", str(db_path))).stdout.decode().splitlines()
    assert table[0].split()[:4] == ["agent_profile_id", "queued", "claimed", "max_concurrent"]
