"""The task actor: one per task, serializing every command for that task.

Spawned on the task's first message and routed by task id; its mailbox survives a crash of the actor,
which the supervisor restarts (nothing it needs lives only in memory: state is reloaded from the store).
"""

from __future__ import annotations

import sqlite3
from typing import Any, Literal

import attrs

from onceflow.actors.engine import children, decisions
from onceflow.actors.engine.core import Engine, HandleInput, HandleResult, StaleRow
from onceflow.actors.engine.promotion import Promotion
from onceflow.actors.kernel.operation_locks import TaskLocks
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import find_step
from onceflow.protocol import commands as c
from onceflow.protocol.errors import StorageError, WipLimitError
from onceflow.protocol.events import DecisionRecorded, EntryPath, StepEntered, TaskCreated, TaskQueued
from onceflow.protocol.operation_ids import decision_operation_id, operation_id, switch_workflow_operation_id
from onceflow.protocol.workflow import Trigger
from onceflow.store import participants, step_entries, tasks, wip
from onceflow.store.records import TaskRecord
from onceflow.store.step_entries import EntryKey

GuardOutcome = Literal["moved", "quorum_not_met", "move_abandoned", "no_guard", "not_at_step"]

EVENT_TRIGGERS: dict[type[Any], Trigger] = {
    c.TaskComment: Trigger.on_comment,
    c.BlockersResolved: Trigger.on_blocker_resolved,
    c.ChildrenCompleted: Trigger.on_children_completed,
    c.ApprovalResolved: Trigger.on_approval_resolved,
    c.AgentError: Trigger.on_agent_error,
    c.Heartbeat: Trigger.on_heartbeat,
    c.BudgetAlert: Trigger.on_budget_alert,
}


