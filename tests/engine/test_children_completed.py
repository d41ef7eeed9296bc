"""children_completed fires only when every child is terminal (Kandev's orchestrator rule).

A child is terminal by state (COMPLETED, FAILED, CANCELLED) or by sitting in its workflow's terminal step
(the last step by position named done / complete / completed / approved). Otherwise nothing runs, nothing is
marked, and the reply names the open children. Driven through the protocol on a real SQLite file.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import list_runs, ok, send, step_of

from onceflow.actors.engine.children import terminal_step
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol import commands as c
from onceflow.protocol.events import Reply
from onceflow.protocol.operation_ids import operation_id
from onceflow.protocol.workflow import load_workflow_text

# Registered through the import path: a transition under an event trigger is declarable only there.
PARENT = """\
id: parent
name: Parent
steps:
  - id: waiting
    name: Waiting
    position: 0
    is_start_step: true
    events:
      on_children_completed:
        - type: queue_run
          config: {target: "agent_profile_id:parent-bot", reason: children_done}
        - type: move_to_step
          config: {step_id: merged}
  - {id: merged, name: Merged, position: 1}
"""

# Two steps carry a terminal name; only the later one by position is the terminal step. The YAML lists
# them out of position order so that list order cannot stand in for position.
KID = """\
id: kid
name: Kid
steps:
  - {id: archive, name: Archive, position: 3}
  - {id: todo, name: Todo, position: 0, is_start_step: true}
  - {id: approved, name: "  APPROVED ", position: 2}
  - {id: done, name: Done, position: 1}
