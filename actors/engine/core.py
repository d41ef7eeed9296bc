"""The engine: trigger evaluation, guarded transitions and step entry.

`handle_trigger` walks the current step's actions for a trigger: the first transition whose guard passes
(requires_approval transitions skipped) fixes the target; other actions run through their executors and
abort on the first error (on-enter spec AC-C5). The transition commits (with its step-entry record, in one
transaction) before on_enter dispatches, and the operation id is marked only after every effect committed.
Sources: kandev-engine-notes.md "Trigger handling", "Quorum guards"; on-enter-action-dispatch.md AC-B7.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence

import attrs

from onceflow.actors.engine.actions import HOST_ACTION_TYPES, ActionContext, publish_effect
from onceflow.actors.engine.common import (
    Admission,
    Admitted,
    Plan,
    admit_common,
    admit_group,
    common_order,
    common_plan,
    group_key,
    publish_common,
)
from onceflow.actors.engine.on_enter import OnEnterDispatch, SegmentResult
from onceflow.actors.engine.promotion import allocate_for, promote_one
from onceflow.actors.engine.quorum import evaluate_quorum, parse_threshold
from onceflow.actors.engine.session import request_session_action
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services, find_step
from onceflow.logs import get_logger
from onceflow.protocol import trusted
from onceflow.protocol.errors import (
    ActionError,
    ActionNotWiredError,
    StorageError,
    TransitionFailedError,
    TransitionRefusedError,
)
from onceflow.protocol.events import EntryPath, GuardEvaluated, TaskQueued
from onceflow.protocol.host import preflight_is_noop
from onceflow.protocol.workflow import (
    TRANSITION_TYPES,
    ActionDecl,
    Step,
    Trigger,
    Workflow,
)
from onceflow.store import faults, participants, tasks, wip
from onceflow.store.records import Decision, Participant, TaskRecord
from onceflow.store.savepoint import savepoint
from onceflow.store.step_entries import EntryKey
from onceflow.store.writer import Grouped

log = get_logger("onceflow.engine")


@attrs.frozen
class HandleInput:
    """One trigger delivery for one task. An empty `operation_id` means the trigger carries none.

    `evaluate_only`: evaluate and run the non-transition actions, but leave a chosen transition to the
    caller (a deferred transition). `defer_operation_mark`: the caller owns the mark in every case (it
    checks and marks around its own commit). Source: evaluate-only-operation-marking.md.
    """

    task_id: str
    trigger: Trigger
    operation_id: str = ""
    evaluate_only: bool = False
    defer_operation_mark: bool = False


@attrs.frozen
class HandleResult:
    """What one trigger evaluation decided and did.

    `idempotent`: the operation id was already applied and nothing ran. `transitioned`: a target step other
    than the current one was chosen (`to_step`); `applied` says whether this call committed it (False for a
    deferred transition, or when the task moved meanwhile). `operation_mark_deferred`: the engine did not
    mark a non-empty operation id because it deferred the transition; the caller owns the mark
    (evaluate-only-operation-marking.md AC-EO-4).
    """

    idempotent: bool = False
    from_step: str | None = None
    to_step: str | None = None
    transitioned: bool = False
    applied: bool = False
    operation_mark_deferred: bool = False


class StaleRow(Exception):
    """A cached task row failed the admission's compare-and-set: nothing was written; read it afresh."""


EntryPlan = tuple[Sequence[ActionDecl], Plan | None]
"""A move's source on_exit actions and, when it has none, the target's common-entry plan (or None)."""

_PLAN_MEMO = 4096
"""Entry plans an engine remembers before it starts over (a plan is a few references)."""


