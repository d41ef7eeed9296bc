"""The engine: trigger evaluation, guarded transitions and step entry. Trio thread: every database effect
is a store request; what it committed is published here.

`handle_trigger` walks the current step's actions for a trigger: the first transition whose guard passes
(requires_approval transitions skipped) fixes the target; other actions run through their executors and
abort on the first error (on-enter spec AC-C5). The transition commits (with its step-entry record, in one
transaction) before on_enter dispatches, and the operation id is marked only after every effect committed.
Sources: kandev-engine-notes.md "Trigger handling", "Quorum guards"; on-enter-action-dispatch.md AC-B7.
"""

from __future__ import annotations

import attrs
from opentelemetry import trace
from opentelemetry.trace import Tracer

from onceflow.actors.engine import guards, promotion
from onceflow.actors.engine.common import publish_common
from onceflow.actors.engine.entry import EntryPlans, StaleRow, plan_entry
from onceflow.actors.engine.on_enter import OnEnterDispatch
from onceflow.actors.engine.publish import publish_run_changes
from onceflow.actors.engine.session import request_session_action
from onceflow.actors.engine.triggers import HandleInput, HandleResult, check_executors, run_trigger_action
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.observability import metrics, tracing
from onceflow.observability.logs import get_logger
from onceflow.protocol import trusted
from onceflow.protocol.errors import (
    HostRefusedError,
    HostTimeoutError,
    HostUnavailableError,
    StorageError,
    TransitionFailedError,
    TransitionRefusedError,
)
from onceflow.protocol.events import EntryPath, TaskQueued
from onceflow.protocol.host import preflight_is_noop
from onceflow.protocol.workflow import TRANSITION_TYPES, ActionDecl, Step, Trigger, Workflow, find_step
from onceflow.store.entries.admission import Entered, EntryRequest, admit, admit_together, group_key
from onceflow.store.entries.common_entry import Admitted
from onceflow.store.entries.segment import SegmentResult
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.records import TaskRecord
from onceflow.store.tasks import tasks
from onceflow.store.writer import Grouped

log = get_logger("onceflow.engine")

__all__ = ["Engine", "HandleInput", "HandleResult", "StaleRow"]

_TASK_ROWS = "task_rows"
"""The writer's group key of the task-row reads (`Engine.load_task`)."""