"""


async def setup(rt: Runtime) -> None:
    for text in (PARENT, KID):
        await ok(
            rt, {"type": "register_workflow", "yaml": text, "source": "children.yml", "import_path": True}
        )
    await ok(rt, {"type": "create_task", "task_id": "P", "workflow_id": "parent", "session_id": "s-P"})


def row(task_id: str, state: str, step_id: str | None = None) -> dict[str, Any]:
    place = {"workflow_id": "kid", "step_id": step_id} if step_id else {}
    return {"task_id": task_id, "state": state, **place}


async def children_completed(rt: Runtime, rows: list[dict[str, Any]]) -> Reply:
    return await ok(rt, {"type": "children_completed", "task_id": "P", "children": rows})


def op_of(rows: list[dict[str, Any]]) -> str:
    return operation_id(c.ChildrenCompleted(task_id="P", children=[c.ChildRow(**r) for r in rows]))


async def parent_runs(rt: Runtime) -> list[dict[str, Any]]:
    return await list_runs(rt, task_id="P")


async def test_children_completed_fires_only_when_every_child_terminal(runtime: Runtime) -> None:
    await setup(runtime)
    open_set = [row("c1", "COMPLETED"), row("c2", "IN_PROGRESS", "todo")]
    refused = await children_completed(runtime, open_set)

    assert refused.result["not_terminal"] == [
        {"task_id": "c2", "state": "IN_PROGRESS", "workflow_id": "kid", "step_id": "todo"}
    ]
    assert (refused.result["transitioned"], refused.result["applied"]) == (False, False)
    assert [(e.type, getattr(e, "code", "")) for e in refused.events] == [
        ("diagnostic", "children_not_terminal")
    ]
    assert refused.events[0].fields["not_terminal"] == ["c2"]
    assert await step_of(runtime, "P") == "waiting"
    assert await parent_runs(runtime) == []  # the trigger's other actions did not run either
    assert not await runtime.services.ledger.is_applied(op_of(open_set))  # nothing marked

    # The same operation id (a child's place is not hashed) now with c2 in kid's terminal step: it fires.
    complete = [row("c1", "COMPLETED"), row("c2", "IN_PROGRESS", "approved")]
    assert op_of(complete) == op_of(open_set)
    fired = await children_completed(runtime, complete)
    assert (fired.result["applied"], fired.result["not_terminal"]) == (True, [])
    assert await step_of(runtime, "P") == "merged"
    assert [r["agent_profile_id"] for r in await parent_runs(runtime)] == ["parent-bot"]
    assert await runtime.services.ledger.is_applied(op_of(complete))


async def test_children_completed_terminal_states_are_completed_failed_cancelled_in_any_case(
    runtime: Runtime,
) -> None:
    await setup(runtime)
    not_yet = await children_completed(runtime, [row("c1", "COMPLETED"), row("c2", "done")])
    assert [r["task_id"] for r in not_yet.result["not_terminal"]] == ["c2"]  # "done" is no task state
    fired = await children_completed(
        runtime, [row("c1", "completed"), row("c2", "FAILED"), row("c3", "Cancelled")]
    )
    assert fired.result["applied"] is True
    assert await step_of(runtime, "P") == "merged"


@pytest.mark.parametrize(
    ("step_id", "terminal"), [("approved", True), ("done", False), ("archive", False), ("todo", False)]
)
async def test_children_completed_terminal_step_is_the_last_by_position_with_a_terminal_name(
    runtime: Runtime, step_id: str, terminal: bool
) -> None:
    """kid's steps by position: Todo, Done, APPROVED, Archive. Done and APPROVED carry terminal names and
    APPROVED is the later one, so it alone is terminal; Archive is last but carries no terminal name."""
    await setup(runtime)
    reply = await children_completed(runtime, [row("c1", "IN_PROGRESS", step_id)])
    assert (reply.result["applied"], reply.result["not_terminal"] == []) == (terminal, terminal)
    assert await step_of(runtime, "P") == ("merged" if terminal else "waiting")


def test_children_completed_terminal_step_names_are_case_insensitive() -> None:
    for name, expected in (("COMPLETE", "b"), ("Completed", "b"), ("done", "b"), ("Finished", "a")):
        workflow = load_workflow_text(
            "id: w\nname: W\nsteps:\n"
            "  - {id: a, name: Done, position: 0, is_start_step: true}\n"
            f"  - {{id: b, name: {name}, position: 1}}\n",
            "w.yml",
        )
        last = terminal_step(workflow)
        assert last is not None and last.id == expected, name


async def test_children_completed_reads_where_a_child_task_sits_when_its_row_names_no_place(
    runtime: Runtime,
) -> None:
    await setup(runtime)
    await ok(runtime, {"type": "create_task", "task_id": "c1", "workflow_id": "kid", "session_id": "s-c1"})
    rows = [row("c1", "IN_PROGRESS"), row("ghost", "IN_PROGRESS")]
    refused = await children_completed(runtime, rows)
    assert refused.result["not_terminal"] == [
        {"task_id": "c1", "state": "IN_PROGRESS", "workflow_id": "kid", "step_id": "todo"},
        {"task_id": "ghost", "state": "IN_PROGRESS", "workflow_id": None, "step_id": None},  # unknown place
    ]
    await ok(runtime, {"type": "move_task", "task_id": "c1", "step_id": "approved"})
    rows = [row("c1", "IN_PROGRESS"), row("ghost", "CANCELLED")]
    assert (await children_completed(runtime, rows)).result["applied"] is True


async def test_children_completed_row_naming_an_unknown_place_is_refused_and_nothing_is_marked(
    runtime: Runtime,
) -> None:
    await setup(runtime)
    rows = [
        row("c1", "COMPLETED"),
        {"task_id": "c2", "state": "IN_PROGRESS", "workflow_id": "kid", "step_id": "x"},
    ]
    reply = await send(runtime, {"type": "children_completed", "task_id": "P", "children": rows})
    assert reply.error is not None
    assert (reply.ok, reply.error.code, reply.error.field) == (False, "not_found", "children.1.step_id")
    rows[1] = {"task_id": "c2", "state": "IN_PROGRESS", "workflow_id": "nope", "step_id": "x"}
    reply = await send(runtime, {"type": "children_completed", "task_id": "P", "children": rows})
    assert reply.error is not None and reply.error.field == "children.1.workflow_id"
    half = {"task_id": "c2", "state": "IN_PROGRESS", "step_id": "done"}
    reply = await send(runtime, {"type": "children_completed", "task_id": "P", "children": [half]})
    assert reply.error is not None and reply.error.code == "invalid_message"
    assert not await runtime.services.ledger.is_applied(op_of(rows))
    assert await step_of(runtime, "P") == "waiting"
