"""A task's history (`task_history`, `onceflow history`): the office cycle's story in order across a runtime
restart, paged without repeats or gaps, printed by the CLI, bounded by retention. Real databases (SQLite,
and PostgreSQL with --backend=postgres), real Trio scheduling, a clock moved by hand (tests/hand_clock.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hand_clock import HandClock
from helpers import OFFICE, START, FakeClock, create_task, decide, move, ok, send, setup_office, turn_complete

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.results import result_of
from onceflow.store.retention import retention
from onceflow.store.tasks.history import rfc3339
from onceflow.testing import RecordingHost

WEEK = 7 * 24 * 3600.0


async def history(rt: Runtime, task_id: str, **page: Any) -> dict[str, Any]:
    reply = await ok(rt, {"type": "task_history", "task_id": task_id, **page})
    result_of(reply)  # the reply has the protocol's result shape
    return dict(reply.result)


async def all_items(rt: Runtime, task_id: str, limit: int) -> list[dict[str, Any]]:
    """Every item, following `next` with pages of `limit`."""
    items: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        page = await history(rt, task_id, limit=limit, **({"after": after} if after else {}))
        assert len(page["items"]) <= limit
        items += page["items"]
        if page["next"] is None:
            return items
        assert page["items"], "a page that promises more is never empty"
        after = page["next"]


def story(items: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The items as compact tuples: what a reader of the timeline is told."""
    out: list[tuple[Any, ...]] = []
    for item in items:
        d = item["detail"]
        match item["kind"]:
            case "created":
                out.append(("created", d["step_id"]))
            case "transition":
                out.append(
                    (
                        "transition",
                        d["from_step"],
                        d["to_step"],
                        d["trigger"],
                        d["operation_id"],
                        d["entry_path"],
                    )
                )
            case "decision":
                out.append(("decision", d["decider_id"], d["decision"], d["operation_id"]))
            case "run":
                out.append(("run", d["agent_profile_id"], d["status"]))
    return out


