"""A host's decision id makes record_decision idempotent, within a process and across restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import (
    FakeClock,
    add_participant,
    decide,
    diagnostics,
    events,
    list_decisions,
    list_runs,
    ok,
    register,
    send,
    setup_office,
    step_of,
    to_review,
    turn_complete,
)

from onceflow import RecordingHost, open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply


async def test_a_vote_redelivered_after_a_restart_never_counts_in_a_later_round(
    db_path: Path, kandev_templates: Path
) -> None:
    clock = FakeClock()
    async with open_runtime(db_path, host=RecordingHost(), clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await to_review(rt, "T1")
        await decide(rt, "T1", "review", "rev-a", "rejected", decision_id="round1-rev-a")
        assert await step_of(rt, "T1") == "work"
    async with open_runtime(db_path, host=RecordingHost(), clock=clock) as rt:  # the ledger starts empty
        await turn_complete(rt, "T1")  # round 2: a new entry clears the review decisions
        assert await list_decisions(rt, "T1", "review") == []
        again = await decide(rt, "T1", "review", "rev-a", "rejected", decision_id="round1-rev-a")
        assert again.result["recorded"] is False
        assert [e.type for e in again.events if e.type == "decision_recorded"] == []
        assert await list_decisions(rt, "T1", "review") == []
        assert await step_of(rt, "T1") == "review"  # the old veto did not send the task back
        for reviewer in ("rev-a", "rev-b"):
            await decide(rt, "T1", "review", reviewer, "approved", decision_id=f"round2-{reviewer}")
        assert await step_of(rt, "T1") == "approval"
        review_runs = [r for r in await list_runs(rt, task_id="T1") if r["reason"] == "review_started"]
        assert len(review_runs) == 4  # two rounds, two reviewers each


async def test_without_a_decision_id_every_delivery_is_a_new_vote(
    db_path: Path, kandev_templates: Path
) -> None:
    async with open_runtime(db_path) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await to_review(rt, "T1")
        for _ in range(2):
            reply = await decide(rt, "T1", "review", "rev-a", "approved")
            assert reply.result["recorded"] is True
        assert len(await list_decisions(rt, "T1", "review")) == 2


# --- a decision's seat and its receipt ----------------------------------------------------------------

REVIEW = """
id: review-flow
name: Review flow
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_turn_complete:
        - type: move_to_step
          config: {step_id: review}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: clear_decisions
      on_turn_complete:
        - type: move_to_step
          config:
            step_id: done
            wait_for_quorum: {role: reviewer, threshold: all_approve}
        - type: move_to_step
          config:
            step_id: work
            wait_for_quorum: {role: reviewer, threshold: any_reject}
  - id: done
    name: Done
    position: 2
"""


async def _review_flow(rt: Runtime, task_id: str = "T1") -> None:
    """Register REVIEW, seat rev-a and rev-b at review, create `task_id` in work and send it to review."""
    await register(rt, REVIEW)
    for reviewer in ("rev-a", "rev-b"):
        await add_participant(rt, "review-flow", "review", "reviewer", reviewer)
    await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "review-flow"})
    await turn_complete(rt, task_id)


async def _vote(rt: Runtime, decider: str, decision: str, **extra: Any) -> Reply:
    """A role-less decision by agent `decider` on T1 at review."""
    return await send(
        rt,
        {
            "type": "record_decision",
            "task_id": "T1",
            "step_id": "review",
            "decider_type": "agent",
            "decider_id": decider,
            "decision": decision,
            **extra,
        },
    )


async def test_a_decision_without_role_counts_from_the_decider_seat(runtime: Runtime) -> None:
    """Seated reviewers approve with no `role`: the role comes from the seat and the guard moves."""
    await _review_flow(runtime)
    first = await _vote(runtime, "rev-a", "approved")
    assert first.ok, first.error
    assert {k: first.result[k] for k in ("recorded", "role", "counted", "guard_outcome", "moved_to")} == {
        "recorded": True,
        "role": "reviewer",
        "counted": True,
        "guard_outcome": "quorum_not_met",
        "moved_to": None,
    }
    assert [e.role for e in events(first, "decision_recorded")] == ["reviewer"]
    assert diagnostics(first, "decision_not_counted") == []
    second = await _vote(runtime, "rev-b", "approved")
    assert (second.result["guard_outcome"], second.result["moved_to"]) == ("moved", "done")
    assert await step_of(runtime, "T1") == "done"


async def test_a_per_task_seat_beats_a_template_seat_when_resolving_the_role(
    runtime: Runtime,
) -> None:
    """rev-a holds a template seat as approver and a per-task seat as reviewer: the vote is a reviewer's."""
    await register(runtime, REVIEW)
    await add_participant(runtime, "review-flow", "review", "approver", "rev-a")
    await ok(runtime, {"type": "create_task", "task_id": "T1", "workflow_id": "review-flow"})
    await ok(
        runtime,
        {
            "type": "add_participant",
            "task_id": "T1",
            "step_id": "review",
            "role": "reviewer",
            "agent_profile_id": "rev-a",
        },
    )
    await turn_complete(runtime, "T1")
    reply = await _vote(runtime, "rev-a", "approved")
    assert (reply.result["role"], reply.result["counted"], reply.result["moved_to"]) == (
        "reviewer",
        True,
        "done",
    )