@attrs.define
class TaskActor:
    """Handles the commands of one task. `handle` returns the reply's JSON result; errors propagate."""

    task_id: str
    engine: Engine
    locks: TaskLocks

    @property
    def _store(self) -> Any:
        return self.engine.services.store

    async def handle(self, command: Any, out: Outbox) -> Any:
        """Apply one command. Raises OnceflowError subclasses for refused commands.

        Every command but a move, a creation or a read forgets the task's cached row first: it may write the
        row outside the admission's compare-and-set (actors/kernel/task_rows.py).
        """
        if not isinstance(command, c.MoveTask | c.CreateTask | c.GetTask):
            self.engine.services.task_rows.forget(self.task_id)
        match command:
            case c.CreateTask():
                return await self._create(command, out)
            case c.TurnStart():
                return await self._trigger(Trigger.on_turn_start, "", out)
            case c.TurnComplete():
                return await self._trigger(Trigger.on_turn_complete, "", out)
            case c.MoveTask():
                return await self._move(command.step_id, "E2", "move_task", out)
            case c.RecordDecision():
                return await self._record_decision(command, out)
            case c.SwitchWorkflow():
                return await self._switch_workflow(command, out)
            case c.UpdateTask():
                return await self._update(command, out)
            case c.StartTask():
                return await self._start(command, out)
            case c.DeleteTask():
                return await self._delete()
            case Promotion():
                return await self._promoted(command, out)
            case c.AddParticipant():
                return await self._add_participant(command)
            case c.GetTask():
                return tasks.task_as_dict(await self.engine.load_task(self.task_id))
            case c.ListDecisions():
                return await self._store.transact(
                    lambda conn: [
                        attrs.asdict(d)
                        for d in participants.decisions_for(
                            conn, task_id=self.task_id, step_id=command.step_id
                        )
                    ]
                )
            case c.ListStepEntries():
                return await self._store.transact(self._entries)
        if isinstance(command, c.AgentError):
            return await self._agent_error(command, out)
        if isinstance(command, c.ChildrenCompleted):
            return await self._children_completed(command, out)
        trigger = EVENT_TRIGGERS.get(type(command))
        if trigger is None:
            raise TypeError(f"task actor cannot handle {type(command).__name__}")
        return await self._trigger(trigger, operation_id(command), out)

    async def _agent_error(self, command: c.AgentError, out: Outbox) -> Any:
        """Evaluate on_agent_error evaluate-only; commit a deferred transition, then mark — iff it committed.

        The operation's lock is held from before the task is loaded until after the mark, so a concurrent
        delivery evaluates the committed state (evaluate-only-operation-marking.md AC-EO-10, AC-EO-11,
        AC-EO-13, AC-EO-17).
        """
        op = operation_id(command)
        async with self.locks.agent_error.hold(op):
            inp = HandleInput(self.task_id, Trigger.on_agent_error, op, evaluate_only=True)
            result = await self.engine.handle_trigger(inp, out)
            committed = False
            if result.operation_mark_deferred:
                committed = await self._commit_deferred(result, op, inp.trigger, out)
                if committed:
                    await self.engine.services.ledger.mark_applied(op)
        return {**attrs.asdict(result), "applied": result.applied or committed, "operation_id": op}

    async def _children_completed(self, command: c.ChildrenCompleted, out: Outbox) -> Any:
        """Check, evaluate, commit, then mark: the caller owns the mark (defer_operation_mark).

        The same child rows always give the same operation id, so the structurally double delivery (a state
        change plus a direct call) applies its transition once (operation-ledger-lifetime.md AC-B1, AC-R2).
        The trigger fires only when every child is terminal (issue 16 item 2): otherwise nothing runs and
        nothing is marked, so a later complete set still fires, and `not_terminal` names the open children.

        Raises NotFoundError (field children.<i>.workflow_id / .step_id) for a row naming no such place.
        """
        op = operation_id(command)
        ledger = self.engine.services.ledger
        async with self.locks.child_completion.hold(op):
            if await ledger.is_applied(op):
                return {"idempotent": True, "operation_id": op}
            pending = await self._children_not_terminal(command.children)
            if pending:
                out.diagnostic(
                    "info",
                    "children_not_terminal",
                    task_id=self.task_id,
                    operation_id=op,
                    not_terminal=[row["task_id"] for row in pending],
                )
                return {
                    "idempotent": False,
                    "transitioned": False,
                    "applied": False,
                    "operation_id": op,
                    "not_terminal": pending,
                }
            inp = HandleInput(
                self.task_id, Trigger.on_children_completed, op, evaluate_only=True, defer_operation_mark=True
            )
            result = await self.engine.handle_trigger(inp, out)
            committed = not result.transitioned or await self._commit_deferred(result, op, inp.trigger, out)
            if committed:
                await ledger.mark_applied(op)
        return {
            **attrs.asdict(result),
            "applied": result.transitioned and committed,
            "operation_id": op,
            "not_terminal": [],
        }

    async def _children_not_terminal(self, rows: list[c.ChildRow]) -> list[dict[str, Any]]:
        """The rows that are not terminal (actors/engine/children.py); task rows are read only for open
        children whose row names no place."""
        registered = self.engine.services.workflows.workflows
        children.check_places(rows, registered)
        unplaced = children.unplaced(rows)
        stored: dict[str, children.Place] = {}
        if unplaced:
            stored = await self._store.transact(lambda conn: children.stored_places(conn, unplaced))
        return children.not_terminal(rows, stored, registered)

    async def _commit_deferred(self, result: HandleResult, op: str, trigger: Trigger, out: Outbox) -> bool:
        """Commit a deferred transition; False (and a warning) on any of the non-committing paths.

        Those are: the source step no longer loads, the target step is missing, the host's preflight
        refuses, the write fails, or the task already left the source step (AC-EO-11). A storage fault is
        re-raised after the warning, so the command's reply is the typed `StorageError` (issue 11, item 2).
        """
        services = self.engine.services
        try:
            task = await self.engine.load_task(self.task_id)
            workflow = services.workflows.get(task.workflow_id)
            source = find_step(workflow, result.from_step or "")
            target = find_step(workflow, result.to_step or "")
            at_source = attrs.evolve(task, step_id=source.id)
            return await self.engine.enter_step(
                at_source, workflow, target, path="E1", trigger=str(trigger), out=out
            )
        except Exception as exc:  # every failure leaves the operation retryable
            out.diagnostic(
                "warning",
                "deferred_commit_failed",
                task_id=self.task_id,
                session_id=None,
                operation_id=op,
                from_step=result.from_step,
                to_step=result.to_step,
                cause=repr(exc),
            )
            if isinstance(exc, StorageError):  # still unmarked (AC-EO-11), and the reply says why, typed
                raise
            return False

    async def _create(self, command: c.CreateTask, out: Outbox) -> Any:
        """Create the task (not an entry). Into a full step it is queued there, or, when the step has a
        feeder with room, placed in the feeder tagged for the step (kandev-engine-notes.md, WIP limits).

        Raises WipLimitError (field step_id) when the step and its feeder are both full.
        """
        workflow = self.engine.services.workflows.get(command.workflow_id)
        target = find_step(workflow, command.step_id) if command.step_id else workflow.start_step
        now = self.engine.services.now()

        def insert(conn: sqlite3.Connection) -> TaskRecord:
            step, admitted, queued_for = target.id, True, None
            if not wip.has_room(conn, workflow.id, target.id, target.wip_limit):
                feeder = target.pull_from_step_id
                if feeder is None:
                    admitted, queued_for = False, target.id
                elif wip.has_room(conn, workflow.id, feeder, workflow.step(feeder).wip_limit):
                    step, queued_for = feeder, target.id
                else:
                    occupancy = wip.occupancy(conn, workflow.id, target.id)
                    raise WipLimitError(
                        f"step {target.id!r} is at its WIP limit {target.wip_limit} ({occupancy} admitted)"
                        f" and so is its feeder {feeder!r}",
                        field="step_id",
                    )
            return tasks.insert_task(
                conn,
                task_id=command.task_id,
                workflow_id=workflow.id,
                step_id=step,
                title=command.title,
                session_id=command.session_id,
                primary_agent_id=command.primary_agent_id,
                ceo_agent_id=command.ceo_agent_id,
                priority=command.priority,
                now=now,
                admitted=admitted,
                queued_for_step_id=queued_for,
            )

        task = await self._store.transact(insert)
        self.engine.services.task_rows.put(task)  # as committed: its first move needs no read
        step = workflow.step(task.step_id)
        out.emit(TaskCreated(task_id=task.id, workflow_id=workflow.id, step_id=step.id))
        if not task.wip_admitted:
            out.emit(TaskQueued(task_id=task.id, step_id=step.id))
        return tasks.task_as_dict(task)

    async def _delete(self) -> Any:
        """Delete the task (its rows cascade); a slot it held is freed for promotion."""
        task = await self.engine.load_task(self.task_id)
        await self._store.transact(lambda conn: tasks.delete_task(conn, self.task_id))
        workflow = self.engine.services.workflows.workflows.get(task.workflow_id)
        if workflow is not None and workflow.has_step(task.step_id) and task.wip_admitted:
            await self.engine.promote(workflow, workflow.step(task.step_id))
        return {"deleted": True}

    async def _promoted(self, promotion: Promotion, out: Outbox) -> Any:
        """Dispatch the on_enter of an entry a WIP promotion committed for this task (E3)."""
        task = await self.engine.load_task(self.task_id)
        if task.step_id != promotion.step_id or not task.wip_admitted:
            return {"dispatched": False}  # it moved on; an open entry is closed by the next recovery scan
        workflow = self.engine.services.workflows.get(promotion.workflow_id)
        step = find_step(workflow, promotion.step_id)
        seq = promotion.key.entry_seq if promotion.key else None
        out.emit(StepEntered(task_id=task.id, step_id=step.id, entry_seq=seq, entry_path="E3"))
        await self.engine.dispatch_entry(task, workflow, step, promotion.key, "E3", out)
        return {"dispatched": True}

    async def _trigger(self, trigger: Trigger, op: str, out: Outbox) -> Any:
        result = await self.engine.handle_trigger(HandleInput(self.task_id, trigger, op), out)
        return {**attrs.asdict(result), "operation_id": op or None}

    async def _move(self, step_id: str, path: EntryPath, trigger: str, out: Outbox) -> Any:
        """Manual or API step change; a move to the current step is not an entry and does nothing.

        A cached row (actors/kernel/task_rows.py) saves the read: the admission's compare-and-set verifies it,
        and a mismatch (`StaleRow`, nothing written) decides the move again from a fresh read. The no-op
        answer is only ever given from a fresh read (issue 14 item "A cached task row").
        """
        rows = self.engine.services.task_rows
        cached = rows.get(self.task_id)
        if cached is not None:
            rows.forget(self.task_id)  # an admission caches its new row; anything else reads afresh
            workflow = self.engine.services.workflows.workflows.get(cached.workflow_id)
            if workflow is not None and workflow.has_step(step_id) and step_id != cached.step_id:
                try:
                    moved = await self.engine.enter_step(
                        cached,
                        workflow,
                        workflow.step(step_id),
                        path=path,
                        trigger=trigger,
                        out=out,
                        cached=True,
                    )
                    return {"moved": moved, "step_id": step_id if moved else cached.step_id}
                except StaleRow:
                    pass  # nothing was written: decide it from the committed row
        task = await self.engine.load_task(self.task_id)
        workflow = self.engine.services.workflows.get(task.workflow_id)
        target = find_step(workflow, step_id)
        if target.id == task.step_id:
            return {"moved": False, "step_id": task.step_id}
        moved = await self.engine.enter_step(task, workflow, target, path=path, trigger=trigger, out=out)
        return {"moved": moved, "step_id": target.id if moved else task.step_id}

    async def _record_decision(self, command: c.RecordDecision, out: Outbox) -> Any:
        """Record a decision and apply the first satisfied guarded transition of its step.

        In-process redeliveries are stopped by the ledger (`decision:<task>:<step>:<id>`, marked after the
        in-call commit: AC-EO-9); across restarts the durable receipt keeps a redelivered vote out of a
        later round, and the guards are simply re-evaluated. A reused `decision_id` with other content is a
        ConflictError in both cases (issue 12 item 6).

        The reply says whether the vote counted (`counted`, `not_counted_reason`; a WARNING
        `decision_not_counted` diagnostic when it did not) and what the guards did (`guard_outcome`: moved,
        quorum_not_met, move_abandoned, no_guard, or not_at_step when the task is not at the decision's step:
        nothing is evaluated).
        Source: issue 12 item 1.
        """
        op = (
            decision_operation_id(self.task_id, command.step_id, command.decision_id)
            if command.decision_id
            else ""
        )
        ledger = self.engine.services.ledger
        applied = bool(op) and await ledger.is_applied(op)
        workflows, now = self.engine.services.workflows, self.engine.services.now()
        recorded = await self._store.transact(lambda conn: decisions.record(conn, command, workflows, now))
        if applied and not recorded.inserted:
            return {"idempotent": True, "operation_id": op}
        if recorded.inserted:
            out.emit(
                DecisionRecorded(
                    decision_id=recorded.decision_id,
                    task_id=self.task_id,
                    step_id=command.step_id,
                    decider_id=command.decider_id,
                    decision=command.decision,
                    role=recorded.role or "",
                )
            )
        if recorded.not_counted is not None:
            out.diagnostic(
                "warning",
                "decision_not_counted",
                task_id=self.task_id,
                step_id=command.step_id,
                decision_id=recorded.decision_id,
                decider_type=command.decider_type,
                decider_id=command.decider_id,
                participant_id=command.participant_id,
                role=recorded.role,
                reason=recorded.not_counted,
            )
        # Re-evaluated on a replay too: a redelivery may follow a first delivery whose transition failed.
        moved_to, guard_outcome = None, "not_at_step"
        if recorded.task.step_id == command.step_id:
            moved_to, guard_outcome = await self._reevaluate(recorded.task, out)
        if op:
            await ledger.mark_applied(op)
        return {
            "decision_id": recorded.decision_id,
            "recorded": recorded.inserted,
            "role": recorded.role,
            "counted": recorded.not_counted is None if recorded.inserted else None,
            "not_counted_reason": recorded.not_counted,
            "moved_to": moved_to,
            "guard_outcome": guard_outcome,
            "operation_id": op or None,
        }

    async def _reevaluate(self, task: TaskRecord, out: Outbox) -> tuple[str | None, GuardOutcome]:
        """Apply the first satisfied guarded on_turn_complete transition of the task's step.

        Returns (the step moved to, or None; the outcome). The move is a compare-and-set on the task still
        being at its step; a lost race is `move_abandoned` (with a `transition_abandoned` diagnostic),
        distinct from `quorum_not_met` (kandev-engine-notes.md, "Quorum guards"; issue 12 item 1).
        """
        workflow = self.engine.services.workflows.get(task.workflow_id)
        if not workflow.has_step(task.step_id):  # a template re-registered without it: nothing to evaluate
            return None, "no_guard"
        step = workflow.step(task.step_id)
        guarded = decisions.quorum_guards(step)
        if not guarded:
            return None, "no_guard"
        for guard in guarded:
            target = await self.engine.evaluate_transition(task, workflow, step, guard.action, out)
            if target is not None:
                moved = await self.engine.enter_step(
                    task, workflow, target, path="E1", trigger="record_decision", out=out
                )
                return (target.id, "moved") if moved else (None, "move_abandoned")
        return None, "quorum_not_met"

    async def _switch_workflow(self, command: c.SwitchWorkflow, out: Outbox) -> Any:
        """Entry path E4, deduplicated on `<op>:switch_workflow:on_enter`; both phase keys marked after."""
        ledger = self.engine.services.ledger
        op = switch_workflow_operation_id(command.operation_id, "on_enter") if command.operation_id else ""
        if op and await ledger.is_applied(op):
            return {"idempotent": True, "operation_id": op}
        task = await self.engine.load_task(self.task_id)
        workflow = self.engine.services.workflows.get(command.workflow_id)
        target = find_step(workflow, command.step_id) if command.step_id else workflow.start_step
        if workflow.id == task.workflow_id and target.id == task.step_id:
            return {"moved": False, "step_id": task.step_id}
        moved = await self.engine.enter_step(
            task, workflow, target, path="E4", trigger="switch_workflow", out=out
        )
        if op:
            await ledger.mark_applied(switch_workflow_operation_id(command.operation_id or "", "on_exit"))
            await ledger.mark_applied(op)
        return {"moved": moved, "workflow_id": workflow.id, "step_id": target.id, "operation_id": op or None}

    async def _update(self, command: c.UpdateTask, out: Outbox) -> Any:
        fields = {
            name: value
            for name in ("title", "priority", "session_id", "primary_agent_id")
            if (value := getattr(command, name)) is not None
        }
        now = self.engine.services.now()

        def update(conn: sqlite3.Connection) -> None:
            tasks.get_task(conn, self.task_id)
            tasks.update_task_fields(conn, self.task_id, fields, now)

        await self._store.transact(update)
        if command.step_id:
            await self._move(command.step_id, "E5", "update_task", out)
        return tasks.task_as_dict(await self.engine.load_task(self.task_id))

    async def _start(self, command: c.StartTask, out: Outbox) -> Any:
        if command.session_id:
            now = self.engine.services.now()
            await self._store.transact(
                lambda conn: tasks.update_task_fields(
                    conn, self.task_id, {"session_id": command.session_id}, now
                )
            )
        if command.step_id:
            await self._move(command.step_id, "E5", "start_task", out)
        return tasks.task_as_dict(await self.engine.load_task(self.task_id))

    async def _add_participant(self, command: c.AddParticipant) -> Any:
        task = await self.engine.load_task(self.task_id)
        workflow = self.engine.services.workflows.get(task.workflow_id)
        find_step(workflow, command.step_id)
        participant_id = await self._store.transact(
            lambda conn: participants.add_participant(
                conn,
                workflow_id=task.workflow_id,
                step_id=command.step_id,
                task_id=self.task_id,
                role=command.role,
                agent_profile_id=command.agent_profile_id,
                decision_required=command.decision_required,
                position=command.position,
            )
        )
        return {"participant_id": participant_id}

    def _entries(self, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        return [
            step_entries.entry_as_dict(
                entry, step_entries.markers(conn, EntryKey(entry.task_id, entry.step_id, entry.entry_seq))
            )
            for entry in step_entries.entries_for_task(conn, self.task_id)
        ]
