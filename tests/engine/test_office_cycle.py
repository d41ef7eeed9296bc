"""The Office cycle (Backlog → Work → Review → Approval → Done), driven only through protocol messages."""

from __future__ import annotations

from pathlib import Path

from hand_clock import HandClock
from helpers import (
    APPROVER,
    OFFICE,
    REVIEWERS,
    FakeClock,
    create_task,
    decide,
    events,
    list_decisions,
    list_entries,
    list_runs,
    move,
    ok,
    send,
    setup_office,
    step_of,
    to_review,
    turn_complete,
)

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.testing import RecordingHost


def review_runs(runs: list[dict]) -> list[dict]:
    return [run for run in runs if run["reason"] == "review_started"]


async def test_office_cycle_end_to_end(office: Runtime, host: RecordingHost) -> None:
    rt = office
    created = await create_task(rt, "T1")
    assert created.result["step_id"] == "backlog"
    assert [e.type for e in created.events] == ["task_created"]

    moved = await move(rt, "T1", "work")
    [action] = events(moved, "session_action")
    assert (action.action, action.session_id, action.step_id) == ("auto_start_agent", "session-T1", "work")
    assert [r.action for r in host.session_actions] == ["auto_start_agent"]

    first = await turn_complete(rt, "T1")
    assert first.result["to_step"] == "review"
    assert await step_of(rt, "T1") == "review"
    queued = events(first, "run_queued")
    assert sorted(run.agent_profile_id for run in queued) == list(REVIEWERS)
    assert {run.reason for run in queued} == {"review_started"}
    assert [e.step_id for e in events(first, "decisions_cleared")] == ["review"]
    assert events(first, "guard_evaluated") == []

    rejected = await decide(rt, "T1", "review", "rev-a", "rejected")
    assert rejected.result["moved_to"] == "work"
    assert await step_of(rt, "T1") == "work"
    guards = {g.threshold: g.satisfied for g in events(rejected, "guard_evaluated")}
    assert guards == {"all_approve": False, "any_reject": True}

    second = await turn_complete(rt, "T1")
    assert await step_of(rt, "T1") == "review"
    assert len(events(second, "run_queued")) == 2
    runs = review_runs(await list_runs(rt, task_id="T1"))
    assert len(runs) == 4
    first_keys = {run.idempotency_key for run in queued}
    second_keys = {run.idempotency_key for run in events(second, "run_queued")}
    assert len(first_keys | second_keys) == 4
    assert {run["idempotency_key"] for run in runs} == first_keys | second_keys
    review_entries = [e for e in await list_entries(rt, "T1") if e["step_id"] == "review"]
    assert [e["entry_seq"] for e in review_entries] == [1, 2]

    await decide(rt, "T1", "review", "rev-a", "approved")
    assert await step_of(rt, "T1") == "review"  # one approval of two seats is not a quorum
    approved = await decide(rt, "T1", "review", "rev-b", "approved")
    assert approved.result["moved_to"] == "approval"
    [approver_run] = events(approved, "run_queued")
    assert (approver_run.agent_profile_id, approver_run.reason) == (APPROVER, "approval_started")
    approval_runs = [r for r in await list_runs(rt, task_id="T1") if r["step_id"] == "approval"]
    assert [(r["agent_profile_id"], r["reason"]) for r in approval_runs] == [(APPROVER, "approval_started")]

    done = await decide(rt, "T1", "approval", APPROVER, "approved", role="approver")
    assert done.result["moved_to"] == "done"
    assert await step_of(rt, "T1") == "done"
    assert len(await list_runs(rt, task_id="T1")) == 5


