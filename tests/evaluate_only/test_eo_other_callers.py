"""The callers around the contract: record_decision's in-call commit (AC-EO-9), the turn triggers that carry
no operation id and children_completed's own check/commit/mark bracket (AC-EO-16).
"""

from __future__ import annotations

from typing import Any

from eo_support import (
    TASK,
    ScriptedHost,
    applied,
    callbacks,
    create,
    evaluate,
    move_to,
    moves,
    queue,
    runs_for,
    spy_ledger,
    step_of,
    workflow_yaml,
)
from helpers import ok, register

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol import commands as c
from onceflow.protocol.events import Reply
from onceflow.protocol.operation_ids import operation_id
from onceflow.protocol.workflow import Trigger

# --- AC-EO-9: record_decision -------------------------------------------------------------------------

REVIEW = workflow_yaml(
    {
        "review": {
            "is_start_step": True,
            "events": {
                "on_turn_complete": [
                    {
                        "type": "move_to_step",
                        "config": {
                            "step_id": "done",
                            "wait_for_quorum": {"role": "reviewer", "threshold": "all_approve"},
                        },
                    }
                ]
            },
        },
        "done": {},
    },
    workflow_id="eo-review",
)
DECISION_OP = f"decision:{TASK}:review:d1"


async def setup_review(rt: Runtime) -> None:
    await register(rt, REVIEW, import_path=True)
    await ok(
        rt,
        {
            "type": "add_participant",
            "workflow_id": "eo-review",
            "step_id": "review",
            "role": "reviewer",
            "agent_profile_id": "rev-a",
        },
    )
    await create(rt, "review", workflow_id="eo-review")


async def approve(rt: Runtime) -> Reply:
    return await rt.send(
        {
            "type": "record_decision",
            "task_id": TASK,
            "step_id": "review",
            "decider_type": "agent",
            "decider_id": "rev-a",
            "role": "reviewer",
            "decision": "approved",
            "decision_id": "d1",
        }
    )


async def test_ac_eo_9_record_decision_marks_after_its_in_call_commit(runtime: Runtime) -> None:
    await setup_review(runtime)
    reply = await approve(runtime)
    assert reply.ok, reply.error
    assert (reply.result["moved_to"], reply.result["operation_id"]) == ("done", DECISION_OP)
    assert moves(reply.events) == [("review", "done")]
    assert await applied(runtime, DECISION_OP)
    again = await approve(runtime)
    assert again.result == {"idempotent": True, "operation_id": DECISION_OP}
    assert again.events == []
    decisions = await ok(runtime, {"type": "list_decisions", "task_id": TASK, "step_id": "review"})
    assert len(decisions.result["decisions"]) == 1


async def test_ac_eo_9_failed_commit_leaves_the_decision_operation_unmarked(
    runtime: Runtime, host: ScriptedHost
) -> None:
    await setup_review(runtime)
    host.refuse = True
    refused = await approve(runtime)
    assert not refused.ok
    assert refused.error.code == "transition_refused"
    assert await step_of(runtime) == "review"
    assert not await applied(runtime, DECISION_OP)

    host.refuse = False
    retried = await approve(runtime)
    assert retried.ok, retried.error
    assert retried.result["moved_to"] == "done"
    assert await applied(runtime, DECISION_OP)
    assert (await approve(runtime)).result["idempotent"] is True


# --- AC-EO-16: turn triggers carry no operation id -----------------------------------------------------

TURNS = workflow_yaml(
    {
        "a": {"is_start_step": True, "events": {"on_turn_complete": [move_to("b")]}},
        "b": {"events": {"on_turn_start": [move_to("a")]}},
    },
    workflow_id="eo-turns",
)


