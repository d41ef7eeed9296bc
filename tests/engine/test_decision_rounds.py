"""A vote counts only in the review round it was cast for: `record_decision` names the round
(`entry_seq`, the step entry of the run that asked), and a vote of an earlier round, or of a round the task
has left, is answered not counted and recorded nowhere, even after retention pruned its receipt (the latest
entry of a step is never pruned: it is the round every earlier one is told by). Real databases (both
backends), real Trio scheduling, a clock moved by hand (tests/hand_clock.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hand_clock import HandClock
from helpers import decide, list_decisions, send, setup_office, step_of, to_review, turn_complete

from onceflow.actors.runtime.retention import prune
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime

WEEK = 7 * 24 * 3600.0


def verdict(reply: Any) -> tuple[Any, ...]:
    result = reply.result
    return (result["recorded"], result["counted"], result["not_counted_reason"], result["decision_id"])


async def second_round(rt: Runtime) -> None:
    """T1 in its first review round: rev-a approves (a-1, round 1), rev-b rejects, back to Work and to
    Review again: round 2, the first round's decisions cleared."""
    await to_review(rt, "T1")
    await decide(rt, "T1", "review", "rev-a", "approved", decision_id="a-1", entry_seq=1)
    await decide(rt, "T1", "review", "rev-b", "rejected", decision_id="b-1", entry_seq=1)
    assert await step_of(rt, "T1") == "work"
    await turn_complete(rt, "T1")
    assert await list_decisions(rt, "T1", "review") == []


async def test_a_vote_of_an_earlier_round_redelivered_after_its_receipt_was_pruned_does_not_count(
    db_path: Path | str, kandev_templates: Path, hand_clock: HandClock
) -> None:
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await second_round(rt)
        hand_clock.advance(WEEK + 1)
        deleted = await prune(rt.services.store, rt.services.clock, WEEK)
        assert deleted["decision_receipts"] == 2
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:  # the ledger starts empty
        again = await decide(rt, "T1", "review", "rev-a", "approved", decision_id="a-1", entry_seq=1)
        assert verdict(again) == (False, False, "earlier_round", None)
        assert [d.fields["reason"] for d in again.events if d.type == "diagnostic"] == ["earlier_round"]
        assert await list_decisions(rt, "T1", "review") == []
        now = await decide(rt, "T1", "review", "rev-b", "approved", decision_id="b-2", entry_seq=2)
        assert now.result["counted"] is True
        assert await step_of(rt, "T1") == "review"  # rev-a's old approval is not part of this round's quorum
        await decide(rt, "T1", "review", "rev-a", "approved", decision_id="a-2", entry_seq=2)
        assert await step_of(rt, "T1") == "approval"


async def test_a_late_vote_for_a_round_the_task_left_never_counts_when_it_returns(
    db_path: Path | str, kandev_templates: Path, hand_clock: HandClock
) -> None:
    """rev-a's round-1 vote arrives while T1 is back at Work (round 1 over, round 2 not begun): answered
    `task_not_at_step` and not recorded, so round 2 never sees it; sent again in round 2, `earlier_round`."""
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await to_review(rt, "T1")
        await decide(rt, "T1", "review", "rev-b", "rejected", entry_seq=1)
        late = await decide(rt, "T1", "review", "rev-a", "approved", decision_id="a-1", entry_seq=1)
        assert verdict(late) == (False, False, "task_not_at_step", None)
        await turn_complete(rt, "T1")
        assert await list_decisions(rt, "T1", "review") == []
        again = await decide(rt, "T1", "review", "rev-a", "approved", decision_id="a-1x", entry_seq=1)
        assert verdict(again) == (False, False, "earlier_round", None)


async def test_a_vote_for_a_round_not_begun_is_refused_naming_entry_seq(
    db_path: Path | str, kandev_templates: Path, hand_clock: HandClock
) -> None:
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await setup_office(rt, kandev_templates / "office-default.yml")
        await to_review(rt, "T1")
        message = {"type": "record_decision", "task_id": "T1", "step_id": "review", "decider_type": "agent",
                   "decider_id": "rev-a", "role": "reviewer", "decision": "approved"}  # fmt: skip
        ahead = await send(rt, {**message, "entry_seq": 2})
        assert (ahead.ok, ahead.error.code, ahead.error.field) == (False, "not_found", "entry_seq")
        zero = await send(rt, {**message, "entry_seq": 0})
        assert (zero.ok, zero.error.code, zero.error.field) == (False, "invalid_message", "entry_seq")
        counted = await send(rt, {**message, "entry_seq": 1})
        assert counted.result["counted"] is True
