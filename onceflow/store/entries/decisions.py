"""Recording a decision: its receipt, the decider's role, and whether any quorum guard counts it. Writer
thread: `record` runs inside one store transaction, with the quorum rules handed in by the Trio side
(actors/engine/decisions.py); the task actor publishes what it returns and re-evaluates the guards.

A `decision_id` is a durable receipt: the same content again is a replay that writes nothing, other content
a conflict, in process and after a restart, for as long as retention keeps the receipt. A vote naming its
round (`entry_seq`) is judged against the step's latest entry, which retention never deletes: a vote of an
earlier round, or of a round the task has left, never counts and is recorded nowhere, whatever was pruned.
Source: kandev-engine-notes.md "Quorum guards".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from onceflow.protocol import commands as c
from onceflow.protocol.errors import ConflictError, NotFoundError
from onceflow.protocol.operation_ids import decision_operation_id
from onceflow.protocol.workflow import Step, Workflow, find_step
from onceflow.store.backends.connection import Connection
from onceflow.store.entries import participants
from onceflow.store.records import Decision, Participant, TaskRecord
from onceflow.store.tasks import history, tasks


@attrs.frozen
class Recorded:
    """What `record` did.

    `inserted` False is a replay of the host's `decision_id`: nothing was written, `decision_id` is the row
    first recorded, and `role` and `not_counted` are None (they were reported then); or a vote for a round
    that is over: nothing was written, `decision_id` is None and `not_counted` says why ("earlier_round",
    "task_not_at_step"). Otherwise `role` is the role stored (the command's, or resolved from the decider's
    seat) and `not_counted` is why no quorum guard of the step takes the decision now ("task_not_at_step",
    "no_quorum_guard", "no_matching_seat"), or None when one does.
    """

    task: TaskRecord
    decision_id: int | None
    inserted: bool
    role: str | None = None
    not_counted: str | None = None


def _history_detail(decision: Decision, command: c.RecordDecision) -> dict[str, object]:
    """The task history's decision item (store/tasks/history.py): what was recorded, and the host's id for
    it."""
    op = command.decision_id and decision_operation_id(
        decision.task_id, decision.step_id, command.decision_id
    )
    return {
        "step_id": decision.step_id,
        "decision": decision.decision,
        "decider_type": decision.decider_type,
        "decider_id": decision.decider_id,
        "role": decision.role,
        "participant_id": decision.participant_id,
        "decision_id": command.decision_id,
        "operation_id": op or None,
    }


def content_of(command: c.RecordDecision) -> str:
    """The canonical JSON of what a decision says: every field but its identity (task, step, decision_id)."""
    return json.dumps(
        command.model_dump(
            include={"decider_type", "decider_id", "decision", "role", "participant_id", "comment"}
        ),
        sort_keys=True,
        separators=(",", ":"),
    )


class DecisionRules(Protocol):
    """The quorum rules a recorded decision is judged by (kandev-engine-notes.md, "Quorum guards")."""

    def seat_role(
        self,
        rows: Sequence[Participant],
        *,
        task_id: str,
        step_id: str,
        decider_type: str,
        decider_id: str,
        participant_id: int | None,
    ) -> str | None:
        """The role of the decider's seat among `rows`, or None when the decider holds none."""
        ...

    def not_counted(self, decision: Decision, step: Step, rows: Sequence[Participant]) -> str | None:
        """Why no quorum guard of `step` takes `decision` into account, or None when one does."""
        ...


