"""What a trigger delivery is and what its evaluation did, and running a non-transition action of a
trigger other than on_enter. Trio thread. Sources: kandev-engine-notes.md "Trigger handling";
evaluate-only-operation-marking.md; operation-ledger-lifetime.md "Design".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from onceflow.actors.engine.publish import publish_effect
from onceflow.actors.engine.session import request_session_action
from onceflow.actors.kernel import causation
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.observability import tracing
from onceflow.protocol.errors import ActionError, ActionNotWiredError
from onceflow.protocol.workflow import HOST_ACTION_TYPES, TRANSITION_TYPES, ActionDecl, Step, Trigger
from onceflow.store.entries.executors import ActionContext, Executor
from onceflow.store.records import TaskRecord
from onceflow.store.runs.keys import OperationScope


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


def check_executors(
    executors: Mapping[str, Executor], step: Step, trigger: Trigger, actions: Sequence[ActionDecl]
) -> None:
    """Every non-transition, non-host action of an operation-bearing trigger must have an executor before
    any runs (operation-ledger-lifetime.md, Design: an unwired action would leave its operation unmarkable).

    Raises:
        ActionNotWiredError: one has none (field `events.<trigger>[<position>].type`); nothing ran.
    """
    for position, action in enumerate(actions):
        if action.type in TRANSITION_TYPES or action.type in HOST_ACTION_TYPES:
            continue
        if action.type not in executors:
            raise ActionNotWiredError(
                f"step {step.id!r} declares {action.type!r} for {trigger} but no executor is registered",
                field=f"events.{trigger}[{position}].type",
            )


async def run_trigger_action(
    services: Services,
    task: TaskRecord,
    step: Step,
    inp: HandleInput,
    position: int,
    action: ActionDecl,
    out: Outbox,
) -> None:
    """Run one non-transition action of a non-on_enter trigger: a host action through the host, an engine
    action through its executor in one store transaction (its runs keyed by the delivery's operation id,
    comment runs never coalesced), and publish what it did. Traced, an engine action is the span
    `onceflow.action <type>` (a host action's call is `request_session_action`'s span).

    Raises:
        ActionNotWiredError: the action has no executor (field `events.<trigger>[<position>].type`).
        ActionError: the executor's effect failed (field `events.<trigger>[<position>]`): abort on first
            error (on-enter-action-dispatch.md AC-C5); the operation id stays unmarked.
    """
    if action.type in HOST_ACTION_TYPES:
        await request_session_action(
            services, task, action, out, step_id=step.id, trigger=str(inp.trigger), position=position
        )
        return
    executor = services.executors.get(action.type)
    if executor is None:
        raise ActionNotWiredError(
            f"no executor is registered for {action.type!r}", field=f"events.{inp.trigger}[{position}].type"
        )
    tracer = services.tracing.tracer()
    if tracer is None:
        await _run_engine_action(services, executor, task, step, inp, position, action, out)
        return
    attributes = tracing.ids(
        task_id=task.id, step_id=step.id, trigger=str(inp.trigger), operation_id=inp.operation_id
    )
    attributes[tracing.ACTION_TYPE] = action.type
    attributes[tracing.ACTION_POSITION] = position
    with tracing.span(tracer, f"onceflow.action {action.type}", attributes) as span:
        state = await _run_engine_action(services, executor, task, step, inp, position, action, out)
        span.set_attribute(tracing.ACTION_OUTCOME, state)


async def _run_engine_action(
    services: Services,
    executor: Executor,
    task: TaskRecord,
    step: Step,
    inp: HandleInput,
    position: int,
    action: ActionDecl,
    out: Outbox,
) -> str:
    """`run_trigger_action`'s engine action: its transaction, its events; the effect's state. Raises
    ActionError as `run_trigger_action` says."""
    op = inp.operation_id
    context = ActionContext(
        task=task,
        step_id=step.id,
        step_name=step.name,
        trigger=str(inp.trigger),
        keys=OperationScope(op, step.id, task.id) if op else None,
        exclude_from_coalescing=inp.trigger == Trigger.on_comment,
        now=services.now(),
        cause=causation.current(),
    )
    effect = await services.store.transact(executor, context, action)
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
        raise ActionError(f"{action.type} failed: {effect.detail}", field=f"events.{inp.trigger}[{position}]")
    return effect.state