@attrs.define
class Engine:
    """Evaluates triggers and applies transitions for tasks; stateless apart from the shared services and
    memos of what the (immutable) workflows and the host decide (an engine is rebuilt on reconfiguration)."""

    services: Services
    _asks_preflight: bool = attrs.field(init=False)
    _plans: EntryPlans = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._asks_preflight = not preflight_is_noop(self.services.host)
        self._plans = EntryPlans(self.services.executors)

    async def load_task(self, task_id: str) -> TaskRecord:
        """The task's committed row, read with the writer batch's other rows in one statement
        (`tasks.get_tasks`). Raises NotFoundError (field task_id)."""
        read = Grouped(_TASK_ROWS, task_id, tasks.get_tasks)
        return await self.services.store.transact_grouped(read, tasks.get_task, task_id)

    async def handle_trigger(self, inp: HandleInput, out: Outbox) -> HandleResult:
        """Evaluate `inp.trigger` for the task's current step and apply what it decides.

        The operation id (when non-empty) is checked first and marked only after every action succeeded
        and the transition committed; it is also marked when the step declares no actions; it is never
        marked on error, nor for a deferred transition, nor under `defer_operation_mark`
        (evaluate-only-operation-marking.md AC-EO-1 ... AC-EO-7; operation-ledger-lifetime.md AC-S5).
        A cancellation leaves what committed so far and the operation id unmarked: a redelivery
        re-evaluates.

        Raises:
            NotFoundError: the task, its workflow or its step does not exist.
            ActionNotWiredError: an operation-bearing trigger declares an action with no executor (none ran).
            ActionError: an action failed (abort on first error, on-enter spec AC-C5); the id stays unmarked.
        """
        ledger = self.services.ledger
        if inp.operation_id and not inp.defer_operation_mark and await ledger.is_applied(inp.operation_id):
            return HandleResult(idempotent=True)
        task = await self.load_task(inp.task_id)
        workflow = self.services.workflows.for_task(task)
        step = find_step(workflow, task.step_id)
        actions = step.events.actions(inp.trigger)
        if inp.operation_id:
            check_executors(self.services.executors, step, inp.trigger, actions)
        target: Step | None = None
        for position, action in enumerate(actions):
            if action.type in TRANSITION_TYPES:
                if target is None:
                    target = await self.evaluate_transition(task, workflow, step, action, out)
                continue
            await run_trigger_action(self.services, task, step, inp, position, action, out)
        result = HandleResult(from_step=step.id)
        if target is not None and target.id != step.id:
            result = attrs.evolve(result, to_step=target.id, transitioned=True)
            if inp.evaluate_only:
                deferred = bool(inp.operation_id) and not inp.defer_operation_mark
                return attrs.evolve(result, operation_mark_deferred=deferred)
            applied = await self.enter_step(
                task,
                workflow,
                target,
                path="E1",
                trigger=str(inp.trigger),
                out=out,
                operation_id=inp.operation_id,
            )
            result = attrs.evolve(result, applied=applied)
        if inp.operation_id and not inp.defer_operation_mark:
            await ledger.mark_applied(inp.operation_id)
        return result

    async def evaluate_transition(
        self, task: TaskRecord, workflow: Workflow, step: Step, action: ActionDecl, out: Outbox
    ) -> Step | None:
        """The step this transition moves to, or None (`guards.evaluate_transition`)."""
        return await guards.evaluate_transition(self.services, task, workflow, step, action, out)

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
        operation_id: str = "",
    ) -> bool:
        """Admit the task to `target` and dispatch its on_enter; False if the task moved meanwhile.

        Three steps: plan (memory only, actors/engine/entry.py), commit (one store request,
        store/entries/admission.py: the compare-and-set step change, the step-entry record and, when no host
        action comes first, the dispatch's leading segment or the whole common entry), publish (the
        transition, the source step's on_exit host actions, step_entered or task_queued, what already ran,
        then the rest of the dispatch and the promotions the move allows). If the commit fails nothing lands
        and an ERROR names task and step (AC-B7); the error propagates, as TransitionFailedError or, for a
        storage fault, as the StorageError itself. A failure of the dispatch after the commit leaves the move
        standing (AC-C4). A cancellation after the commit leaves the entry open for the recovery scan.

        `cached`: `task` came from the task-row cache (actors/kernel/task_rows.py), not a read. The
        compare-and-set then also verifies its workflow, admitted flag and admission counter; on any
        mismatch nothing is written and `StaleRow` is raised for the caller to read the row afresh and
        decide again (the host's preflight, already called with the cached source step, is then called
        again with the real one: a stale row costs an extra preflight, never a wrong commit; a refusal is
        asked again the same way, so a refusal is only ever answered from the committed row). The admitted
        row is cached; any other outcome forgets it. `trigger` and `operation_id` (the command's or
        trigger's, "" for none) go into the task history's transition item (store/tasks/history.py).

        Traced (a recording tracer), it is the span `onceflow.entry` (onceflow/observability/tracing.py), its
        end in
        `onceflow.entry.result`.

        Raises:
            TransitionRefusedError: the host's preflight refused (field step_id); nothing was written.
            TransitionFailedError, StorageError: the admission failed; nothing was written.
            StaleRow: `cached`, and the row was stale; nothing was written.
        """
        tracer = self.services.tracing.tracer()
        if tracer is None:
            return await self._enter_step(
                task, workflow, target, path, trigger, out, cached, operation_id, None
            )
        attributes = tracing.ids(
            task_id=task.id, workflow_id=workflow.id, step_id=target.id, entry_path=path, trigger=trigger
        )
        with tracing.span(tracer, "onceflow.entry", attributes, benign=(StaleRow,)) as span:
            try:
                return await self._enter_step(
                    task, workflow, target, path, trigger, out, cached, operation_id, tracer
                )
            except StaleRow:  # not a failure: the caller reads the row afresh and enters again
                span.set_attribute(tracing.ENTRY_RESULT, "stale_row")
                raise

    async def _enter_step(
        self,
        task: TaskRecord,
        workflow: Workflow,
        target: Step,
        path: EntryPath,
        trigger: str,
        out: Outbox,
        cached: bool,
        operation_id: str,
        tracer: Tracer | None,
    ) -> bool:
        """`enter_step`'s work, inside its span when `tracer` is given."""
        if self._asks_preflight:  # the default host's preflight accepts everything: not even a coroutine
            await self._preflight(task, target, cached, tracer)
        request, on_exit = plan_entry(
            self.services,
            self._plans,
            task,
            workflow,
            target,
            path,
            cached=cached,
            trigger=trigger,
            operation_id=operation_id,
        )
        started = tracing.now() if tracer is not None else 0
        entered = await self._commit(request)
        admitted = (started, tracing.now()) if tracer is not None else None
        if tracer is not None:
            span = trace.get_current_span()
            span.set_attribute(tracing.ENTRY_RESULT, entered.outcome)
            if entered.key is not None:
                span.set_attribute(tracing.ENTRY_SEQ, entered.key.entry_seq)
        if entered.outcome == "stale":
            raise StaleRow(task.id)
        if entered.outcome == "abandoned":
            out.diagnostic(
                "info",
                "transition_abandoned",
                task_id=task.id,
                expected_step=task.step_id,
                target_step=target.id,
            )
            return False
        out.emit(  # the runtime's own typed values: unvalidated
            trusted.transition(
                task_id=task.id,
                workflow_id=workflow.id,
                from_step=task.step_id,
                to_step=target.id,
                trigger=trigger,
            )
        )
        if entered.left:  # the runs of the entry it left: cancelled, or superseded when claimed
            publish_run_changes(out, entered.left)
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
        if entered.outcome == "queued":
            out.emit(TaskQueued(task_id=task.id, step_id=target.id))
        else:
            mark = len(out.events)
            self._publish_entered(request, entered, out)
            if tracer is not None and admitted is not None and isinstance(entered.first, Admitted):
                tracing.action_spans(tracer, out.events[mark:], *admitted, _entry_ids(entered.key, path))
            if not isinstance(entered.first, Admitted):
                await self._dispatch_entry(
                    request.entered, workflow, target, entered.key, path, out, entered.first, admitted
                )
        admitted_to = target if entered.outcome == "admitted" else None
        await promotion.promote_after_move(self.services, task, workflow, admitted_to)
        return True

    async def _preflight(self, task: TaskRecord, target: Step, cached: bool, tracer: Tracer | None) -> None:
        """Ask the host whether the task may leave its step for `target` (not called for a host that accepts
        every transition), in the span `onceflow.host preflight_transition` when traced. Raises
        TransitionRefusedError (field step_id; retryable when a host connection refused saying so: its
        message names the host and its reason), StaleRow for a cached row, or, over `onceflow serve`'s host
        role, HostUnavailableError / HostTimeoutError (retryable) when no host answered."""
        try:
            call = self.services.host.preflight_transition(
                task_id=task.id, from_step=task.step_id, to_step=target.id
            )
            if tracer is None:
                await call
            else:
                attributes = tracing.ids(task_id=task.id, step_id=task.step_id, to_step_id=target.id)
                with tracing.span(tracer, "onceflow.host preflight_transition", attributes):
                    await call
        except (HostUnavailableError, HostTimeoutError):  # no host answered (host role): retry later
            raise
        except Exception as exc:
            if cached:  # perhaps refused for a stale source step: ask again with the committed row
                raise StaleRow(task.id) from exc
            reason = exc.message if isinstance(exc, HostRefusedError) else repr(exc)
            refused = TransitionRefusedError(
                f"the host refused {task.step_id!r} -> {target.id!r}: {reason}", field="step_id"
            )
            refused.retryable = isinstance(exc, HostRefusedError) and exc.retryable
            raise refused from exc

    async def _commit(self, request: EntryRequest) -> Entered:
        """Run the admission (grouped with the batch's other common entries of its step when the writer can),
        and keep the task-row cache in step: the admitted row is cached, anything else forgets it."""
        store, rows, task = self.services.store, self.services.task_rows, request.task
        try:
            key = group_key(request)
            if key is None:
                entered = await store.transact(admit, request, store)
            else:
                entered = await store.transact_grouped(
                    Grouped(key, request, admit_together), admit, request, store
                )
        except Exception as exc:  # nothing landed: neither the step change nor its record (AC-B7)
            rows.forget(task.id)
            log.error(
                "step_admission_failed",
                task_id=task.id,
                step_id=request.target.id,
                entry_path=request.path,
                cause=repr(exc),
            )
            if isinstance(exc, StorageError):  # the host learns the fault's kind and whether to retry
                raise
            raise TransitionFailedError(
                f"moving task {task.id!r} to {request.target.id!r} failed and nothing was committed: {exc!r}",
                field="step_id",
            ) from exc
        if entered.outcome == "admitted":
            rows.put(request.entered)
        else:
            rows.forget(task.id)
        return entered

    def _publish_entered(self, request: EntryRequest, entered: Entered, out: Outbox) -> None:
        """`step_entered`, then what a common entry committed whole in the admission."""
        key = entered.key
        metrics.count_entry(request.workflow_id, request.target.id, request.path)
        out.emit(
            trusted.step_entered(
                task_id=request.task.id,
                step_id=request.target.id,
                entry_seq=key.entry_seq if key else None,
                entry_path=request.path,
            )
        )
        if isinstance(entered.first, Admitted):  # only a common plan admits so
            assert request.common is not None
            publish_common(out, request.task.id, request.common, entered.first.done)

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
        admission). Never raises an error (a cancellation passes through, leaving the entry open for the
        next recovery scan): the transition stands whatever its actions do (AC-C4), and an entry left open
        is resumed by the next start's recovery scan. A failure (a storage fault included) is logged and
        reported as an `on_enter_dispatch_failed` diagnostic, never silent. Traced, it is the span
        `onceflow.entry` (a promoted entry's dispatch: `enter_step` dispatches inside its own)."""
        tracer = self.services.tracing.tracer()
        if tracer is None:
            return await self._dispatch_entry(task, workflow, step, key, path, out, first, None)
        attributes = tracing.ids(
            task_id=task.id,
            workflow_id=workflow.id,
            step_id=step.id,
            entry_path=path,
            entry_seq=key.entry_seq if key else None,
        )
        with tracing.span(tracer, "onceflow.entry", attributes):
            await self._dispatch_entry(task, workflow, step, key, path, out, first, None)

    async def _dispatch_entry(
        self,
        task: TaskRecord,
        workflow: Workflow,
        step: Step,
        key: EntryKey | None,
        path: EntryPath,
        out: Outbox,
        first: SegmentResult | None,
        admitted: tuple[int, int] | None,
    ) -> None:
        """`dispatch_entry`'s work; `admitted`: when the admission that ran `first` started and ended (Unix
        ns), traced."""
        try:
            await OnEnterDispatch(self.services, task, workflow, step, key, path, out).run(first, admitted)
        except Exception as exc:
            out.diagnostic(  # logged at ERROR too
                "error",
                "on_enter_dispatch_failed",
                task_id=task.id,
                step_id=step.id,
                entry_seq=key.entry_seq if key else None,
                cause=repr(exc),
            )

    async def promote(self, workflow: Workflow, step: Step) -> int:
        """Admit candidates into `step` while it has room (`promotion.promote`); how many were promoted."""
        return await promotion.promote(self.services, workflow, step)


def _entry_ids(key: EntryKey | None, path: EntryPath) -> tracing.Attributes:
    """The attributes an entry's action spans share."""
    return tracing.ids(entry_seq=key.entry_seq if key else None, entry_path=path)
