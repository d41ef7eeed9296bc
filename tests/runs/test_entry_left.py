"""No run of a step entry its task has left is ever handed out: on every path that leaves an entry, the
entry's queued runs are cancelled in the leaving transaction (`run_cancelled`, reason `entry_left`) and a
claimed one is marked superseded (its holder is told). Driven through protocol messages on the Office
template: T1 sits in Review with two reviewer runs, rev-a's claimed and rev-b's queued."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from helpers import create_task, decide, events, list_runs, move, ok, send, to_review, turn_complete

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply

OTHER = """\
id: other
name: Other
steps:
  - id: inbox
    name: Inbox
    position: 0
    is_start_step: true
"""


async def by_move(rt: Runtime) -> Reply:  # E1, a host's move
    return await move(rt, "T1", "work")


async def by_quorum(rt: Runtime) -> Reply:  # E1, the engine's move on a reviewer's rejection
    return await decide(rt, "T1", "review", "rev-b", "rejected")


async def by_update(rt: Runtime) -> Reply:  # E5
    return await ok(rt, {"type": "update_task", "task_id": "T1", "step_id": "work"})


async def by_switch(rt: Runtime) -> Reply:  # E4
    await ok(rt, {"type": "register_workflow", "yaml": OTHER, "source": "other.yml"})
    return await ok(rt, {"type": "switch_workflow", "task_id": "T1", "workflow_id": "other"})


async def by_delete(rt: Runtime) -> Reply:
    return await ok(rt, {"type": "delete_task", "task_id": "T1"})


PATHS: dict[str, tuple[Callable[[Runtime], Awaitable[Reply]], str]] = {
    "move_task": (by_move, "entry_left"),
    "quorum_move": (by_quorum, "entry_left"),
    "update_task_step": (by_update, "entry_left"),
    "switch_workflow": (by_switch, "entry_left"),
    "delete_task": (by_delete, "task_deleted"),
}


@pytest.mark.parametrize("path", list(PATHS))
async def test_leaving_an_entry_cancels_its_queued_runs_and_supersedes_its_claimed_ones(
    office: Runtime, path: str
) -> None:
    leave, reason = PATHS[path]
    await to_review(office, "T1")
    held = (await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
    queued = {r["agent_profile_id"]: r["id"] for r in await list_runs(office, task_id="T1")}["rev-b"]
    left = await leave(office)
    cancelled = [(e.run_id, e.reason) for e in events(left, "run_cancelled")]
    assert (queued, reason) in cancelled
    assert await _handed_out(office, "rev-b") == []  # never handed out, now or later
    if path == "delete_task":  # its rows are gone with the task: the holder learns it from finish_run
        assert (held["id"], reason) in cancelled
        gone = await send(
            office, {"type": "finish_run", "run_id": held["id"], "claim_token": held["claim_token"]}
        )
        assert (gone.ok, gone.error.code) == (False, "not_found")
        return
    assert [e.fields["run_id"] for e in events(left, "diagnostic") if e.code == "run_superseded"] == [
        held["id"]
    ]
    renewed = await ok(
        office, {"type": "renew_run", "run_id": held["id"], "claim_token": held["claim_token"]}
    )
    assert renewed.result["superseded"] is True
    rows = {r["id"]: r for r in await list_runs(office, task_id="T1")}
    assert (rows[queued]["status"], rows[queued]["outcome_reason"]) == ("cancelled", reason)
    assert rows[held["id"]]["status"] == "claimed"


async def test_a_run_of_the_current_entry_is_untouched_by_a_no_op_move(office: Runtime) -> None:
    await to_review(office, "T1")
    noop = await move(office, "T1", "review")
    assert events(noop, "run_cancelled") == []
    assert {r["status"] for r in await list_runs(office, task_id="T1")} == {"queued"}


async def test_entering_a_full_wip_step_leaves_the_entry_before_waiting_for_a_slot(
    runtime: Runtime,
) -> None:
    """E3: a move into a full WIP step queues the task there; it has left its entry, so that entry's runs are
    cancelled at the move, not at its later promotion."""
    await ok(runtime, {"type": "register_workflow", "yaml": WIP, "source": "wip.yml"})
    for task in ("T1", "T2", "T3"):
        await create_task(runtime, task, workflow_id="wip", step_id="work" if task != "T3" else "backlog")
    await ok(runtime, {"type": "task_comment", "task_id": "T1", "comment_id": "c-1"})
    await ok(runtime, {"type": "task_comment", "task_id": "T2", "comment_id": "c-2"})
    await move(runtime, "T1", "review")  # review holds one: T1 takes it
    waiting = await move(runtime, "T2", "review")  # T2 waits for T1's slot
    assert [e.type for e in waiting.events if e.type in ("task_queued", "run_cancelled")] == [
        "run_cancelled",
        "task_queued",
    ]
    assert await _handed_out(runtime, "worker") == []


WIP = """\
id: wip
name: WIP
steps:
  - id: backlog
    name: Backlog
    position: 0
    is_start_step: true
  - id: work
    name: Work
    position: 1
    events:
      on_comment:
        - type: queue_run
          config: {target: primary, reason: task_comment}
  - id: review
    name: Review
    position: 2
    wip_limit: 1
    pull_from_step_id: work
"""


async def test_a_grouped_common_entry_cancels_every_member_tasks_left_runs(office: Runtime) -> None:
    """Tasks entering Review together share one transaction (the grouped common entry): each one's comment
    runs in Work are cancelled in it."""
    tasks = [f"T{n}" for n in range(12)]
    for task in tasks:
        await create_task(office, task)
        await move(office, task, "work")
        await ok(office, {"type": "task_comment", "task_id": task, "comment_id": f"c-{task}"})
    replies: list[Reply] = []

    async def review(task: str) -> None:
        replies.append(await turn_complete(office, task))

    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(review, task)
    cancelled = [e for reply in replies for e in events(reply, "run_cancelled")]
    assert sorted(e.task_id for e in cancelled) == sorted(tasks)
    assert {e.reason for e in cancelled} == {"entry_left"}
    assert await _handed_out(office, "worker") == []
    assert len(await _handed_out(office, "rev-a")) == len(tasks)  # the new entries' runs are all live


async def _handed_out(rt: Runtime, agent: str) -> list[dict[str, Any]]:
    """Claim every run the agent can get now."""
    got = []
    while (reply := await ok(rt, {"type": "claim_run", "agent_profile_id": agent})).result is not None:
        got.append(reply.result)
    return got
