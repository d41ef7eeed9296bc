"""Issue 13 item 4: read-only views of a live database, and the paged `list_tasks` query."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from helpers import create_task, decide, ok, send, to_review
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli import main
from onceflow.store import schema, tasks
from onceflow.store.lock import DatabaseOwnedError


async def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """`onceflow ARGS` in another process (as an operator would run it beside a live host)."""
    return await trio.run_process(
        [sys.executable, "-m", "onceflow.cli", *args], capture_stdout=True, capture_stderr=True, check=False
    )


async def test_issue13_views_read_a_database_while_a_runtime_owns_it(office: Runtime, db_path: Path) -> None:
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
    assert [json.loads(line)["step_id"] for line in entries.stdout.decode().splitlines()] == ["review"]

    # The runtime still owns the file and keeps serving: the views took no lock and wrote nothing.
    with pytest.raises(DatabaseOwnedError):
        async with open_runtime(db_path):
            pass
    await decide(office, "T1", "review", "rev-b", "approved")
    after = await _cli("tasks", "--db", str(db_path), "--task", "T1", "--json")
    assert json.loads(after.stdout)["step_id"] == "approval"


@pytest.mark.parametrize(("version", "word"), [(3, "older"), (schema.SCHEMA_VERSION + 1, "newer")])
def test_issue13_views_refuse_another_schema_version_and_never_migrate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: int, word: str
) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    assert main(["tasks", "--db", str(db)]) == 2  # exit 2 since issue 15 (was 1): the CLI's "cannot run"
    err = capsys.readouterr().err
    assert f"schema version {version}, {word} than this onceflow's {schema.SCHEMA_VERSION}" in err
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == version
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


def test_issue13_views_name_a_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["outcomes", "--db", str(tmp_path / "absent.db")]) == 2
    assert "no database at" in capsys.readouterr().err
    assert not (tmp_path / "absent.db").exists()


async def test_issue13_view_tables_escape_control_characters(
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


async def test_issue13_list_tasks_pages_in_task_id_order(office: Runtime) -> None:
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
async def test_issue13_list_tasks_limit_is_bounded(office: Runtime, limit: int) -> None:
    reply = await send(office, {"type": "list_tasks", "limit": limit})
    assert not reply.ok
    assert (reply.error.code, reply.error.field) == ("invalid_message", "limit")


@settings(max_examples=60, deadline=None)
@given(
    ids=st.sets(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6), max_size=12),
    limit=st.integers(min_value=1, max_value=5),
)
def test_issue13_list_tasks_pages_cover_every_task_once(ids: set[str], limit: int) -> None:
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
