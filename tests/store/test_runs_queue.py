"""The runs queue seen through the protocol: coalescing scope and coalesced keys."""

from __future__ import annotations

from pathlib import Path

from hand_clock import HandClock
from helpers import FakeClock, add_participant, events, ok, register, send

from onceflow import RecordingHost, open_runtime
from onceflow.actors.runtime.supervisor import Runtime

AGENT_ERROR_TO_CEO = """
id: ceo-flow
name: CEO flow
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_agent_error:
        - type: queue_run
          config:
            target: workspace.ceo_agent
            reason: agent_error
      on_blocker_resolved:
        - type: queue_run
          config:
            target: primary
            reason: blockers_resolved
      on_comment:
        - type: queue_run
          config:
            target: primary
            reason: task_comment
"""


async def _task(rt: Runtime, task_id: str) -> None:
    await ok(
        rt,
        {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": "ceo-flow",
            "session_id": f"s-{task_id}",
            "primary_agent_id": "worker",
            "ceo_agent_id": "ceo",
        },
    )


async def _agent_error(rt: Runtime, task_id: str, run_id: str) -> list[str]:
    reply = await ok(rt, {"type": "agent_error", "task_id": task_id, "run_id": run_id})
    return [e.type for e in reply.events if e.type.startswith("run_")]


async def test_coalescing_never_crosses_tasks(runtime: Runtime, clock: FakeClock) -> None:
    """Two tasks sharing the workspace CEO agent error within 5 s: each task gets its own run."""
    await register(runtime, AGENT_ERROR_TO_CEO)
    await _task(runtime, "T1")
    await _task(runtime, "T2")
    assert await _agent_error(runtime, "T1", "r-1") == ["run_queued"]
    clock.advance(1)
    assert await _agent_error(runtime, "T2", "r-2") == ["run_queued"]  # not folded into T1's run
    clock.advance(1)
    assert await _agent_error(runtime, "T1", "r-3") == ["run_coalesced"]  # within one task it still merges
    queued = (await ok(runtime, {"type": "list_runs", "agent_profile_id": "ceo"})).result["runs"]
    assert [(r["task_id"], r["coalesced_count"]) for r in queued] == [("T1", 1), ("T2", 0)]


async def test_a_coalesced_enqueue_is_a_no_op_when_redelivered_after_a_restart(db_path: Path) -> None:
    """agent_error r-2 merges into r-1's run; redelivered after a restart (the ledger starts empty) it queues
    nothing, because the merge recorded r-2's key."""
    clock = FakeClock()
    async with open_runtime(db_path, host=RecordingHost(), clock=clock) as rt:
        await register(rt, AGENT_ERROR_TO_CEO)
        await _task(rt, "T1")
        assert await _agent_error(rt, "T1", "r-1") == ["run_queued"]
        clock.advance(2)
        assert await _agent_error(rt, "T1", "r-2") == ["run_coalesced"]
    clock.advance(3600)
    async with open_runtime(db_path, host=RecordingHost(), clock=clock) as rt:
        reply = await send(rt, {"type": "agent_error", "task_id": "T1", "run_id": "r-2"})
        assert reply.ok, reply.error
        [suppressed] = events(reply, "run_suppressed")
        runs = (await ok(rt, {"type": "list_runs", "task_id": "T1"})).result["runs"]
        assert len(runs) == 1 and suppressed.existing_run_id == runs[0]["id"]
        assert runs[0]["coalesced_count"] == 1


async def _comment(rt: Runtime, comment_id: str) -> list[str]:
    reply = await ok(rt, {"type": "task_comment", "task_id": "T1", "comment_id": comment_id})
    return [e.type for e in reply.events if e.type.startswith("run_")]


async def test_ac_h6_a_comment_key_is_honoured_while_its_run_is_unresolved_across_restarts(
    db_path: Path, hand_clock: HandClock
) -> None:
    """Comment c-1's run stays queued for 25 h: redelivered after restarts (the ledger starts empty) it
    queues nothing; past its 24 h age limit it is never handed out (cancelled `run_too_old` when claimed),
    and 24 h after that a redelivery queues a new one. Time stands still but where it is moved by hand, so
    the window's edge is exact."""
    clock = hand_clock
    async with open_runtime(db_path, host=RecordingHost(), clock=clock.wall) as rt:
        await register(rt, AGENT_ERROR_TO_CEO)
        await _task(rt, "T1")
        assert await _comment(rt, "c-1") == ["run_queued"]
    clock.advance(25 * 3600)
    async with open_runtime(db_path, host=RecordingHost(), clock=clock.wall) as rt:
        assert await _comment(rt, "c-1") == ["run_suppressed"]  # still queued after 25 h
        claimed = await ok(rt, {"type": "claim_run", "agent_profile_id": "worker"})
        assert claimed.result is None
        assert [e.reason for e in claimed.events if e.type == "run_cancelled"] == ["run_too_old"]
        clock.advance(24 * 3600 - 1)
    async with open_runtime(db_path, host=RecordingHost(), clock=clock.wall) as rt:
        assert await _comment(rt, "c-1") == ["run_suppressed"]  # within 24 h of resolving
        clock.advance(1)
    async with open_runtime(db_path, host=RecordingHost(), clock=clock.wall) as rt:
        assert await _comment(rt, "c-1") == ["run_queued"]
        assert len((await ok(rt, {"type": "list_runs", "task_id": "T1"})).result["runs"]) == 2


ROLE_TARGET = """
id: role-flow
name: Role flow
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_blocker_resolved:
        - type: queue_run
          config: {target: "participant_role:reviewer", reason: unblocked}
      on_turn_complete:
        - type: move_to_step
          config: {step_id: review}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: queue_run
          config: {target: "participant_role:reviewer", reason: review_requested}
"""


async def test_ac_a7_participant_role_target_wakes_every_match(runtime: Runtime) -> None:
    """rev-a and rev-b seated: queue_run to participant_role:reviewer queues one run for each, each with its
    own key, on an event trigger and on on_enter alike (AC-A7's same target resolution)."""
    await register(runtime, ROLE_TARGET)
    for step in ("work", "review"):
        for reviewer in ("rev-a", "rev-b"):
            await add_participant(runtime, "role-flow", step, "reviewer", reviewer)
    await ok(
        runtime,
        {"type": "create_task", "task_id": "T1", "workflow_id": "role-flow", "primary_agent_id": "worker"},
    )
    unblocked = await ok(runtime, {"type": "blockers_resolved", "task_id": "T1"})
    entered = await ok(runtime, {"type": "turn_complete", "task_id": "T1"})
    for reply, reason in ((unblocked, "unblocked"), (entered, "review_requested")):
        queued = events(reply, "run_queued")
        assert [(e.agent_profile_id, e.reason) for e in queued] == [("rev-a", reason), ("rev-b", reason)]
        keys = [e.idempotency_key for e in queued]
        assert None not in keys and len(set(keys)) == 2
    runs = (await ok(runtime, {"type": "list_runs", "task_id": "T1"})).result["runs"]
    assert sorted((r["agent_profile_id"], r["reason"]) for r in runs) == [
        ("rev-a", "review_requested"),
        ("rev-a", "unblocked"),
        ("rev-b", "review_requested"),
        ("rev-b", "unblocked"),
    ]
    assert all(r["exclude_from_coalescing"] for r in runs if r["reason"] == "review_requested")
