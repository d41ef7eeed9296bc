"""Templates changed under live tasks: each task runs on the version it was created under until migrated;
migrations are validated, dry-run, applied per task and replayable. Kandev's office-default with a step
removed, renamed, split and merged, on both backends and across a restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import (
    OFFICE,
    create_task,
    decide,
    list_runs,
    move,
    ok,
    send,
    setup_office,
    to_review,
    turn_complete,
)
from versions_support import CHANGES, office, step, text

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.entries.executors import DEFAULT_EXECUTORS
from onceflow.testing import FakeClock, RecordingHost

CHANGED = pytest.mark.parametrize("change", list(CHANGES))


async def register_text(rt: Runtime, yaml_text: str) -> dict[str, Any]:
    reply = await ok(rt, {"type": "register_workflow", "yaml": yaml_text, "source": "office-default.yml"})
    return dict(reply.result)


async def task(rt: Runtime, task_id: str) -> dict[str, Any]:
    return dict((await ok(rt, {"type": "get_task", "task_id": task_id})).result)


async def version_steps(rt: Runtime, version: int) -> set[str]:
    """The step ids of a version, from its registered text (as the wire gives it)."""
    reply = await ok(rt, {"type": "get_workflow", "workflow_id": OFFICE, "version": version})
    return {s["id"] for s in yaml.safe_load(reply.result["yaml"])["steps"]}


async def claim_all(rt: Runtime, agent: str) -> list[dict[str, Any]]:
    claimed = []
    while (reply := await ok(rt, {"type": "claim_run", "agent_profile_id": agent})).result is not None:
        claimed.append(dict(reply.result))
    return claimed


async def live_board(rt: Runtime) -> None:
    """Office v1 with live tasks: A in review (rev-a's run claimed, rev-b's queued, an own watcher seat),
    B in approval (boss's run queued), C in work, D in review (its round to finish on v1)."""
    await setup_office(rt, Path(__file__).parents[1] / "fixtures" / "kandev" / "office-default.yml")
    for review in ("A", "B", "D"):
        await to_review(rt, review)
    await ok(rt, {"type": "add_participant", "task_id": "A", "step_id": "review", "role": "watcher"})
    await decide(rt, "B", "review", "rev-a", "approved")
    await decide(rt, "B", "review", "rev-b", "approved")
    await create_task(rt, "C")
    await move(rt, "C", "work")
    await ok(rt, {"type": "claim_run", "agent_profile_id": "rev-a"})  # A's


@CHANGED
async def test_a_changed_template_strands_no_live_task_and_migrates_them_after_a_dry_run(
    db_path: Path | str, change: str
) -> None:
    build, step_map = CHANGES[change]
    changed = text(build())
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        await live_board(rt)
        registered = await register_text(rt, changed)
        assert (registered["version"], registered["changed"]) == (2, True)
        assert registered["live_tasks_by_version"] == {"1": 4}
        dropped = {w["step_id"]: w["code"] for w in registered["warnings"] if w["code"].startswith("step_")}
        assert dropped["review"] == ("step_removed" if change == "removed" else "step_renamed")
        again = await register_text(rt, changed)
        assert (again["version"], again["changed"]) == (2, False)

    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:  # across a restart
        v1, v2 = await version_steps(rt, 1), await version_steps(rt, 2)
        for task_id in "ABCD":
            assert (await task(rt, task_id))["workflow_version"] == 1
        # D's round finishes on v1's rule and v1's step, though v2 lacks that step
        await decide(rt, "D", "review", "rev-a", "approved")
        finished = await decide(rt, "D", "review", "rev-b", "approved")
        assert finished.result["moved_to"] == "approval"
        # every run handed out is of a step its task's version has
        held = {}  # A's claimed runs: its holder finishes it after the migration
        for agent in ("rev-b", "boss"):
            for run in await claim_all(rt, agent):
                assert run["step_id"] in v1
                if run["task_id"] == "A":
                    held[run["id"]] = run["claim_token"]
        # a new task runs on v2
        await create_task(rt, "N", step_id=None)
        assert (await task(rt, "N"))["workflow_version"] == 2
        moved = await turn_complete(rt, "N")
        assert moved.result["to_step"] in v2

        refused = await send(rt, {"type": "migrate_tasks", "workflow_id": OFFICE, "to_version": 2})
        assert refused.error is not None and refused.error.field == "step_map"
        assert "'review'" in refused.error.message and "'A'" in refused.error.message
        assert (await task(rt, "A"))["workflow_version"] == 1  # nothing migrated

        migrate = {"type": "migrate_tasks", "workflow_id": OFFICE, "to_version": 2, "step_map": step_map}
        plan = (await ok(rt, migrate | {"dry_run": True})).result
        assert (await task(rt, "A"))["workflow_version"] == 1  # a dry run commits nothing
        assert [t["task_id"] for t in plan["tasks"]] == ["A", "B", "C", "D"]
        a_plan = next(t for t in plan["tasks"] if t["task_id"] == "A")
        assert (a_plan["from_step"], a_plan["to_step"]) == ("review", step_map["review"])
        assert a_plan["seats_moved"] == 3  # rev-a, rev-b (template rows, copied) and its own watcher
        a_runs = {run["id"]: run for run in await list_runs(rt, task_id="A") if run["status"] != "cancelled"}
        assert sorted(a_plan["runs_kept"] + a_plan["runs_cancelled"]) == sorted(a_runs)
        if change == "removed":  # approval queues for approvers: the reviewers' runs go
            assert a_plan["runs_kept"] == []
        else:  # the new step fans out to the same reviewers: their runs move with the task
            assert a_plan["runs_cancelled"] == []

        applied = (await ok(rt, migrate | {"operation_id": "mig-1"})).result
        assert applied["tasks"] == [dict(t) for t in plan["tasks"]]
        [(run_id, token)] = held.items()
        finish = {"type": "finish_run", "run_id": run_id, "claim_token": token}
        finished = await send(rt, finish)
        assert finished.ok == (run_id in a_plan["runs_kept"])  # a kept run's holder finishes it
        assert (await ok(rt, migrate | {"operation_id": "mig-1"})).result == {
            "idempotent": True,
            "operation_id": "mig-1",
        }
        assert (await ok(rt, migrate)).result["tasks"] == []  # every task is on v2 already

    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        listed = (await ok(rt, {"type": "list_workflows"})).result["workflows"]
        assert listed == [
            {"workflow_id": OFFICE, "versions": [1, 2], "newest": 2, "live_tasks_by_version": {"2": 5}}
        ]
        a = await task(rt, "A")
        assert (a["workflow_version"], a["step_id"]) == (2, step_map["review"])
        runs = await list_runs(rt, task_id="A")
        for run in runs:
            if run["id"] in a_plan["runs_cancelled"]:
                assert (run["status"], run["outcome_reason"]) == ("cancelled", "migrated")
            elif run["id"] in a_plan["runs_kept"]:
                assert run["step_id"] == step_map["review"]
        seats = (await ok(rt, {"type": "list_participants", "task_id": "A"})).result["participants"]
        assert {(s["role"], s["agent_profile_id"]) for s in seats if s["task_id"] == "A"} >= {
            ("reviewer", "rev-a"),
            ("reviewer", "rev-b"),
            ("watcher", ""),
        }
        assert {s["step_id"] for s in seats if s["task_id"] == "A"} == {step_map["review"]}
        history = (await ok(rt, {"type": "task_history", "task_id": "A", "limit": 1000})).result["items"]
        [item] = [i for i in history if i["kind"] == "migrated"]
        assert item["detail"]["to_step"] == step_map["review"]
        # A is not stranded: its reviewers' quorum at the new step moves it on, as v2 says
        target = step_map["review"]
        await decide(rt, "A", target, "rev-a", "approved")
        decided = await decide(rt, "A", target, "rev-b", "approved")
        forward = step(build(), target)["events"]["on_turn_complete"][0]["config"]["step_id"]
        if change != "removed":
            assert decided.result["moved_to"] == forward
        for task_id in "ABCDN":
            assert (await task(rt, task_id))["workflow_version"] == 2


async def test_a_live_quorum_round_finishes_under_the_rule_it_started_with(db_path: Path | str) -> None:
    lenient = office()
    step(lenient, "review")["events"]["on_turn_complete"][0]["config"]["wait_for_quorum"]["threshold"] = (
        "n_approve:1"
    )
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        await setup_office(rt, Path(__file__).parents[1] / "fixtures" / "kandev" / "office-default.yml")
        await to_review(rt, "OLD")
        assert (await register_text(rt, text(lenient)))["version"] == 2
        await to_review(rt, "NEW")
        one = await decide(rt, "OLD", "review", "rev-a", "approved")
        assert one.result["moved_to"] is None  # all_approve, as when its round began
        assert (await decide(rt, "NEW", "review", "rev-a", "approved")).result["moved_to"] == "approval"
        both = await decide(rt, "OLD", "review", "rev-b", "approved")
        assert both.result["moved_to"] == "approval"


def fan_out_fails(*_: object) -> Any:
    raise sqlite3.OperationalError("disk I/O error (injected)")


@CHANGED
async def test_an_open_entry_resumes_after_a_restart_on_its_version_and_a_migration_closes_it(
    db_path: Path | str, change: str
) -> None:
    """An entry left open (its fan-out failed) when the template loses its step: the next start resumes it
    on the task's version (the reviewers get their runs); a migration of a task with an open entry closes it
    as `migrated` with no second fan-out, and `enter` runs the new step's on_enter."""
    build, step_map = CHANGES[change]
    failing = {**DEFAULT_EXECUTORS, "queue_run_for_each_participant": fan_out_fails}
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock(), executors=failing) as rt:
        await setup_office(rt, Path(__file__).parents[1] / "fixtures" / "kandev" / "office-default.yml")
        for task_id in ("R", "M", "E"):
            await to_review(rt, task_id)  # each review entry open: its fan-out failed
        await register_text(rt, text(build()))
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock(), executors=failing) as rt:
        assert await list_runs(rt, task_id="M") == []  # still failing: M and E stay open
        migrate = {"type": "migrate_tasks", "workflow_id": OFFICE, "to_version": 2, "step_map": step_map}
        closed = (await ok(rt, migrate | {"task_ids": ["M"]})).result["tasks"]
        assert [(t["task_id"], t["entry"]) for t in closed] == [("M", "closed")]
    async with open_runtime(db_path, host=RecordingHost(), clock=FakeClock()) as rt:
        r_runs = [run for run in await list_runs(rt, task_id="R") if run["reason"] == "review_started"]
        assert sorted(run["agent_profile_id"] for run in r_runs) == ["rev-a", "rev-b"]  # resumed on v1
        assert await list_runs(rt, task_id="M") == []  # closed: no second fan-out
        entries = (await ok(rt, {"type": "list_step_entries", "task_id": "M"})).result["entries"]
        assert all(e["terminal"] for e in entries)
        entered = (await ok(rt, migrate | {"task_ids": ["E"], "enter": True})).result["tasks"]
        assert [(t["task_id"], t["entry"]) for t in entered] == [("E", "entered")]
        new_step = step(build(), step_map["review"])
        fans_out = [a for a in new_step["events"].get("on_enter", []) if a["type"].startswith("queue_run")]
        e_runs = [run for run in await list_runs(rt, task_id="E") if run["status"] == "queued"]
        assert bool(e_runs) == bool(fans_out) and all(run["step_id"] == new_step["id"] for run in e_runs)