async def test_a_decision_matching_no_seat_is_recorded_uncounted_with_a_warning(
    runtime: Runtime,
) -> None:
    await _review_flow(runtime)
    reply = await _vote(runtime, "stranger", "approved")
    assert reply.ok, reply.error
    result = reply.result
    assert (result["recorded"], result["counted"], result["not_counted_reason"]) == (
        True,
        False,
        "no_matching_seat",
    )
    assert result["guard_outcome"] == "quorum_not_met"
    [warning] = diagnostics(reply, "decision_not_counted")
    assert warning.level == "warning"
    assert (warning.fields["decider_id"], warning.fields["reason"]) == ("stranger", "no_matching_seat")


async def test_a_decision_for_a_step_the_task_is_not_in_is_uncounted_with_a_warning(
    runtime: Runtime,
) -> None:
    await _review_flow(runtime)
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    reply = await _vote(runtime, "rev-a", "rejected")
    assert reply.ok, reply.error
    result = reply.result
    assert (result["counted"], result["not_counted_reason"]) == (False, "task_not_at_step")
    assert (result["guard_outcome"], result["moved_to"]) == ("not_at_step", None)
    assert events(reply, "guard_evaluated") == []
    [warning] = diagnostics(reply, "decision_not_counted")
    assert (warning.level, warning.fields["step_id"], warning.fields["reason"]) == (
        "warning",
        "review",
        "task_not_at_step",
    )


class _MovesAwayHost(RecordingHost):
    """Moves the task back to work (another writer's move) just before the engine's compare-and-set."""

    runtime: Runtime | None = None

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        assert self.runtime is not None
        await self.runtime.services.store.transact(
            lambda conn: conn.execute("UPDATE tasks SET workflow_step_id = 'work' WHERE id = ?", (task_id,))
        )


async def test_guard_outcome_tells_quorum_not_met_from_move_abandoned(db_path: Path) -> None:
    host = _MovesAwayHost()
    async with open_runtime(db_path, host=RecordingHost()) as rt:
        await _review_flow(rt)
        pending = await _vote(rt, "rev-a", "approved")
        assert (pending.result["guard_outcome"], pending.result["moved_to"]) == ("quorum_not_met", None)
    async with open_runtime(db_path, host=host) as rt:
        host.runtime = rt
        lost = await _vote(rt, "rev-b", "approved")
        assert lost.ok, lost.error
        assert (lost.result["guard_outcome"], lost.result["moved_to"]) == ("move_abandoned", None)
        assert [d.code for d in events(lost, "diagnostic")] == ["transition_abandoned"]


async def test_reused_decision_id_with_another_verdict_is_a_conflict(db_path: Path) -> None:
    """vote-1 = changes_requested, then next round vote-1 = approved: a conflict, in process and after a
    restart; the same content again is a replay."""
    async with open_runtime(db_path, host=RecordingHost()) as rt:
        await _review_flow(rt)
        first = await _vote(rt, "rev-a", "changes_requested", decision_id="vote-1")
        assert first.ok and first.result["moved_to"] == "work"
        await turn_complete(rt, "T1")  # round 2
        conflict = await _vote(rt, "rev-a", "approved", decision_id="vote-1")
        assert not conflict.ok and (conflict.error.code, conflict.error.field) == ("conflict", "decision_id")
        replay = await _vote(rt, "rev-a", "changes_requested", decision_id="vote-1")
        assert replay.ok and replay.result == {
            "idempotent": True,
            "operation_id": "decision:T1:review:vote-1",
        }
    async with open_runtime(db_path, host=RecordingHost()) as rt:  # the ledger starts empty
        conflict = await _vote(rt, "rev-a", "approved", decision_id="vote-1")
        assert not conflict.ok and (conflict.error.code, conflict.error.field) == ("conflict", "decision_id")
        replay = await _vote(rt, "rev-a", "changes_requested", decision_id="vote-1")
        assert replay.ok, replay.error
        assert (replay.result["recorded"], replay.result["counted"]) == (False, None)
        assert await step_of(rt, "T1") == "review"  # round 1's veto was not counted again
        assert await list_decisions(rt, "T1", "review") == []