async def first_part(rt: Runtime, clock: HandClock, templates: Path) -> None:
    """Backlog → Work → Review; rev-a claims and finishes its review run and approves."""
    await setup_office(rt, templates / "office-default.yml")
    await create_task(rt, "T1")
    clock.advance(1)
    await move(rt, "T1", "work")
    clock.advance(1)
    await turn_complete(rt, "T1")  # → review: a run for rev-a and for rev-b
    clock.advance(1)
    claimed = (await ok(rt, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
    clock.advance(1)
    await ok(rt, {"type": "finish_run", "run_id": claimed["id"], "claim_token": claimed["claim_token"]})
    clock.advance(1)
    await decide(rt, "T1", "review", "rev-a", "approved", decision_id="a1")
    clock.advance(1)


async def second_part(rt: Runtime, clock: HandClock) -> None:
    """After the restart: rev-b approves (→ Approval), the boss approves (→ Done)."""
    await decide(rt, "T1", "review", "rev-b", "approved", decision_id="b1")
    clock.advance(1)
    await decide(rt, "T1", "approval", "boss", "approved", role="approver")
    clock.advance(1)


EXPECTED = [
    ("created", "backlog"),
    ("transition", "backlog", "work", "move_task", None, "E2"),
    ("transition", "work", "review", "on_turn_complete", None, "E1"),
    ("run", "rev-a", "queued"),
    ("run", "rev-b", "queued"),
    ("run", "rev-a", "claimed"),
    ("run", "rev-a", "finished"),
    ("decision", "rev-a", "approved", "decision:T1:review:a1"),
    # the restart
    ("decision", "rev-b", "approved", "decision:T1:review:b1"),
    ("transition", "review", "approval", "record_decision", "decision:T1:review:b1", "E1"),
    ("run", "boss", "queued"),
    ("run", "rev-b", "cancelled"),  # left behind by the entry it belonged to
    ("decision", "boss", "approved", None),
    ("transition", "approval", "done", "record_decision", None, "E1"),
    ("run", "boss", "cancelled"),
]


async def test_the_office_cycle_is_told_in_order_across_a_restart(
    db_path: Path | str, kandev_templates: Path, hand_clock: HandClock
) -> None:
    clock = hand_clock
    async with open_runtime(db_path, host=RecordingHost(), clock=clock.wall) as rt:
        await first_part(rt, clock, kandev_templates)
        before = (await history(rt, "T1"))["items"]
    async with open_runtime(db_path, host=RecordingHost(), clock=clock.wall) as rt:
        await second_part(rt, clock)
        page = await history(rt, "T1")
        assert page["next"] is None
        items = page["items"]
        assert story(items) == EXPECTED
        assert items[: len(before)] == before  # what was told before the restart is told the same after it
        paged = [await all_items(rt, "T1", limit) for limit in (1, 2, 3, 7)]
        assert all(p == items for p in paged)
    times = [item["at"] for item in items]
    assert times == sorted(times) and times[0] == rfc3339(START)
    assert all(t.endswith("Z") and "T" in t for t in times)
    moved = items[2]["detail"]
    assert (moved["entry_seq"], moved["workflow_id"], moved["queued"]) == (1, "office-default", False)
    done = items[-2]["detail"]
    assert (
        done["entry_seq"] is None
    )  # Done declares no engine-owned action: no entry record, still a transition
    written = [item["seq"] for item in items if item["kind"] != "run"]
    assert written == list(range(1, len(written) + 1))


async def test_a_cleared_decision_stays_in_the_history(office: Runtime) -> None:
    await create_task(office, "T1")
    await move(office, "T1", "work")
    await turn_complete(office, "T1")
    await decide(office, "T1", "review", "rev-a", "rejected")  # → work
    await turn_complete(office, "T1")  # → review again: clear_decisions deletes the rejection
    listed = await ok(office, {"type": "list_decisions", "task_id": "T1", "step_id": "review"})
    assert listed.result["decisions"] == []
    decisions = [i for i in (await history(office, "T1"))["items"] if i["kind"] == "decision"]
    assert [(d["detail"]["decider_id"], d["detail"]["decision"]) for d in decisions] == [
        ("rev-a", "rejected")
    ]


async def test_a_taken_task_id_is_refused_and_writes_nothing(office: Runtime) -> None:
    # the insert answers the row it wrote, or nothing when the id is taken: nothing else may land
    await create_task(office, "T1")
    again = await send(office, {"type": "create_task", "task_id": "T1", "workflow_id": OFFICE, "title": "2"})
    assert again.error is not None and (again.error.code, again.error.field) == ("conflict", "task_id")
    assert [item["kind"] for item in (await history(office, "T1"))["items"]] == ["created"]
    task = (await ok(office, {"type": "get_task", "task_id": "T1"})).result
    assert task["title"] != "2" and not again.events


async def test_bad_cursors_and_unknown_tasks_are_refused_naming_the_field(office: Runtime) -> None:
    await create_task(office, "T1")
    for after in ("nonsense", "1.5:9:1", "inf:0:1", "1:0"):
        reply = await send(office, {"type": "task_history", "task_id": "T1", "after": after})
        assert (reply.ok, reply.error and reply.error.field) == (False, "after"), after
    for limit in (0, 1001):
        reply = await send(office, {"type": "task_history", "task_id": "T1", "limit": limit})
        assert (reply.ok, reply.error and reply.error.field) == (False, "limit")
    missing = await send(office, {"type": "task_history", "task_id": "nope"})
    assert (missing.ok, missing.error and missing.error.code, missing.error and missing.error.field) == (
        False,
        "not_found",
        "task_id",
    )


async def test_a_wip_queued_move_and_its_promotion_are_told(db_path: Path | str, clock: FakeClock) -> None:
    template = """\
id: w
name: WIP
steps:
  - {id: todo, name: Todo, position: 0, is_start_step: true}
  - {id: doing, name: Doing, position: 1, wip_limit: 1}
"""
    async with open_runtime(db_path, clock=clock) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": template, "source": "w.yml"})
        for task in ("A", "B"):
            await create_task(rt, task, workflow_id="w", step_id="todo")
            await move(rt, task, "doing")  # B waits: doing is full
        await move(rt, "A", "todo")  # frees the slot: B is promoted
        told = [(i["kind"], i["detail"]) for i in (await history(rt, "B"))["items"]]
    assert [(d.get("from_step"), d.get("to_step"), d.get("trigger"), d.get("queued")) for _, d in told] == [
        (None, None, None, False),
        ("todo", "doing", "move_task", True),
        ("doing", "doing", "wip_promotion", False),
    ]


async def test_a_transition_is_stored_without_its_defaults_and_told_with_every_field(
    db_path: Path | str, clock: FakeClock
) -> None:
    """A transition's stored detail leaves out a missing operation id and `queued` false (the history's most
    frequent row, ~35 bytes fewer); `task_history` tells every field, in order, as before."""
    template = """\
id: w
name: W
steps:
  - {id: todo, name: Todo, position: 0, is_start_step: true}
  - {id: doing, name: Doing, position: 1}
"""
    async with open_runtime(db_path, clock=clock) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": template, "source": "w.yml"})
        other = template.replace("id: w\n", "id: w2\n")
        await ok(rt, {"type": "register_workflow", "yaml": other, "source": "w2.yml"})
        await create_task(rt, "A", workflow_id="w", step_id="todo")
        await move(rt, "A", "doing")
        switch = {"type": "switch_workflow", "task_id": "A", "workflow_id": "w2", "operation_id": "op-1"}
        await ok(rt, switch)
        told = [i["detail"] for i in (await history(rt, "A"))["items"] if i["kind"] == "transition"]
        stored = await rt.services.store.transact(
            lambda conn: conn.execute(
                "SELECT detail FROM task_history WHERE task_id = 'A' AND kind = 'transition' ORDER BY seq"
            ).fetchall()
        )
    fields = [
        "from_step",
        "to_step",
        "workflow_id",
        "trigger",
        "operation_id",
        "entry_path",
        "entry_seq",
        "queued",
    ]
    assert [list(detail) for detail in told] == [fields, fields]
    assert [(d["operation_id"], d["queued"]) for d in told] == [
        (None, False),
        ("op-1:switch_workflow:on_enter", False),
    ]
    plain, with_operation = (json.loads(detail) for (detail,) in stored)
    assert "operation_id" not in plain and "queued" not in plain
    assert (
        with_operation["operation_id"] == "op-1:switch_workflow:on_enter" and "queued" not in with_operation
    )


async def test_retention_prunes_old_history_but_each_tasks_latest(
    db_path: Path | str, kandev_templates: Path, hand_clock: HandClock
) -> None:
    async with open_runtime(db_path, clock=hand_clock.wall) as office:
        await setup_office(office, kandev_templates / "office-default.yml")
        await create_task(office, "T1")
        await move(office, "T1", "work")
        await move(office, "T1", "backlog")
        hand_clock.advance(WEEK + 1)
        pruned = await office.services.store.transact(retention.prune_batch, hand_clock.now, WEEK, 1)
        assert (pruned.deleted["history"], pruned.full) == (1, True)
        pruned = await office.services.store.transact(retention.prune_batch, hand_clock.now, WEEK, 100)
        assert pruned.deleted["history"] == 1
        [kept] = (await history(office, "T1"))["items"]
        assert (kept["seq"], kept["detail"]["to_step"]) == (3, "backlog")
        await move(office, "T1", "work")  # the numbering goes on past the kept item
        assert [i["seq"] for i in (await history(office, "T1"))["items"]] == [3, 4]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "history", *args],
        capture_output=True,
        text=True,
        check=False,
    )


