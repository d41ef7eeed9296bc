"""Entry path E3: WIP-queue promotion allocates a step entry and dispatches on_enter; a queued placement
does not. Sources: on-enter-action-dispatch.md (Scope shapes (a) and (b), write-site inventory sites 4-7,
AC-B7, Failure modes "WIP promotion into a full target lands the task in the feeder step");
kandev-engine-notes.md "WIP limits".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from helpers import list_entries, list_runs, ok, send

from onceflow import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Event

WIP_FLOW = """
id: wip-flow
name: WIP flow
steps:
  - {id: backlog, name: Backlog, position: 0, is_start_step: true}
  - id: solo
    name: Solo
    position: 1
    wip_limit: 1
    events:
      on_enter:
        - type: queue_run
          config: {target: primary, reason: solo_started}
  - id: work
    name: Work
    position: 2
    wip_limit: 2
    events:
      on_enter:
        - type: queue_run
          config: {target: primary, reason: work_started}
  - id: review
    name: Review
    position: 3
    wip_limit: 1
    pull_from_step_id: work
    events:
      on_enter:
        - type: clear_decisions
        - type: queue_run
          config: {target: primary, reason: review_started}
  - {id: done, name: Done, position: 4}
"""


async def setup(rt: Runtime) -> None:
    await ok(rt, {"type": "register_workflow", "yaml": WIP_FLOW, "source": "wip.yml"})


async def create(rt: Runtime, task_id: str, step_id: str = "backlog") -> dict[str, Any]:
    reply = await ok(
        rt,
        {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": "wip-flow",
            "step_id": step_id,
            "primary_agent_id": f"agent-{task_id}",
        },
    )
    return dict(reply.result)


async def move(rt: Runtime, task_id: str, step_id: str) -> list[Event]:
    return list((await ok(rt, {"type": "move_task", "task_id": task_id, "step_id": step_id})).events)


async def promoted_entry(events: trio.MemoryReceiveChannel[Event], task_id: str) -> Any:
    """The next step_entered event of `task_id` by WIP promotion (it is dispatched by the task's actor)."""
    with trio.fail_after(5):
        async for event in events:
            if event.type == "step_entered" and event.task_id == task_id and event.entry_path == "E3":
                return event
    raise AssertionError("event stream ended")


async def reasons(rt: Runtime, task_id: str) -> list[str]:
    return [run["reason"] for run in await list_runs(rt, task_id=task_id)]


async def test_ac_b7_a_queued_placement_is_not_an_entry_and_same_step_admission_is(runtime: Runtime) -> None:
    await setup(runtime)
    await create(runtime, "A")
    await create(runtime, "B")
    await move(runtime, "A", "solo")
    queued = await move(runtime, "B", "solo")
    assert [e.type for e in queued] == ["transition", "task_queued"]  # no step_entered, no on_enter
    assert await list_entries(runtime, "B") == [] and await reasons(runtime, "B") == []
    task = (await ok(runtime, {"type": "get_task", "task_id": "B"})).result
    assert (task["step_id"], task["wip_admitted"], task["queued_for_step_id"]) == ("solo", False, "solo")

    events = runtime.subscribe()
    await move(runtime, "A", "done")  # frees the slot: B is admitted where it stands (shape (b))
    entered = await promoted_entry(events, "B")
    assert (entered.step_id, entered.entry_seq) == ("solo", 1)
    [entry] = await list_entries(runtime, "B")
    assert (entry["step_id"], entry["entry_path"], entry["terminal"]) == ("solo", "E3", True)
    assert await reasons(runtime, "B") == ["solo_started"]
    task = (await ok(runtime, {"type": "get_task", "task_id": "B"})).result
    assert (task["wip_admitted"], task["queued_for_step_id"]) == (True, None)


async def test_ac_b7_a_feeder_pull_allocates_the_entry_at_the_target(runtime: Runtime) -> None:
    await setup(runtime)
    for task in ("A", "B"):
        await create(runtime, task)
    events = runtime.subscribe()
    await move(runtime, "A", "work")  # review is empty: the new feeder work is pulled at once
    assert (await promoted_entry(events, "A")).step_id == "review"
    await move(runtime, "B", "work")  # review is full now: B stays in work
    assert [e["step_id"] for e in await list_entries(runtime, "B")] == ["work"]

    await move(runtime, "A", "done")  # a review slot frees: B is pulled from its feeder
    entered = await promoted_entry(events, "B")
    assert (entered.step_id, entered.entry_seq) == ("review", 1)
    assert [(e["step_id"], e["entry_path"]) for e in await list_entries(runtime, "B")] == [
        ("review", "E3"),
        ("work", "E2"),
    ]
    assert await reasons(runtime, "B") == ["work_started", "review_started"]


async def test_ac_b7_a_promotion_into_a_full_target_lands_in_the_feeder_and_the_record_names_it(
    runtime: Runtime,
) -> None:
    await setup(runtime)
    for task in ("A", "B", "C", "D"):
        await create(runtime, task)
    events = runtime.subscribe()
    await move(runtime, "A", "work")
    await promoted_entry(events, "A")  # A now holds review's only slot
    await move(runtime, "B", "work")
    await move(runtime, "C", "work")  # work is full (B, C)
    queued = await move(runtime, "D", "review")  # review is full: D is queued there
    assert "task_queued" in [e.type for e in queued]

    await move(runtime, "C", "done")  # a work slot frees while review stays full
    entered = await promoted_entry(events, "D")
    assert entered.step_id == "work"  # the step actually occupied, not the requested target
    [entry] = await list_entries(runtime, "D")
    assert (entry["step_id"], entry["entry_path"]) == ("work", "E3")
    task = (await ok(runtime, {"type": "get_task", "task_id": "D"})).result
    assert (task["step_id"], task["wip_admitted"], task["queued_for_step_id"]) == ("work", True, "review")


async def test_creation_into_a_full_step_is_queued_or_placed_in_the_feeder_or_refused(
    runtime: Runtime,
) -> None:
    await setup(runtime)
    await create(runtime, "A", "solo")
    queued = await create(runtime, "B", "solo")  # no feeder: queued at the target
    assert (queued["step_id"], queued["wip_admitted"]) == ("solo", False)
    events = runtime.subscribe()
    await create(runtime, "C", "work")
    await create(runtime, "R", "review")  # creation is not an entry: R just occupies review
    fed = await create(runtime, "D", "review")  # review full, feeder has room: placed in work, tagged
    assert (fed["step_id"], fed["wip_admitted"], fed["queued_for_step_id"]) == ("work", True, "review")
    refused = await send(
        runtime, {"type": "create_task", "task_id": "E", "workflow_id": "wip-flow", "step_id": "review"}
    )  # review full and work full (C, D)
    assert not refused.ok and refused.error is not None
    assert (refused.error.code, refused.error.field) == ("wip_limit", "step_id")
    assert "review" in refused.error.message and "1" in refused.error.message
    missing = await send(runtime, {"type": "get_task", "task_id": "E"})
    assert missing.error is not None and missing.error.code == "not_found"  # nothing was inserted
    del events


async def test_start_up_promotes_into_a_step_that_has_room(db_path: Path) -> None:
    async with open_runtime(db_path) as rt:
        await setup(rt)
        await create(rt, "A")
        await create(rt, "B")
        await move(rt, "A", "solo")
        await move(rt, "B", "solo")  # queued behind A
    async with open_runtime(db_path) as rt:  # A leaves while no runtime runs (another writer, say)
        await rt.services.store.transact(
            lambda conn: conn.execute("UPDATE tasks SET workflow_step_id = 'done' WHERE id = 'A'")
        )
    async with open_runtime(db_path) as rt:
        with trio.fail_after(5):
            while not await list_entries(rt, "B"):
                await trio.sleep(0.01)
        assert [(e["step_id"], e["entry_path"]) for e in await list_entries(rt, "B")] == [("solo", "E3")]
