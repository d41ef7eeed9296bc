"""The built-in executors of engine-owned actions, and what every executor is given and returns. Writer
thread: an executor runs inside one store transaction.

An effect never raises for a business failure (no target agent, a participant without a profile): it
returns an `Effect` whose state is `failed` with a cause, plus the events and diagnostics to publish once
the transaction has committed. Database errors do raise, rolling the whole transaction back; the fan-out
collects one participant's database error and goes on, unless the error is a storage fault or ended the
transaction (`faults.fails_request`: then nothing of it commits). Sources: on-enter-action-dispatch.md
AC-A3, AC-A4, AC-A5, AC-A7, AC-C1, AC-E1 … AC-E4, AC-G1, AC-H1 … AC-H9; kandev-engine-notes.md "Runs
queue".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypedDict

import attrs

from onceflow.protocol.events import (
    DecisionsCleared,
    Event,
    RunCoalesced,
    RunQueued,
    RunRateLimited,
    RunSuppressed,
)
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.savepoint import undone_alone
from onceflow.store.entries import participants as participant_rows
from onceflow.store.entries.participants import dedupe_seats
from onceflow.store.records import Participant, TaskRecord
from onceflow.store.runs import runs
from onceflow.store.runs.flow import Cause
from onceflow.store.runs.keys import EntryScope, OperationScope, config_digest
from onceflow.store.tasks import tasks


@attrs.frozen
class DiagnosticNote:
    """A diagnostic to log and emit after commit (never from the writer thread)."""

    level: Literal["info", "warning", "error"]
    code: str
    fields: dict[str, Any]


@attrs.frozen
class Effect:
    """What an action did: its marker state, a short detail (the failure cause), events and diagnostics."""

    state: Literal["done", "skipped", "failed"]
    detail: str = ""
    events: tuple[Event, ...] = ()
    diagnostics: tuple[DiagnosticNote, ...] = ()


@attrs.frozen
class ActionContext:
    """Who and where an action runs for. `trigger` names the firing trigger (its reason default); `keys`
    scopes the idempotency keys of the runs it queues (None: the trigger carries no operation id, so its
    runs have none); `now` is Unix seconds; `cause` the causation of the command it runs for
    (store/runs/flow.py; None: its runs start chains of their own)."""

    task: TaskRecord
    step_id: str
    step_name: str
    trigger: str
    keys: EntryScope | OperationScope | None
    exclude_from_coalescing: bool
    now: float
    cause: Cause | None = None

    def key_for(self, agent_profile_id: str, digest: str) -> str | None:
        """The idempotency key of this action's run for `agent_profile_id` (store/runs/keys.py), or None."""
        return None if self.keys is None else self.keys.key(agent_profile_id, digest)

    def origin(self, task: TaskRecord) -> RunOrigin:
        """Where a run this action queues for `task` comes from: the trigger, the step entry (on_enter), and
        the entry of its task it belongs to (none when `task` is another task than this action's, or waits
        for a WIP slot: it is in no entry then)."""
        own_entry = task.id == self.task.id and task.wip_admitted
        return RunOrigin(
            trigger=self.trigger,
            entry_seq=self.keys.entry_seq if isinstance(self.keys, EntryScope) else None,
            admission_seq=task.admissions if own_entry else None,
        )


class RunOrigin(TypedDict):
    """`RunRequest`'s origin fields (`ActionContext.origin`)."""

    trigger: str
    entry_seq: int | None
    admission_seq: int | None


def clear_decisions(conn: Connection, ctx: ActionContext) -> Effect:
    """Delete the (task, step) decisions in one statement; a no-op clear is still done (AC-A3, AC-E4)."""
    deleted = participant_rows.clear_decisions(conn, task_id=ctx.task.id, step_id=ctx.step_id)
    return Effect(
        "done", events=(DecisionsCleared(task_id=ctx.task.id, step_id=ctx.step_id, deleted=deleted),)
    )


def _enqueue(conn: Connection, request: runs.RunRequest, now: float) -> tuple[runs.EnqueueResult, Event]:
    result = runs.enqueue_run(conn, request, now)
    event: Event
    if result.outcome == "rate_limited":
        assert result.refusal is not None
        line = result.lineage
        event = RunRateLimited(
            run_id=result.run_id,
            task_id=request.task_id,
            agent_profile_id=request.agent_profile_id,
            reason=request.reason,
            limit=result.refusal.limit,
            limit_value=result.refusal.value,
            parent_run_id=line.parent_run_id,
            causation_depth=line.depth,
        )
    elif result.outcome == "suppressed":
        event = RunSuppressed(
            existing_run_id=result.run_id,
            task_id=request.task_id,
            agent_profile_id=request.agent_profile_id,
            reason=request.reason,
            idempotency_key=request.idempotency_key or "",
        )
    elif result.outcome == "coalesced":
        event = RunCoalesced(
            run_id=result.run_id,
            task_id=request.task_id,
            agent_profile_id=request.agent_profile_id,
            reason=request.reason,
            coalesced_count=result.coalesced_count,
        )
    else:
        event = RunQueued(
            run_id=result.run_id,
            task_id=request.task_id,
            step_id=request.step_id,
            agent_profile_id=request.agent_profile_id,
            reason=request.reason,
            idempotency_key=request.idempotency_key,
            priority=request.priority,
            parent_run_id=result.lineage.parent_run_id,
            causation_depth=result.lineage.depth,
        )
    return result, event


