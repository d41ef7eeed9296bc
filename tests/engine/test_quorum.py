"""Quorum guard evaluation (kandev-engine-notes.md, Quorum guards)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.engine.quorum import (
    QuorumResult,
    Threshold,
    evaluate_quorum,
    parse_threshold,
    quorum_seats,
    seat_role,
    why_not_counted,
)
from onceflow.store.records import DeciderType, Decision, DecisionValue, Participant

TASK = "t1"
STEP = "s1"
ROLE = "reviewer"

_ids = itertools.count(1000)


def part(
    agent: str,
    *,
    id: int | None = None,
    task_id: str | None = TASK,
    step_id: str = STEP,
    role: str = ROLE,
    required: bool = True,
) -> Participant:
    return Participant(
        id=next(_ids) if id is None else id,
        workflow_id="wf",
        step_id=step_id,
        task_id=task_id,
        role=role,
        agent_profile_id=agent,
        decision_required=required,
        position=0,
    )


def dec(
    decider_id: str,
    decision: DecisionValue,
    *,
    at: float,
    id: int | None = None,
    participant_id: int | None = None,
    role: str = ROLE,
    decider_type: DeciderType = "agent",
    task_id: str = TASK,
    step_id: str = STEP,
) -> Decision:
    return Decision(
        id=next(_ids) if id is None else id,
        task_id=task_id,
        step_id=step_id,
        participant_id=participant_id,
        role=role,
        decider_type=decider_type,
        decider_id=decider_id,
        decision=decision,
        comment="",
        created_at=at,
    )


def evaluate(
    threshold: str | Threshold,
    participants: list[Participant],
    decisions: list[Decision],
    *,
    role: str = ROLE,
) -> QuorumResult:
    if isinstance(threshold, str):
        threshold = parse_threshold(threshold)
    return evaluate_quorum(
        threshold=threshold,
        role=role,
        task_id=TASK,
        step_id=STEP,
        participants=participants,
        decisions=decisions,
    )


def seat_agents(participants: list[Participant]) -> list[str]:
    return [p.agent_profile_id for p in quorum_seats(participants, task_id=TASK, step_id=STEP, role=ROLE)]


# --- thresholds ------------------------------------------------------------------------------------------

THREE_SEATS = [part("a"), part("b"), part("c")]

# (threshold, decisions as (agent, verdict), satisfied, reason); decisions are in time order.
THRESHOLD_TABLE: list[tuple[str, list[tuple[str, DecisionValue]], bool, str]] = [
    ("all_approve", [("a", "approved"), ("b", "approved"), ("c", "approved")], True, "approved"),
    ("all_approve", [("a", "approved"), ("b", "approved")], False, "pending"),
    ("all_approve", [("a", "approved"), ("b", "approved"), ("c", "rejected")], False, "pending"),
    ("all_decide", [("a", "approved"), ("b", "rejected"), ("c", "changes_requested")], True, "decided"),
    ("all_decide", [("a", "approved"), ("b", "rejected")], False, "pending"),
    ("majority_approve", [("a", "approved"), ("b", "approved")], True, "approved"),
    ("majority_approve", [("a", "approved"), ("b", "rejected"), ("c", "rejected")], False, "pending"),
    ("n_approve:1", [("a", "approved")], True, "approved"),
    ("n_approve:2", [("a", "approved"), ("b", "rejected")], False, "pending"),
    ("n_approve:3", [("a", "approved"), ("b", "approved"), ("c", "approved")], True, "approved"),
    ("n_approve:4", [("a", "approved"), ("b", "approved"), ("c", "approved")], False, "unsatisfiable"),
    ("any_reject", [("a", "approved"), ("b", "rejected")], True, "vetoed"),
    ("any_reject", [("a", "approved"), ("b", "approved")], False, "pending"),
]


@pytest.mark.parametrize(
    ("threshold", "votes", "satisfied", "reason"),
    THRESHOLD_TABLE,
    ids=[
        "all_approve-all",
        "all_approve-one_missing",
        "all_approve-one_rejected",
        "all_decide-all",
        "all_decide-one_missing",
        "majority-2_of_3",
        "majority-1_of_3",
        "n1-1_of_3",
        "n2-1_of_3",
        "n3-3_of_3",
        "n4-unsatisfiable",
        "any_reject-veto",
        "any_reject-no_veto",
    ],
)
def test_threshold_table(
    threshold: str, votes: list[tuple[str, DecisionValue]], satisfied: bool, reason: str
) -> None:
    decisions = [dec(agent, verdict, at=float(i)) for i, (agent, verdict) in enumerate(votes)]
    result = evaluate(threshold, THREE_SEATS, decisions)
    assert (result.satisfied, result.reason) == (satisfied, reason)
    assert result.seats == 3
    assert result.decided == len(votes)
    assert result.approvals == sum(1 for _, v in votes if v == "approved")


def test_majority_needs_strictly_more_than_half() -> None:
    seats = [part("a"), part("b"), part("c"), part("d")]
    two = [dec("a", "approved", at=1), dec("b", "approved", at=2)]
    assert not evaluate("majority_approve", seats, two).satisfied
    assert evaluate("majority_approve", seats, [*two, dec("c", "approved", at=3)]).satisfied


@pytest.mark.parametrize("threshold", ["all_approve", "all_decide", "majority_approve", "n_approve:1"])
def test_no_seats_fails_closed(threshold: str) -> None:
    # Decisions that would otherwise count (even a user's) cannot open a guard with an empty slate.
    decisions = [dec("a", "approved", at=1), dec("u", "approved", at=2, decider_type="user")]
    result = evaluate(threshold, [part("a", role="approver")], decisions)
    assert result == QuorumResult(satisfied=False, seats=0, approvals=0, decided=0, reason="no_seats")


def test_any_reject_does_not_need_seats() -> None:
    result = evaluate("any_reject", [], [dec("u", "rejected", at=1, decider_type="user")])
    assert (result.satisfied, result.reason, result.seats) == (True, "vetoed", 0)
    assert evaluate("any_reject", [], []).reason == "pending"


# --- seats -----------------------------------------------------------------------------------------------


def test_per_task_row_beats_template_row() -> None:
    template = part("a", id=1, task_id=None)
    per_task = part("a", id=2)
    seats = quorum_seats([template, per_task], task_id=TASK, step_id=STEP, role=ROLE)
    assert seats == [per_task]


def test_evaluating_step_row_preferred_over_other_step_row() -> None:
    other_step = part("a", id=1, step_id="s0")
    this_step = part("a", id=2)
    assert quorum_seats([other_step, this_step], task_id=TASK, step_id=STEP, role=ROLE) == [this_step]


def test_lowest_id_wins_when_no_row_at_evaluating_step() -> None:
    rows = [part("a", id=7, step_id="s8"), part("a", id=3, step_id="s9")]
    assert [p.id for p in quorum_seats(rows, task_id=TASK, step_id=STEP, role=ROLE)] == [3]


def test_per_task_row_at_other_step_still_beats_template_row() -> None:
    template = part("a", id=1, task_id=None)
    per_task_elsewhere = part("a", id=2, step_id="s0")
    seats = quorum_seats([template, per_task_elsewhere], task_id=TASK, step_id=STEP, role=ROLE)
    assert seats == [per_task_elsewhere]


def test_candidate_rows() -> None:
    rows = [
        part("a", task_id=None, step_id="s0"),  # template row at another step
        part("b", task_id="t2"),  # another task's row
        part("c", task_id=None),  # template row here
        part("d", step_id="s0"),  # this task's row at another step
    ]
    assert seat_agents(rows) == ["c", "d"]


def test_empty_agent_rows_are_never_merged() -> None:
    rows = [part("", task_id=None), part(""), part("", step_id="s0"), part("a")]
    assert sorted(seat_agents(rows)) == ["", "", "", "a"]


def test_decision_not_required_is_not_a_seat() -> None:
    assert seat_agents([part("a", required=False), part("b")]) == ["b"]


def test_role_mismatch_is_not_a_seat() -> None:
    assert seat_agents([part("a", role="approver"), part("b")]) == ["b"]


def test_decisions_count_only_for_the_evaluated_task_and_step() -> None:
    # The seat row lives at another step; only decisions for (TASK, STEP) count toward it.
    seat = part("a", step_id="s0")
    elsewhere = [
        dec("a", "approved", at=1, step_id="s0"),
        dec("a", "approved", at=2, task_id="t2"),
        dec("a", "approved", at=3, step_id="s0", participant_id=seat.id),
    ]
    assert evaluate("all_approve", [seat], elsewhere).reason == "pending"
    assert evaluate("all_approve", [seat], [*elsewhere, dec("a", "approved", at=4)]).satisfied


# --- decision mapping ------------------------------------------------------------------------------------


def test_latest_decision_per_seat_wins_approve_then_reject() -> None:
    decisions = [dec("a", "approved", at=1), dec("a", "rejected", at=2)]
    result = evaluate("all_approve", [part("a")], decisions)
    assert (result.satisfied, result.approvals, result.decided) == (False, 0, 1)


def test_latest_decision_per_seat_wins_reject_then_approve() -> None:
    # Given out of order: time order, not input order, decides which is latest.
    decisions = [dec("a", "approved", at=2), dec("a", "rejected", at=1)]
    result = evaluate("all_approve", [part("a")], decisions)
    assert (result.satisfied, result.approvals, result.decided) == (True, 1, 1)


def test_equal_timestamps_ordered_by_id() -> None:
    decisions = [dec("a", "rejected", at=1, id=2), dec("a", "approved", at=1, id=1)]
    assert not evaluate("all_approve", [part("a")], decisions).satisfied


def test_decision_mapped_by_participant_id() -> None:
    seat = part("", id=5)  # no agent: reachable only through its id
    by_user = dec("u", "approved", at=1, decider_type="user", participant_id=5, role="approver")
    result = evaluate("all_approve", [seat], [by_user])
    assert (result.satisfied, result.approvals) == (True, 1)


def test_participant_id_takes_precedence_over_decider_id() -> None:
    seats = [part("a", id=1), part("b", id=2)]
    decisions = [dec("a", "approved", at=1, participant_id=2)]  # agent a decides for seat 2
    result = evaluate("all_decide", seats, decisions)
    assert (result.decided, result.approvals) == (1, 1)
    assert evaluate("all_decide", seats, [*decisions, dec("a", "rejected", at=2)]).satisfied


def test_agent_decision_mapped_by_role_and_decider_id() -> None:
    result = evaluate("all_approve", [part("a"), part("b")], [dec("a", "approved", at=1)])
    assert (result.approvals, result.decided) == (1, 1)


def test_participant_id_naming_no_seat_falls_back_to_decider_id() -> None:
    template = part("a", id=1, task_id=None)  # loses to the per-task row, so it is not a seat
    per_task = part("a", id=2)
    result = evaluate("all_approve", [template, per_task], [dec("a", "approved", at=1, participant_id=1)])
    assert result.satisfied


@pytest.mark.parametrize(
    "decision",
    [
        dec("z", "approved", at=1),  # agent with no seat
        dec("a", "approved", at=1, role="approver"),  # right agent, wrong role
        dec("a", "approved", at=1, decider_type="user"),  # users are not mapped by decider_id
        dec("z", "approved", at=1, participant_id=999),  # names no seat, and z has none either
        dec("", "approved", at=1),  # empty decider id never matches an empty-agent seat
    ],
    ids=["unknown_agent", "wrong_role", "user_by_decider_id", "unknown_participant_id", "empty_decider"],
)
def test_unmapped_decision_is_ignored(decision: Decision) -> None:
    result = evaluate("n_approve:1", [part("a"), part("")], [decision])
    assert (result.satisfied, result.approvals, result.decided) == (False, 0, 0)


# --- any_reject ------------------------------------------------------------------------------------------


def test_any_reject_user_decision_counts_regardless_of_role() -> None:
    veto = dec("u", "rejected", at=1, decider_type="user", role="watcher")
    assert evaluate("any_reject", [part("a")], [veto]).satisfied


def test_any_reject_agent_decision_with_other_role_ignored() -> None:
    other_role = dec("a", "rejected", at=1, role="approver")
    assert not evaluate("any_reject", [part("a")], [other_role]).satisfied


def test_any_reject_ignores_seats() -> None:
    # An agent with the guard's role but no seat still vetoes.
    assert evaluate("any_reject", [part("a")], [dec("z", "rejected", at=1)]).satisfied


def test_any_reject_changes_requested_vetoes() -> None:
    assert evaluate("any_reject", [], [dec("a", "changes_requested", at=1)]).reason == "vetoed"


def test_any_reject_later_approve_by_same_decider_lifts_veto() -> None:
    decisions = [dec("a", "rejected", at=1), dec("a", "approved", at=2)]
    assert evaluate("any_reject", [], decisions).reason == "pending"
    user = [dec("u", "rejected", at=1, decider_type="user"), dec("u", "approved", at=2, decider_type="user")]
    assert not evaluate("any_reject", [], user).satisfied


def test_any_reject_identity_includes_decider_type() -> None:
    # A user and an agent sharing an id are different deciders: the agent's approve does not lift the veto.
    decisions = [dec("x", "rejected", at=1, decider_type="user"), dec("x", "approved", at=2)]
    assert evaluate("any_reject", [], decisions).satisfied


def test_any_reject_other_role_decision_does_not_lift_veto() -> None:
    decisions = [dec("a", "rejected", at=1), dec("a", "approved", at=2, role="approver")]
    assert evaluate("any_reject", [], decisions).satisfied


# --- parse_threshold -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("all_approve", Threshold("all_approve")),
        ("all_decide", Threshold("all_decide")),
        ("majority_approve", Threshold("majority_approve")),
        ("any_reject", Threshold("any_reject")),
        ("n_approve:1", Threshold("n_approve", 1)),
        ("n_approve:12", Threshold("n_approve", 12)),
    ],
)
def test_parse_threshold(text: str, expected: Threshold) -> None:
    assert parse_threshold(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "n_approve:0",
        "n_approve:-1",
        "n_approve:x",
        "n_approve:",
        "n_approve",
        "n_approve:1.5",
        "most",
        "",
        " all_approve",
        "ALL_APPROVE",
    ],
)
def test_parse_threshold_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=f"threshold {text!r}"):
        parse_threshold(text)


@pytest.mark.parametrize(
    ("kind", "n"),
    [("n_approve", 0), ("n_approve", -1), ("all_approve", 2), ("most", 0)],
)
def test_threshold_construction_is_validated(kind: str, n: int) -> None:
    with pytest.raises(ValueError):
        Threshold(kind, n)  # type: ignore[arg-type]


# --- properties ------------------------------------------------------------------------------------------

AGENTS = ["", "a", "b", "c"]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Participant], list[Decision]]:
    # Small domains with repeated values so seats merge, decisions collide per seat and guards get satisfied.
    part_ids = draw(st.lists(st.integers(1, 50), unique=True, max_size=8))
    participants = [
        Participant(
            id=pid,
            workflow_id="wf",
            step_id=draw(st.sampled_from([STEP, "s0"])),
            task_id=draw(st.sampled_from([TASK, TASK, None, "t2"])),
            role=draw(st.sampled_from([ROLE, ROLE, "approver"])),
            agent_profile_id=draw(st.sampled_from(AGENTS)),
            decision_required=draw(st.sampled_from([True, True, False])),
            position=0,
        )
        for pid in part_ids
    ]
    dec_ids = draw(st.lists(st.integers(1, 100), unique=True, max_size=12))
    times = draw(st.lists(st.integers(0, 1000), unique=True, min_size=len(dec_ids), max_size=len(dec_ids)))
    decisions = [
        Decision(
            id=did,
            task_id=draw(st.sampled_from([TASK, TASK, "t2"])),
            step_id=draw(st.sampled_from([STEP, STEP, "s0"])),
            participant_id=draw(st.one_of(st.none(), st.sampled_from([*part_ids, 99]))),
            role=draw(st.sampled_from([ROLE, ROLE, "approver"])),
            decider_type=draw(st.sampled_from(["agent", "user"])),
            decider_id=draw(st.sampled_from(AGENTS)),
            decision=draw(st.sampled_from(["approved", "approved", "rejected", "changes_requested"])),
            comment="",
            created_at=float(at),
        )
        for did, at in zip(dec_ids, times, strict=True)
    ]
    return participants, decisions


ALL_THRESHOLDS = ["all_approve", "all_decide", "majority_approve", "n_approve:1", "n_approve:2", "any_reject"]


@given(scenarios(), st.randoms(use_true_random=False))
def test_input_order_never_changes_the_result(
    scenario: tuple[list[Participant], list[Decision]], rnd: random.Random
) -> None:
    participants, decisions = scenario
    shuffled_p, shuffled_d = list(participants), list(decisions)
    rnd.shuffle(shuffled_p)
    rnd.shuffle(shuffled_d)
    for threshold in ALL_THRESHOLDS:
        assert evaluate(threshold, participants, decisions) == evaluate(threshold, shuffled_p, shuffled_d)


@settings(max_examples=300)  # all_approve is satisfied in only a few percent of drawn scenarios
@given(scenarios())
def test_all_approve_implies_majority_and_all_decide(
    scenario: tuple[list[Participant], list[Decision]],
) -> None:
    participants, decisions = scenario
    all_approve = evaluate("all_approve", participants, decisions)
    if all_approve.satisfied:
        assert all_approve.seats > 0
        assert evaluate("majority_approve", participants, decisions).satisfied
        assert evaluate("all_decide", participants, decisions).satisfied
        assert evaluate(Threshold("n_approve", all_approve.seats), participants, decisions).satisfied
    assert 0 <= all_approve.approvals <= all_approve.decided <= all_approve.seats


# --- a role-less decision takes its seat's role; whether any guard counts it -----------


def _role_of(rows: list[Participant], decider: str, **kw: object) -> str | None:
    args: dict = {"task_id": TASK, "step_id": STEP, "decider_type": "agent", "decider_id": decider}
    return seat_role(rows, **{**args, "participant_id": None, **kw})


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        pytest.param(
            [part("a", task_id=None, role="approver"), part("a", role="reviewer")],
            "reviewer",
            id="per-task-beats-template",
        ),
        pytest.param(
            [part("a", step_id="other", role="approver"), part("a", role="reviewer")],
            "reviewer",
            id="evaluating-step-first",
        ),
        pytest.param(
            [part("a", id=2, role="watcher"), part("a", id=1, role="reviewer")], "reviewer", id="lowest-id"
        ),
        pytest.param([part("a", role="watcher", required=False)], None, id="no-decision-required-seat"),
        pytest.param([part("a", task_id=None, step_id="other")], None, id="template-row-at-another-step"),
        pytest.param([part("a", task_id="t2")], None, id="another-tasks-row"),
        pytest.param([part("b")], None, id="no-seat-for-this-agent"),
    ],
)
def test_seat_role_per_task_beats_template_then_evaluating_step(
    rows: list[Participant], expected: str | None
) -> None:
    assert _role_of(rows, "a") == expected


def test_seat_role_by_participant_id_and_never_for_a_user_without_one() -> None:
    rows = [part("a", id=7, role="approver"), part("a", id=8, role="reviewer")]
    assert _role_of(rows, "someone", participant_id=8) == "reviewer"
    assert _role_of(rows, "someone", participant_id=99) is None
    assert _role_of(rows, "a", decider_type="user") is None
    assert _role_of(rows, "u", decider_type="user", participant_id=7) == "approver"


@pytest.mark.parametrize(
    ("decision", "guards", "expected"),
    [
        pytest.param(dec("a", "approved", at=1), [(ROLE, "all_approve")], None, id="maps-to-a-seat"),
        pytest.param(
            dec("a", "approved", at=1, role=""),
            [(ROLE, "all_approve")],
            "no_matching_seat",
            id="role-less-maps-nowhere",
        ),
        pytest.param(dec("x", "approved", at=1), [(ROLE, "all_approve")], "no_matching_seat", id="unseated"),
        pytest.param(
            dec("x", "rejected", at=1),
            [(ROLE, "all_approve"), (ROLE, "any_reject")],
            None,
            id="any-reject-takes-its-role",
        ),
        pytest.param(
            dec("u", "rejected", at=1, role="", decider_type="user"),
            [(ROLE, "any_reject")],
            None,
            id="any-reject-takes-every-user",
        ),
        pytest.param(dec("a", "approved", at=1), [], "no_quorum_guard", id="no-guard"),
    ],
)
def test_why_not_counted_mirrors_the_guards(
    decision: Decision, guards: list[tuple[str, str]], expected: str | None
) -> None:
    parsed = [(role, parse_threshold(text)) for role, text in guards]
    assert why_not_counted(decision, parsed, [part("a"), part("b")]) == expected