async def test_restart_mid_cycle_keeps_state_and_the_cycle_continues(
    db_path: Path, kandev_templates: Path, hand_clock: HandClock
) -> None:
    """Time stands still across the restart, so the runs read back exactly as they were (a time ahead of
    the restarted clock would be clamped to it, store/backends/clock.py)."""
    clock = hand_clock.wall
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await to_review(rt, "T1")
        await decide(rt, "T1", "review", "rev-a", "approved")
        before_runs = await list_runs(rt, task_id="T1")
        before_entries = await list_entries(rt, "T1")

    async with open_runtime(db_path, clock=clock) as rt:
        assert await step_of(rt, "T1") == "review"
        assert await list_runs(rt, task_id="T1") == before_runs
        assert await list_entries(rt, "T1") == before_entries
        assert [d["decider_id"] for d in await list_decisions(rt, "T1", "review")] == ["rev-a"]

        approved = await decide(rt, "T1", "review", "rev-b", "approved")  # counts rev-a's pre-restart vote
        assert approved.result["moved_to"] == "approval"
        await decide(rt, "T1", "approval", APPROVER, "approved", role="approver")
        assert await step_of(rt, "T1") == "done"
        assert len(await list_runs(rt, task_id="T1")) == 3


async def test_restart_then_rejection_round_queues_fresh_runs(
    db_path: Path, kandev_templates: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await to_review(rt, "T1")
    async with open_runtime(db_path, clock=clock) as rt:
        await decide(rt, "T1", "review", "rev-b", "rejected")
        again = await turn_complete(rt, "T1")
        assert sorted(run.agent_profile_id for run in events(again, "run_queued")) == list(REVIEWERS)
        assert [e["entry_seq"] for e in await list_entries(rt, "T1") if e["step_id"] == "review"] == [1, 2]
        assert len(review_runs(await list_runs(rt, task_id="T1"))) == 4


async def test_redelivered_decision_is_idempotent(office: Runtime) -> None:
    await to_review(office, "T1")
    first = await decide(office, "T1", "review", "rev-a", "approved", decision_id="d-1")
    assert first.result["operation_id"] == "decision:T1:review:d-1"
    assert "idempotent" not in first.result
    again = await decide(office, "T1", "review", "rev-a", "approved", decision_id="d-1")
    assert again.result["idempotent"] is True
    assert again.events == []
    assert len(await list_decisions(office, "T1", "review")) == 1
    other = await decide(office, "T1", "review", "rev-a", "approved", decision_id="d-2")
    assert "idempotent" not in other.result
    assert len(await list_decisions(office, "T1", "review")) == 2


async def test_claim_returns_the_oldest_queued_run_and_finish_closes_it(office: Runtime) -> None:
    await to_review(office, "T1")
    await to_review(office, "T2")

    first = (await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
    second = (await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
    third = (await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
    assert (first["task_id"], first["status"]) == ("T1", "claimed")
    assert (second["task_id"], second["status"]) == ("T2", "claimed")
    assert third is None
    assert [r["status"] for r in await list_runs(office, agent_profile_id="rev-b")] == ["queued", "queued"]

    finished = await ok(office, {"type": "finish_run", "run_id": first["id"], "unfenced": True})
    assert (finished.result["run_id"], finished.result["status"]) == (first["id"], "finished")
    statuses = {r["id"]: r["status"] for r in await list_runs(office, agent_profile_id="rev-a")}
    assert statuses == {first["id"]: "finished", second["id"]: "claimed"}

    for run_id in (9999, first["id"]):  # unknown, and no longer claimed
        reply = await send(office, {"type": "finish_run", "run_id": run_id})
        assert not reply.ok
        assert (reply.error.code, reply.error.field) == ("not_found", "run_id")


async def test_office_v2_fans_out_task_assigned_with_payload(
    runtime: Runtime, kandev_templates: Path
) -> None:
    await setup_office(runtime, kandev_templates / "office-default-v2.yml")
    reply = await to_review(runtime, "T1")
    assert await step_of(runtime, "T1") == "review"
    queued = events(reply, "run_queued")
    assert sorted(run.agent_profile_id for run in queued) == list(REVIEWERS)
    runs = await list_runs(runtime, task_id="T1")
    assert [(r["reason"], r["payload"]) for r in runs] == [("task_assigned", {"stage_type": "review"})] * 2
    seat = [e for e in events(reply, "action_outcome") if e.kind == "ensure_participant_seat"]
    assert [(e.outcome, e.detail) for e in seat] == [("done", "")]
    [transition] = events(reply, "transition")
    assert (transition.workflow_id, transition.from_step, transition.to_step) == (OFFICE, "work", "review")