async def test_onceflow_history_prints_the_story(db_path: Path | str, kandev_templates: Path) -> None:
    clock = FakeClock()
    async with open_runtime(db_path, host=RecordingHost(), clock=clock) as rt:
        await first_part(rt, clock, kandev_templates)
        await second_part(rt, clock)
        items = (await history(rt, "T1"))["items"]
        db = str(db_path)
        as_json = _cli("--db", db, "--task", "T1", "--json")  # read while the runtime serves
    assert as_json.returncode == 0, as_json.stderr
    assert [json.loads(line) for line in as_json.stdout.splitlines()] == items
    table = _cli("--db", db, "--task", "T1")
    lines = table.stdout.splitlines()
    assert len(lines) == len(items) and "backlog -> work  trigger=move_task" in lines[1]
    assert "approved by agent boss" in lines[-3]
    limited = _cli("--db", db, "--task", "T1", "--json", "--limit", "4")
    assert [json.loads(line) for line in limited.stdout.splitlines()] == items[:4]
    missing = _cli("--db", db, "--task", "nope")
    assert (missing.returncode, missing.stdout, missing.stderr.count("\n")) == (2, "", 1)
    assert "nope" in missing.stderr


@pytest.mark.parametrize("as_json", [False, True])
async def test_onceflow_history_ends_quietly_on_a_closed_pipe(
    db_path: Path | str, clock: FakeClock, as_json: bool
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": _PINGPONG, "source": "p.yml"})
        await create_task(rt, "T1", workflow_id="p", step_id="a")
        for _ in range(400):  # a history longer than a page and than a pipe's buffer (64 KiB)
            await move(rt, "T1", "b")
            await move(rt, "T1", "a")
    flags = ["--json"] if as_json else []
    command = [
        sys.executable,
        "-m",
        "onceflow.cli",
        "history",
        "--db",
        str(db_path),
        "--task",
        "T1",
        *flags,
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # as `| head -1` does
        err = proc.stderr.read()
        status = proc.wait(timeout=60)
    assert first and (status, err) == (0, b"")


_PINGPONG = """\
id: p
name: Ping-pong
steps:
  - {id: a, name: A, position: 0, is_start_step: true}
  - {id: b, name: B, position: 1}
"""


async def test_the_entries_view_shows_every_entry_the_history_tells(
    db_path: Path | str, kandev_templates: Path
) -> None:
    """`onceflow entries` lists each entry a transition in the history made, the steps that allocate no
    entry record (Work, Done: only host-owned on_enter actions) included, with the same path and entry."""
    clock = FakeClock()
    async with open_runtime(db_path, host=RecordingHost(), clock=clock) as rt:
        await first_part(rt, clock, kandev_templates)
        await second_part(rt, clock)
        items = (await history(rt, "T1"))["items"]
        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "onceflow.cli",
                "entries",
                "--db",
                str(db_path),
                "--task",
                "T1",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    assert shown.returncode == 0, shown.stderr
    entries = [json.loads(line) for line in shown.stdout.splitlines()]
    told = sorted(
        (i["detail"]["to_step"], i["detail"]["entry_path"], i["detail"]["entry_seq"] or 0)
        for i in items
        if i["kind"] == "transition" and not i["detail"]["queued"]
    )
    assert sorted((e["step_id"], e["entry_path"], e["entry_seq"] or 0) for e in entries) == told
    assert any(e["entry_seq"] is None for e in entries) and any(e["entry_seq"] for e in entries)
    keys = [(e["step_id"], e["entry_seq"] is not None) for e in entries]
    assert keys == sorted(keys)  # (task, step) order, as the records always were