def record(
    conn: Connection,
    command: c.RecordDecision,
    workflows: Callable[[TaskRecord], Workflow | None],
    rules: DecisionRules,
    now: float,
) -> Recorded:
    """Record `command` for its task (`now` Unix seconds); `workflows` gives the version of its workflow a
    task is pinned to (None: not loaded), whose step and quorum rules the vote is judged by.

    A `decision_id` already receipted for (task, step) is a replay when the content matches and nothing is
    written — even if the task has left the step since. A decision without `role` takes the role of the
    decider's seat (`rules.seat_role`). A decision no guard counts — the task is not at `step_id` (a late
    vote; the next entry's clear_decisions removes it), or it matches no guard's seat — is still recorded,
    and `not_counted` says why. A recorded decision is also a `decision` item of the task's history
    (store/tasks/history.py), which a clear does not remove.

    A vote naming its round (`entry_seq`) counts only in it: a round older than the step's latest entry
    (`earlier_round`), or the latest while the task is elsewhere (`task_not_at_step`), writes nothing and is
    answered not counted.

    Raises:
        NotFoundError: the task does not exist, or its workflow has no step `step_id`, or the step has no
            entry `entry_seq` yet (field entry_seq).
        ConflictError: `decision_id` was receipted with different content (field decision_id).
    """
    task = tasks.get_task(conn, command.task_id)
    where = {"task_id": task.id, "step_id": command.step_id}
    content = content_of(command)
    if command.decision_id is not None:
        earlier = participants.decision_receipt(conn, **where, external_id=command.decision_id)
        if earlier is not None:
            if earlier[1] and earlier[1] != content:
                raise ConflictError(
                    f"decision_id {command.decision_id!r} was already recorded for task {task.id!r} at step"
                    f" {command.step_id!r} with different content",
                    field="decision_id",
                )
            return Recorded(task, earlier[0], inserted=False)
    if command.entry_seq is not None:
        over = _round_over(conn, task, command.step_id, command.entry_seq)
        if over is not None:
            return Recorded(task, None, inserted=False, not_counted=over)
    workflow = workflows(task)  # the version the task is pinned to, in memory
    if workflow is None:
        raise NotFoundError(
            f"workflow {task.workflow_id!r} version {task.workflow_version} is not registered",
            field="workflow_id",
        )
    step = find_step(workflow, command.step_id)
    rows = participants.participants_for_task(conn, workflow_id=task.workflow_id, task_id=task.id)
    role = command.role or rules.seat_role(
        rows,
        task_id=task.id,
        step_id=step.id,
        decider_type=command.decider_type,
        decider_id=command.decider_id,
        participant_id=command.participant_id,
    )
    decision = Decision(
        id=0,
        task_id=task.id,
        step_id=step.id,
        participant_id=command.participant_id,
        role=role or "",
        decider_type=command.decider_type,
        decider_id=command.decider_id,
        decision=command.decision,
        comment=command.comment,
        created_at=now,
    )
    history.hold(conn, task.id)  # before the decision's foreign key takes a share lock on the row
    decision_id = participants.record_decision(
        conn,
        **where,
        participant_id=decision.participant_id,
        role=decision.role,
        decider_type=decision.decider_type,
        decider_id=decision.decider_id,
        decision=decision.decision,
        comment=decision.comment,
        now=now,
    )
    if command.decision_id is not None:
        participants.add_decision_receipt(
            conn, **where, external_id=command.decision_id, decision_id=decision_id, content=content, now=now
        )
    history.record(conn, task.id, now, "decision", _history_detail(decision, command))
    if task.step_id != step.id:  # a late vote: the next entry's clear_decisions (if declared) removes it
        return Recorded(task, decision_id, inserted=True, role=decision.role, not_counted="task_not_at_step")
    reason = rules.not_counted(attrs.evolve(decision, id=decision_id), step, rows)
    return Recorded(task, decision_id, inserted=True, role=decision.role, not_counted=reason)


def _round_over(conn: Connection, task: TaskRecord, step_id: str, entry_seq: int) -> str | None:
    """Why a vote cast for entry `entry_seq` of (task, step) can no longer count, or None while that entry
    is the task's current one. The latest entry of a (task, step) is never pruned
    (store/retention/retention.py): it is the high-water mark every earlier round is told by.

    Raises:
        NotFoundError: the step has no entry `entry_seq` yet (field entry_seq).
    """
    (latest,) = conn.execute(
        "SELECT MAX(entry_seq) FROM step_entries WHERE task_id = ? AND step_id = ?", (task.id, step_id)
    ).fetchone()
    if latest is None or entry_seq > latest:
        raise NotFoundError(
            f"task {task.id!r} has no entry {entry_seq} at step {step_id!r} (its latest: {latest})",
            field="entry_seq",
        )
    if entry_seq < latest:
        return "earlier_round"
    return None if task.step_id == step_id else "task_not_at_step"