def _priority(action: ActionDecl) -> int:
    """The priority class an action's runs get: its config's `priority`, else 2 (event)."""
    priority: int | None = getattr(action.config, "priority", None)
    return 2 if priority is None else priority


def _participant_failed(
    task: TaskRecord, step_id: str, participant: Participant, cause: str
) -> DiagnosticNote:
    """The AC-C1 ERROR for one participant of a fan-out."""
    return DiagnosticNote(
        "error",
        "fan_out_participant_failed",
        {
            "task_id": task.id,
            "step_id": step_id,
            "participant_id": participant.id,
            "agent_profile_id": participant.agent_profile_id,
            "cause": cause,
        },
    )


def fan_out_reason(action: ActionDecl, trigger: str) -> str:
    """A fan-out's run reason: its config's, else the trigger's name (AC-H1)."""
    reason: str = getattr(action.config, "reason", None) or trigger
    return reason


def fan_out_digest(action: ActionDecl, reason: str) -> str:
    """The config digest in a fan-out's idempotency keys (AC-H7): over its role, reason and payload."""
    role: str = getattr(action.config, "role", "") or ""
    return config_digest({"role": role, "reason": reason, "payload": getattr(action.config, "payload", None)})


def fan_out_notes(
    task_id: str,
    step_id: str,
    step_name: str,
    role: str,
    matching: int,
    enqueued: int,
    suppressed: int = 0,
) -> tuple[DiagnosticNote, ...]:
    """What a fan-out reports besides each participant's failure: `fan_out_matched_nobody` (WARNING) when no
    seat matched, then `fan_out_finished` (INFO) with its counts."""
    finished = DiagnosticNote(
        "info",
        "fan_out_finished",
        {
            "task_id": task_id,
            "step_id": step_id,
            "role": role,
            "matching": matching,
            "enqueued": enqueued,
            "suppressed": suppressed,
        },
    )
    if matching:
        return (finished,)
    nobody = DiagnosticNote(
        "warning",
        "fan_out_matched_nobody",
        {"task_id": task_id, "step_id": step_id, "step_name": step_name, "role": role},
    )
    return (nobody, finished)


