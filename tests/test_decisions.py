"""A host's decision id makes record_decision idempotent, within a process and across restarts."""

from __future__ import annotations

from pathlib import Path

from helpers import (
    FakeClock,
    decide,
    list_decisions,
    list_runs,
    setup_office,
    step_of,
    to_review,
    turn_complete,
)

from onceflow import RecordingHost, open_runtime


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