@attrs.define
class Engine:
    """Evaluates triggers and applies transitions for tasks; stateless apart from the shared services and
    memos of what the (immutable) workflows and the host decide (an engine is rebuilt on reconfiguration)."""

    services: Services
    _asks_preflight: bool = attrs.field(init=False)
    _plans: dict[tuple[int, int, str], tuple[Step | None, Step, EntryPlan]] = attrs.field(
        init=False, factory=dict
    )

    def __attrs_post_init__(self) -> None:
        self._asks_preflight = not preflight_is_noop(self.services.host)

    async def load_task(self, task_id: str) -> TaskRecord:
        """The task's committed row. Raises NotFoundError (field task_id)."""
        return await self.services.store.transact(lambda conn: tasks.get_task(conn, task_id))

    async def handle_trigger(self, inp: HandleInput, out: Outbox) -> HandleResult:
        """Evaluate `inp.trigger` for the task's current step and apply what it decides.

        The operation id (when non-empty) is checked first and marked only after every action succeeded
        and the transition committed; it is also marked when the step declares no actions; it is never
        marked on error, nor for a deferred transition, nor under `defer_operation_mark`
        (evaluate-only-operation-marking.md AC-EO-1 ... AC-EO-7; operation-ledger-lifetime.md AC-S5).

        Raises:
            NotFoundError: the task, its workflow or its step does not exist.
            ActionNotWiredError: an operation-bearing trigger declares an action with no executor (none ran).
            ActionError: an action failed (abort on first error, on-enter spec AC-C5); the id stays unmarked.
        """
        ledger = self.services.ledger
        if inp.operation_id and not inp.defer_operation_mark and await ledger.is_applied(inp.operation_id):
            return HandleResult(idempotent=True)
        task = await self.load_task(inp.task_id)
        workflow = self.services.workflows.get(task.workflow_id)
        step = find_step(workflow, task.step_id)
        actions = step.events.actions(inp.trigger)
        if inp.operation_id:
            self._check_executors(step, inp.trigger, actions)
        target: Step | None = None
        for position, action in enumerate(actions):
            if action.type in TRANSITION_TYPES:
                if target is None:
                    target = await self.evaluate_transition(task, workflow, step, action, out)
                continue
            await self._trigger_action(task, step, inp, position, action, out)
        result = HandleResult(from_step=step.id)
        if target is not None and target.id != step.id:
            result = attrs.evolve(result, to_step=target.id, transitioned=True)
            if inp.evaluate_only:
                deferred = bool(inp.operation_id) and not inp.defer_operation_mark
                return attrs.evolve(result, operation_mark_deferred=deferred)
            applied = await self.enter_step(
                task, workflow, target, path="E1", trigger=str(inp.trigger), out=out
            )
            result = attrs.evolve(result, applied=applied)
        if inp.operation_id and not inp.defer_operation_mark:
            await ledger.mark_applied(inp.operation_id)
        return result

    def _check_executors(self, step: Step, trigger: Trigger, actions: Sequence[ActionDecl]) -> None:
        """Every non-transition action must have an executor before any runs (ledger spec, Design)."""
        for position, action in enumerate(actions):
            if action.type in TRANSITION_TYPES or action.type in HOST_ACTION_TYPES:
                continue
            if action.type not in self.services.executors:
                raise ActionNotWiredError(
                    f"step {step.id!r} declares {action.type!r} for {trigger} but no executor is registered",
                    field=f"events.{trigger}[{position}].type",
                )

    async def evaluate_transition(
        self, task: TaskRecord, workflow: Workflow, step: Step, action: ActionDecl, out: Outbox
    ) -> Step | None:
        """The step this transition moves to, or None (requires_approval, no such step, guard fails)."""
        config = action.config
        if getattr(config, "requires_approval", False):
            return None
        if action.type == "move_to_next":
            target = workflow.next_step(step.id)
        elif action.type == "move_to_previous":
            target = workflow.previous_step(step.id)
        else:
            target = workflow.step(getattr(config, "step_id", ""))
        guard = getattr(config, "guard", None)
        if target is None or guard is None:
            return target
        rows, decisions = await self._seats_and_decisions(task, step.id)
        quorum = evaluate_quorum(
            threshold=parse_threshold(guard.threshold),
            role=guard.role,
            task_id=task.id,
            step_id=step.id,
            participants=rows,
            decisions=decisions,
        )
        out.emit(
            GuardEvaluated(
                task_id=task.id,
                step_id=step.id,
                target_step=target.id,
                role=guard.role,
                threshold=guard.threshold,
                satisfied=quorum.satisfied,
                seats=quorum.seats,
                approvals=quorum.approvals,
                reason=quorum.reason,
            )
        )
        return target if quorum.satisfied else None

    async def _seats_and_decisions(
        self, task: TaskRecord, step_id: str
    ) -> tuple[list[Participant], list[Decision]]:
        def read(conn: sqlite3.Connection) -> tuple[list[Participant], list[Decision]]:
            rows = participants.participants_for_task(conn, workflow_id=task.workflow_id, task_id=task.id)
            return rows, participants.decisions_for(conn, task_id=task.id, step_id=step_id)

        return await self.services.store.transact(read)

    async def _trigger_action(
        self, task: TaskRecord, step: Step, inp: HandleInput, position: int, action: ActionDecl, out: Outbox
    ) -> None:
        """Run one non-transition action of a non-on_enter trigger; raise ActionError on failure."""
        if action.type in HOST_ACTION_TYPES:
            await request_session_action(
                self.services, task, action, out, step_id=step.id, trigger=str(inp.trigger), position=position
            )
            return
        executor = self.services.executors.get(action.type)
        if executor is None:
            raise ActionNotWiredError(
                f"no executor is registered for {action.type!r}",
                field=f"events.{inp.trigger}[{position}].type",
            )
        op = inp.operation_id
        ctx = ActionContext(
            task=task,
            step_id=step.id,
            step_name=step.name,
            trigger=str(inp.trigger),
            key_for=lambda agent, digest: f"{op}:{step.id}:{task.id}:{agent}:{digest}" if op else None,
            exclude_from_coalescing=inp.trigger == Trigger.on_comment,
            now=self.services.now(),
        )
        effect = await self.services.store.transact(lambda conn: executor(conn, ctx, action))
        publish_effect(
            out,
            effect,
            task_id=task.id,
            step_id=step.id,
            trigger=str(inp.trigger),
            position=position,
            kind=action.type,
        )
        if effect.state == "failed":
            raise ActionError(
                f"{action.type} failed: {effect.detail}", field=f"events.{inp.trigger}[{position}]"
            )

    async def enter_step(
        self,
        task: TaskRecord,
        workflow: Workflow,
        target: Step,
        *,
        path: EntryPath,
        trigger: str,
        out: Outbox,
        cached: bool = False,
    ) -> bool:
        """Admit the task to `target` and dispatch its on_enter; False if the task moved meanwhile.

        The step change is a compare-and-set on the task's current step, and the step-entry record (when
        the target declares an engine-owned on_enter action) is allocated in the same transaction. If that
        transaction fails nothing lands and an ERROR names task and step (AC-B7); the error propagates, as
        TransitionFailedError or, for a storage fault, as the StorageError itself (issue 11, item 2).
        When no host action has to come first (no on_exit on the source step, no leading session action)
        the dispatch's leading segment runs in the admitting transaction too, in a savepoint: one commit
        for the move and its first effects, and a failure there leaves the move standing (AC-C4). An entry
        of built-in clears and fan-outs only is first tried whole in one savepoint (`common_entry`); any
        anomaly rolls that back and the per-action path above decides it (issue 14).

        `cached`: `task` came from the task-row cache (actors/kernel/task_rows.py), not a read. The
        compare-and-set then also verifies its workflow, admitted flag and admission counter; on any mismatch
        nothing is written and `StaleRow` is raised for the caller to read the row afresh and decide again
        (the host's preflight, already called with the cached source step, is then called again with the real
        one: a stale row costs an extra preflight, never a wrong commit; a refusal is asked again the same
        way, so a refusal is only ever answered from the committed row). The admitted row is cached; any other
        outcome forgets it (issue 14 item "A cached task row").
        """
        if self._asks_preflight:  # the default host's preflight accepts everything: no await for it
            try:
                await self.services.host.preflight_transition(
                    task_id=task.id, from_step=task.step_id, to_step=target.id
                )
            except Exception as exc:
                if cached:  # perhaps refused for a stale source step: ask again with the committed row
                    raise StaleRow(task.id) from exc
                raise TransitionRefusedError(
                    f"the host refused {task.step_id!r} -> {target.id!r}: {exc!r}", field="step_id"
                ) from exc
        now = self.services.now()
        # As an admission leaves the row (this actor serializes the task's commands); used only if admitted.
        entered = attrs.evolve(
            task,
            workflow_id=workflow.id,
            step_id=target.id,
            admissions=task.admissions + 1,
            wip_admitted=True,
            queued_for_step_id=None,
            updated_at=now,
        )
        source_workflow = self.services.workflows.workflows.get(task.workflow_id)
        source = None
        if source_workflow is not None and source_workflow.has_step(task.step_id):
            source = source_workflow.step(task.step_id)
        on_exit, common = self._entry_plan(source, target, path)
        version = (task.workflow_id, task.wip_admitted, task.admissions) if cached else None

        def admit(conn: sqlite3.Connection) -> tuple[str, EntryKey | None, SegmentResult | Admitted | None]:
            if common is not None:  # the whole entry in one savepoint, or nothing of it (issue 14)
                fast = admit_common(
                    conn,
                    task=task,
                    workflow_id=workflow.id,
                    plan=common,
                    path=path,
                    now=now,
                    version=version,
                )
                if fast is not None:
                    return "admitted", fast.key, fast  # its events are built below, off the writer thread
            admitted = wip.has_room(conn, workflow.id, target.id, target.wip_limit, excluding=task.id)
            moved = tasks.move_task_step(
                conn,
                task_id=task.id,
                expected_step_id=task.step_id,
                workflow_id=workflow.id,
                step_id=target.id,
                now=now,
                admitted=admitted,
                version=version,
            )
            if not moved:
                return "stale" if cached else "abandoned", None, None
            if not admitted:  # a queued placement: not an entry, nothing allocated
                return "queued", None, None
            # The landing step's declaration was resolved by the caller and is read once (Allocation inputs).
            key = allocate_for(
                conn, task_id=task.id, workflow_id=workflow.id, step=target, path=path, now=now
            )
            first = None
            dispatch = OnEnterDispatch(self.services, entered, workflow, target, key, path, out)
            lead = dispatch.leading_segment() if key is not None and not on_exit else None
            if key is not None and lead is not None:
                actions, finish = lead
                try:
                    with savepoint(conn, "dispatch"):
                        first = dispatch.segment(conn, key, actions, now, check_digest=False, finish=finish)
                except Exception as exc:  # the move stands; the dispatch runs on its own after the commit
                    if faults.ends_transaction(conn, exc):  # unless the transaction itself is gone
                        raise
                    log.error("leading_segment_failed", task_id=task.id, step_id=target.id, cause=repr(exc))
            return "admitted", key, first

        group = None
        if common is not None and not target.wip_limit:  # the writer may admit it with others (issue 14)
            admission = Admission(task, workflow.id, common, path, now, version)
            group = Grouped(group_key(admission), admission, _admit_together)
        rows = self.services.task_rows
        try:
            outcome, key, first = await self.services.store.transact(admit, group)
        except Exception as exc:  # nothing landed: neither the step change nor its record (AC-B7)
            rows.forget(task.id)
            log.error(
                "step_admission_failed", task_id=task.id, step_id=target.id, entry_path=path, cause=repr(exc)
            )
            if isinstance(exc, StorageError):  # the host learns the fault's kind and whether to retry
                raise
            raise TransitionFailedError(
                f"moving task {task.id!r} to {target.id!r} failed and nothing was committed: {exc!r}",
                field="step_id",
            ) from exc
        if outcome == "admitted":
            rows.put(entered)
        else:
            rows.forget(task.id)
        if outcome == "stale":
            raise StaleRow(task.id)
        if outcome == "abandoned":
            out.diagnostic(
                "info",
                "transition_abandoned",
                task_id=task.id,
                expected_step=task.step_id,
                target_step=target.id,
            )
            return False
        out.emit(  # the runtime's own typed values: unvalidated (issue 14)
            trusted.transition(
                task_id=task.id,
                workflow_id=workflow.id,
                from_step=task.step_id,
                to_step=target.id,
                trigger=trigger,
            )
        )
        for position, action in enumerate(on_exit):  # it left the source step
            await request_session_action(
                self.services,
                task,
                action,
                out,
                step_id=task.step_id,
                trigger=str(Trigger.on_exit),
                position=position,
                path=path,
            )
        if outcome == "queued":
            out.emit(TaskQueued(task_id=task.id, step_id=target.id))
        else:
            out.emit(
                trusted.step_entered(
                    task_id=task.id,
                    step_id=target.id,
                    entry_seq=key.entry_seq if key else None,
                    entry_path=path,
                )
            )
            if not isinstance(first, Admitted):
                await self.dispatch_entry(entered, workflow, target, key, path, out, first)
            else:  # committed whole in the admission, which only a common plan makes: publish what it did
                assert common is not None
                publish_common(out, task.id, common, first.done)
        await self.promote_after_move(task, workflow, target if outcome == "admitted" else None)
        return True

    def _entry_plan(self, source: Step | None, target: Step, path: EntryPath) -> EntryPlan:
        """The source step's on_exit actions and, without any, the target's common-entry plan on `path`
        (`common_entry.common_order`, `common_plan`), memoized per (source, target, path) step objects
        (issue 14)."""
        key = (id(source), id(target), path)
        memo = self._plans.get(key)
        if memo is not None and memo[0] is source and memo[1] is target:
            return memo[2]
        on_exit = source.events.actions(Trigger.on_exit) if source is not None else ()
        order = None if on_exit else common_order(self.services, target, path)
        plan: EntryPlan = (on_exit, None if order is None else common_plan(target, order))
        if len(self._plans) >= _PLAN_MEMO:
            self._plans.clear()
        self._plans[key] = (source, target, plan)  # the references keep the ids from being reused
        return plan

    async def dispatch_entry(
        self,
        task: TaskRecord,
        workflow: Workflow,
        step: Step,
        key: EntryKey | None,
        path: EntryPath,
        out: Outbox,
        first: SegmentResult | None = None,
    ) -> None:
        """Run the on_enter of a committed entry (`first`: its leading segment, already committed with the
        admission). Never raises: the transition stands whatever its actions do (AC-C4), and an entry left
        open is resumed by the next start's recovery scan. A failure (a storage fault included) is logged
        and reported as an `on_enter_dispatch_failed` diagnostic, never silent."""
        try:
            await OnEnterDispatch(self.services, task, workflow, step, key, path, out).run(first)
        except Exception as exc:
            out.diagnostic(  # logged at ERROR too
                "error",
                "on_enter_dispatch_failed",
                task_id=task.id,
                step_id=step.id,
                entry_seq=key.entry_seq if key else None,
                cause=repr(exc),
            )

    async def promote_after_move(
        self, task: TaskRecord, workflow: Workflow, admitted_to: Step | None
    ) -> None:
        """A slot freed at the task's former step; a step the task now feeds got work (E3)."""
        source_workflow = self.services.workflows.workflows.get(task.workflow_id)
        if source_workflow is not None and source_workflow.has_step(task.step_id) and task.wip_admitted:
            source = source_workflow.step(task.step_id)
            if _takes_promotions(source_workflow, source):
                await self.promote(source_workflow, source)
        if admitted_to is not None:
            for step in workflow.fed_by(admitted_to.id):
                await self.promote(workflow, step)

    async def promote(self, workflow: Workflow, step: Step) -> int:
        """Admit candidates into `step` while it has room; each admitted task's actor dispatches its entry.

        Returns how many were promoted. Each claim is its own transaction with its step-entry record.
        """
        promoted = 0
        while True:
            now = self.services.now()
            promotion = await self.services.store.transact(
                functools.partial(promote_one, workflow=workflow, step=step, now=now)
            )
            if promotion is None:
                return promoted
            promoted += 1
            self.services.task_rows.forget(promotion.task_id)  # its row changed outside its actor
            self.services.announce_promotion(promotion)


def _admit_together(
    conn: sqlite3.Connection, admissions: list[Admission]
) -> list[tuple[str, EntryKey | None, SegmentResult | Admitted | None]] | None:
    """The writer's run for a group of common entries (`enter_step`'s `Grouped`): each admission's result
    as its own request's `admit` returns it, or None for each to be decided alone."""
    admitted = admit_group(conn, admissions)
    return None if admitted is None else [("admitted", entry.key, entry) for entry in admitted]


def _takes_promotions(workflow: Workflow, step: Step) -> bool:
    """Whether a freed slot at `step` can admit anyone: it has a WIP limit, a feeder, or feeds a step.

    Without any of them no task can be waiting for the slot, so the promotion query is skipped (the start-up
    promotion still covers a task queued under a limit since removed).
    """
    return step.wip_limit > 0 or bool(step.pull_from_step_id) or bool(workflow.fed_by(step.id))