def queue_run_for_each_participant(conn: Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
    """Fan a run out to every participant of the configured role at the step: collect-and-continue.

    The participant set is read once (AC-F2); selection is by role alone (AC-H3); reason defaults to the
    trigger name (AC-H1); no payload stays NULL (AC-H2). A storage fault (disk full, I/O, a lock held past
    the busy timeout, a revoked privilege) is not one participant's failure: it propagates and nothing of
    the fan-out commits.
    """
    config = action.config
    role: str = getattr(config, "role", "") or ""
    task, step_id = ctx.task, ctx.step_id
    if not role:
        note = DiagnosticNote(
            "error",
            "fan_out_role_missing",
            {"workflow_id": task.workflow_id, "step_id": step_id, "task_id": task.id},
        )
        return Effect("skipped", "malformed", diagnostics=(note,))
    reason = fan_out_reason(action, ctx.trigger)
    payload: dict[str, Any] | None = getattr(config, "payload", None)
    digest = fan_out_digest(action, reason)
    matching = dedupe_seats(
        participant_rows.step_participants(
            conn, workflow_id=task.workflow_id, task_id=task.id, step_id=step_id, role=role
        )
    )
    events: list[Event] = []
    notes: list[DiagnosticNote] = []
    enqueued = suppressed = 0
    failures: list[str] = []
    for participant in matching:
        agent = participant.agent_profile_id
        if not agent:
            cause = "participant has no agent_profile_id"
            failures.append(cause)
            notes.append(_participant_failed(task, step_id, participant, cause))
            continue
        request = runs.RunRequest(
            agent_profile_id=agent,
            task_id=task.id,
            step_id=step_id,
            reason=reason,
            payload=payload,
            idempotency_key=ctx.key_for(agent, digest),
            exclude_from_coalescing=ctx.exclude_from_coalescing,
            priority=_priority(action),
            cause=ctx.cause,
            **ctx.origin(task),
        )
        try:  # an enqueue is atomic, so one participant's failure leaves only its own write out
            with undone_alone(conn, "participant"):
                result, event = _enqueue(conn, request, ctx.now)
        except faults.database_errors(conn) as exc:
            if faults.fails_request(conn, exc):  # the database's fault, not the participant's
                raise
            failures.append(repr(exc))
            notes.append(_participant_failed(task, step_id, participant, repr(exc)))
            continue
        events.append(event)
        enqueued += 1
        suppressed += result.outcome == "suppressed"
    notes.extend(fan_out_notes(task.id, step_id, ctx.step_name, role, len(matching), enqueued, suppressed))
    if failures:
        detail = f"attempted={len(matching)} failed={len(failures)} first_cause={failures[0]}"
        return Effect("failed", detail, tuple(events), tuple(notes))
    return Effect("done", events=tuple(events), diagnostics=tuple(notes))


def resolve_targets(conn: Connection, task: TaskRecord, step_id: str, target: str) -> list[str]:
    """The agent profiles a queue_run `target` names, in order; empty when it resolves to nobody.

    primary, workspace.ceo_agent and agent_profile_id:<id> name at most one agent; participant_role:<role>
    names every participant of that role at the step with an agent, one per (role, agent), per-task rows
    winning (Kandev's engine queues one run per matching participant). The same resolution
    serves every trigger, on_enter included (on-enter spec AC-A7).
    """
    if target.startswith("participant_role:"):
        role = target.removeprefix("participant_role:")
        rows = dedupe_seats(
            participant_rows.step_participants(
                conn, workflow_id=task.workflow_id, task_id=task.id, step_id=step_id, role=role
            )
        )
        return [p.agent_profile_id for p in rows if p.agent_profile_id]
    if target == "primary":
        agent = task.primary_agent_id
    elif target == "workspace.ceo_agent":
        agent = task.ceo_agent_id
    else:
        agent = target.removeprefix("agent_profile_id:") if target.startswith("agent_profile_id:") else None
    return [agent] if agent else []


def queue_run(conn: Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
    """Enqueue one run per resolved target agent, for this task or the task named by `task_id`.

    Each run carries its own idempotency key (the key includes the agent). Fails (a cause, nothing queued)
    when the task does not exist or the target resolves to nobody.
    """
    config = action.config
    target: str = getattr(config, "target", "primary")
    task_ref: str = getattr(config, "task_id", "this")
    reason: str = getattr(config, "reason", None) or ctx.trigger
    payload: dict[str, Any] | None = getattr(config, "payload", None)
    task = ctx.task if task_ref == "this" else tasks.find_task(conn, task_ref)
    if task is None:
        return Effect("failed", f"task {task_ref!r} does not exist")
    agents = resolve_targets(conn, task, ctx.step_id, target)
    if not agents:
        return Effect("failed", f"target {target!r} resolves to no agent profile")
    digest = config_digest({"target": target, "task_id": task_ref, "reason": reason, "payload": payload})
    events: list[Event] = []
    for agent in agents:
        request = runs.RunRequest(
            agent_profile_id=agent,
            task_id=task.id,
            step_id=ctx.step_id,
            reason=reason,
            payload=payload,
            idempotency_key=ctx.key_for(agent, digest),
            exclude_from_coalescing=ctx.exclude_from_coalescing,
            priority=_priority(action),
            cause=ctx.cause,
            **ctx.origin(task),
        )
        events.append(_enqueue(conn, request, ctx.now)[1])
    return Effect("done", events=tuple(events))


def ensure_participant_seat(conn: Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
    """Check that the step has a seat for the configured role; warn (and stay done) when it has none."""
    role: str = getattr(action.config, "role", "")
    task = ctx.task
    if participant_rows.step_participants(
        conn, workflow_id=task.workflow_id, task_id=task.id, step_id=ctx.step_id, role=role
    ):
        return Effect("done")
    note = DiagnosticNote(
        "warning", "participant_seat_missing", {"task_id": ctx.task.id, "step_id": ctx.step_id, "role": role}
    )
    return Effect("done", "no seat for role", diagnostics=(note,))


Executor = Callable[[Connection, ActionContext, ActionDecl], Effect]
"""An engine-owned action whose effect is a database write: runs on the writer thread inside one store
transaction, given its connection, context and declaration. `open_runtime(executors=...)` takes them."""

DEFAULT_EXECUTORS: Mapping[str, Executor] = MappingProxyType(
    {
        "clear_decisions": lambda conn, ctx, action: clear_decisions(conn, ctx),
        "queue_run_for_each_participant": queue_run_for_each_participant,
        "queue_run": queue_run,
        "ensure_participant_seat": ensure_participant_seat,
    }
)
"""The built-in executors a runtime registers unless told otherwise."""