async def test_ac_eo_16_turn_triggers_carry_no_operation_id_and_commit_in_call(
    runtime: Runtime, monkeypatch
) -> None:
    await register(runtime, TURNS, import_path=True)
    await create(runtime, "a", workflow_id="eo-turns")
    spy = spy_ledger(monkeypatch, runtime)
    for command, expected in [("turn_complete", ("a", "b")), ("turn_start", ("b", "a"))] * 2:
        reply = await ok(runtime, {"type": command, "task_id": TASK})
        result = reply.result
        assert result["operation_id"] is None
        assert (result["transitioned"], result["applied"], result["operation_mark_deferred"]) == (
            True,
            True,
            False,
        )
        assert moves(reply.events) == [expected]  # every delivery acts: nothing to be idempotent on
    assert (spy.checked, spy.marked) == ([], [])


# --- AC-EO-16: children_completed keeps its own bracket ---------------------------------------------------

PARENT = workflow_yaml(
    {
        "waiting": {
            "is_start_step": True,
            "events": {"on_children_completed": [queue("parent-bot"), move_to("merged")]},
        },
        "merged": {},
    },
    workflow_id="eo-parent",
)
CHILDREN = [{"task_id": "c1", "state": "COMPLETED"}, {"task_id": "c2", "state": "COMPLETED"}]
CHILDREN_OP = operation_id(c.ChildrenCompleted(task_id=TASK, children=[c.ChildRow(**r) for r in CHILDREN]))


async def children_completed(rt: Runtime, children: list[dict[str, Any]] = CHILDREN) -> Reply:
    return await rt.send({"type": "children_completed", "task_id": TASK, "children": children})


async def setup_parent(rt: Runtime) -> None:
    await register(rt, PARENT, import_path=True)
    await create(rt, "waiting", workflow_id="eo-parent")


async def test_ac_eo_16_children_completed_double_delivery_transitions_once(runtime: Runtime) -> None:
    await setup_parent(runtime)
    first = await children_completed(runtime)
    assert first.ok, first.error
    assert (first.result["operation_id"], first.result["applied"]) == (CHILDREN_OP, True)
    assert moves(first.events) == [("waiting", "merged")]
    # The same rows in another order are the same operation: the second delivery is a no-op.
    second = await children_completed(runtime, CHILDREN[::-1])
    assert second.result == {"idempotent": True, "operation_id": CHILDREN_OP}
    assert second.events == []
    assert await step_of(runtime) == "merged"
    assert len(await runs_for(runtime, "parent-bot")) == 1


async def test_ac_eo_16_children_completed_marks_only_after_its_commit(
    runtime: Runtime, host: ScriptedHost
) -> None:
    await setup_parent(runtime)
    host.refuse = True
    refused = await children_completed(runtime)
    assert refused.ok, refused.error
    assert (refused.result["transitioned"], refused.result["applied"]) == (True, False)
    assert not await applied(runtime, CHILDREN_OP)
    host.refuse = False
    retried = await children_completed(runtime)
    assert (retried.result["idempotent"], retried.result["applied"]) == (False, True)
    assert await applied(runtime, CHILDREN_OP)
    assert (await children_completed(runtime)).result["idempotent"] is True
    assert await step_of(runtime) == "merged"


async def test_ac_eo_16_engine_leaves_the_children_mark_to_its_caller(runtime: Runtime, monkeypatch) -> None:
    """defer_operation_mark: the engine neither checks nor marks; the caller's bracket does both."""
    await setup_parent(runtime)
    await runtime.services.ledger.mark_applied(CHILDREN_OP)
    spy = spy_ledger(monkeypatch, runtime)
    result, out = await evaluate(
        runtime,
        CHILDREN_OP,
        trigger=Trigger.on_children_completed,
        evaluate_only=True,
        defer_operation_mark=True,
    )
    assert (result.idempotent, result.transitioned, result.applied) == (False, True, False)
    assert callbacks(out.events) == [("waiting", "queue_run", "done")]
    assert (spy.checked, spy.marked) == ([], [])
    assert await step_of(runtime) == "waiting"
