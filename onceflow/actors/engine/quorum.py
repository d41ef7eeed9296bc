"""Quorum guard evaluation: pure functions over participant and decision rows. Pure.

Contract: kandev-engine-notes.md, "Quorum guards". Nothing here touches the store; callers pass the rows in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal, get_args

import attrs

from onceflow.store.records import Decision, Participant

ThresholdKind = Literal["all_approve", "all_decide", "majority_approve", "n_approve", "any_reject"]

_PLAIN_KINDS: dict[str, ThresholdKind] = {k: k for k in get_args(ThresholdKind) if k != "n_approve"}
_N_APPROVE = re.compile(r"n_approve:([0-9]+)")
_VETOES: frozenset[str] = frozenset({"rejected", "changes_requested"})


def _check_n(instance: Threshold, attribute: attrs.Attribute[int], value: int) -> None:
    # Keeps a hand-built Threshold as strict as a parsed one: n_approve:0 would otherwise pass vacuously.
    if instance.kind == "n_approve" and value < 1:
        raise ValueError(f"n_approve needs a positive n, got {value}")
    if instance.kind != "n_approve" and value != 0:
        raise ValueError(f"{instance.kind} takes no n, got {value}")


@attrs.frozen
class Threshold:
    """A parsed `wait_for_quorum` threshold (kandev-engine-notes.md, Quorum guards).

    `kind` is one of all_approve, all_decide, majority_approve, n_approve, any_reject; `n` is the N of
    `n_approve:N` (a positive integer) and 0 for every other kind.

    Raises ValueError on construction when `kind` is unknown or `n` does not fit the kind.
    """

    kind: ThresholdKind = attrs.field(validator=attrs.validators.in_(get_args(ThresholdKind)))
    n: int = attrs.field(default=0, validator=_check_n)


def parse_threshold(text: str) -> Threshold:
    """Parse a threshold: "all_approve", "all_decide", "majority_approve", "any_reject" or "n_approve:N".

    N must be ASCII digits with value >= 1. The text is matched exactly (no trimming, case-sensitive).
    Source: kandev-engine-notes.md, Quorum guards.

    Raises ValueError naming `text` when it is not a recognised threshold (e.g. "n_approve:0",
    "n_approve:-1", "n_approve:x", "most", "").
    """
    kind = _PLAIN_KINDS.get(text)
    if kind is not None:
        return Threshold(kind=kind)
    match = _N_APPROVE.fullmatch(text)
    if match is not None and int(match.group(1)) >= 1:
        return Threshold(kind="n_approve", n=int(match.group(1)))
    raise ValueError(f"unrecognised quorum threshold {text!r}")


@attrs.frozen
class QuorumResult:
    """Outcome of one quorum guard evaluation (kandev-engine-notes.md, Quorum guards).

    `seats` is the size of the seat slate, `approvals` the seats whose latest decision is "approved",
    `decided` the seats with any decision. For any_reject these counts are informational only.
    `reason` is one of:
      "no_seats"      - no seats; fails closed (never for any_reject)
      "unsatisfiable" - n_approve:N with N > seats
      "pending"       - threshold not (yet) met, including any_reject with no current veto
      "approved"      - all_approve, majority_approve or n_approve satisfied
      "decided"       - all_decide satisfied
      "vetoed"        - any_reject satisfied
    """

    satisfied: bool
    seats: int
    approvals: int
    decided: int
    reason: str


def quorum_seats(
    participants: Iterable[Participant], *, task_id: str, step_id: str, role: str
) -> list[Participant]:
    """Build the seat slate for a guard on `role` evaluated at (`task_id`, `step_id`).

    Candidates are the task's per-task rows at any step plus template rows (task_id None) at `step_id`,
    filtered to `role` and decision_required. One seat per (task, role, agent), preferring the row at
    `step_id`, then the lowest id; then one per (role, agent), a per-task row beating a template row.
    Rows with an empty agent_profile_id are never merged. Returns the seat rows sorted by id; the result
    does not depend on input order. Raises nothing. Source: kandev-engine-notes.md, Quorum guards.
    """
    candidates = [
        p
        for p in participants
        if (p.task_id == task_id or (p.task_id is None and p.step_id == step_id))
        and p.role == role
        and p.decision_required
    ]

    loners: list[Participant] = []
    # Stage 1: one row per (task, agent); role is already fixed by the filter.
    by_task_agent: dict[tuple[str | None, str], Participant] = {}
    for p in candidates:
        if not p.agent_profile_id:
            loners.append(p)  # no identity to merge on: its own seat
            continue
        key = (p.task_id, p.agent_profile_id)
        best = by_task_agent.get(key)
        if best is None or _stage1_rank(p, step_id) < _stage1_rank(best, step_id):
            by_task_agent[key] = p

    # Stage 2: one row per agent across per-task and template rows, per-task winning.
    by_agent: dict[str, Participant] = {}
    for p in by_task_agent.values():
        best = by_agent.get(p.agent_profile_id)
        if best is None or _stage2_rank(p) < _stage2_rank(best):
            by_agent[p.agent_profile_id] = p

    return sorted([*by_agent.values(), *loners], key=lambda p: p.id)


def _stage1_rank(p: Participant, step_id: str) -> tuple[bool, int]:
    return (p.step_id != step_id, p.id)


def _stage2_rank(p: Participant) -> tuple[bool, int]:
    # Within one (role, agent) at most one per-task and one template row survive stage 1; id only breaks ties.
    return (p.task_id is None, p.id)


def evaluate_quorum(
    *,
    threshold: Threshold,
    role: str,
    task_id: str,
    step_id: str,
    participants: Iterable[Participant],
    decisions: Iterable[Decision],
) -> QuorumResult:
    """Evaluate a `wait_for_quorum {role, threshold}` guard for (`task_id`, `step_id`).

    Seats come from `quorum_seats`. Only decisions whose (task_id, step_id) equal the evaluated pair are
    used, oldest first by (created_at, id). A decision maps to a seat by participant_id when that names a
    seat, else (agent deciders only) by (role, decider_id == agent_profile_id); the latest per seat wins and
    unmapped decisions are ignored. all_approve: approvals == seats; all_decide: decided == seats;
    majority_approve: 2*approvals > seats; n_approve:N: N > seats is unsatisfiable, else approvals >= N.
    No seats fails closed except for any_reject, which ignores seats: the last decision per
    (decider_type, decider_id) - agent decisions only when their role is `role`, user decisions always -
    vetoes when it is "rejected" or "changes_requested".

    Returns a QuorumResult (see its reason codes). Raises nothing; the result does not depend on input
    order when decision (created_at, id) pairs are distinct. Source: kandev-engine-notes.md, Quorum guards.
    """
    seats = quorum_seats(participants, task_id=task_id, step_id=step_id, role=role)
    ordered = sorted(
        (d for d in decisions if d.task_id == task_id and d.step_id == step_id),
        key=lambda d: (d.created_at, d.id),
    )

    latest = _latest_per_seat(seats, ordered)
    n_seats = len(seats)
    approvals = sum(1 for d in latest.values() if d.decision == "approved")
    decided = len(latest)

    def result(satisfied: bool, reason: str) -> QuorumResult:
        return QuorumResult(
            satisfied=satisfied, seats=n_seats, approvals=approvals, decided=decided, reason=reason
        )

    if threshold.kind == "any_reject":
        return result(True, "vetoed") if _any_veto(ordered, role) else result(False, "pending")
    if n_seats == 0:
        return result(False, "no_seats")
    if threshold.kind == "all_approve":
        return result(True, "approved") if approvals == n_seats else result(False, "pending")
    if threshold.kind == "all_decide":
        return result(True, "decided") if decided == n_seats else result(False, "pending")
    if threshold.kind == "majority_approve":
        return result(True, "approved") if 2 * approvals > n_seats else result(False, "pending")
    # n_approve
    if threshold.n > n_seats:
        return result(False, "unsatisfiable")
    return result(True, "approved") if approvals >= threshold.n else result(False, "pending")


@attrs.frozen
class _SeatIndex:
    """How decisions find seats: by participant id, else (agent deciders) by (role, agent)."""

    ids: frozenset[int]
    by_role_agent: dict[tuple[str, str], int]

    @classmethod
    def of(cls, seats: Iterable[Participant]) -> _SeatIndex:
        seats = list(seats)
        # Empty-agent seats have no identity an agent decider could match; they are reachable by id only.
        return cls(
            frozenset(s.id for s in seats),
            {(s.role, s.agent_profile_id): s.id for s in seats if s.agent_profile_id},
        )

    def seat_of(self, d: Decision) -> int | None:
        if d.participant_id is not None and d.participant_id in self.ids:
            return d.participant_id
        if d.decider_type == "agent":
            return self.by_role_agent.get((d.role, d.decider_id))
        return None


def _latest_per_seat(seats: list[Participant], ordered: list[Decision]) -> dict[int, Decision]:
    index = _SeatIndex.of(seats)
    latest: dict[int, Decision] = {}
    for d in ordered:
        seat = index.seat_of(d)
        if seat is not None:
            latest[seat] = d  # oldest first, so the last write is the latest decision
    return latest


def _any_veto(ordered: list[Decision], role: str) -> bool:
    last: dict[tuple[str, str], Decision] = {}
    for d in ordered:
        # Role filter before "last": an agent's decision under another role neither vetoes nor lifts a veto.
        if d.decider_type == "agent" and d.role != role:
            continue
        last[(d.decider_type, d.decider_id)] = d
    return any(d.decision in _VETOES for d in last.values())


def seat_role(
    participants: Iterable[Participant],
    *,
    task_id: str,
    step_id: str,
    decider_type: str,
    decider_id: str,
    participant_id: int | None,
) -> str | None:
    """The role of the seat a role-less decision comes from, or None when the decider holds no seat.

    Candidates are the rows `quorum_seats` draws from (the task's per-task rows at any step, template rows
    at `step_id`) with decision_required. The decider's row is the one named by `participant_id`, else, for
    an agent decider, a row whose agent_profile_id is `decider_id`; a user decider without a participant id
    holds no seat. Among several, a per-task row beats a template row, then the row at `step_id` beats a
    row at another step, then the lowest id (Kandev resolves the decider's role from the seat).
    Source: kandev-engine-notes.md, Quorum guards.
    """
    candidates = [
        p
        for p in participants
        if (p.task_id == task_id or (p.task_id is None and p.step_id == step_id)) and p.decision_required
    ]
    if participant_id is not None:
        mine = [p for p in candidates if p.id == participant_id]
    elif decider_type == "agent":
        mine = [p for p in candidates if p.agent_profile_id and p.agent_profile_id == decider_id]
    else:
        return None
    best = min(mine, key=lambda p: (p.task_id is None, p.step_id != step_id, p.id), default=None)
    return None if best is None else best.role


def why_not_counted(
    decision: Decision, guards: Iterable[tuple[str, Threshold]], participants: Iterable[Participant]
) -> str | None:
    """Why no quorum guard of the decision's step takes `decision` into account, or None when one does.

    `guards` are the (role, threshold) pairs of the step's guarded transitions. A guard takes a decision into
    account as `evaluate_quorum` does: any_reject every user decision and an agent decision of its role;
    every other kind a decision that maps to one of its seats. Returns "no_quorum_guard" when the step has no
    guard, "no_matching_seat" when no guard takes it.
    """
    guards = list(guards)
    if not guards:
        return "no_quorum_guard"
    rows = list(participants)
    for role, threshold in guards:
        if threshold.kind == "any_reject":
            if decision.decider_type == "user" or decision.role == role:
                return None
            continue
        seats = quorum_seats(rows, task_id=decision.task_id, step_id=decision.step_id, role=role)
        if _SeatIndex.of(seats).seat_of(decision) is not None:
            return None
    return "no_matching_seat"
