"""Asking the host to perform one session-scoped action, with its outcome as events and diagnostics. Trio
thread."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.observability import tracing
from onceflow.protocol.events import EntryPath, SessionAction
from onceflow.protocol.host import SessionActionRequest
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.records import TaskRecord

SessionOutcome = Literal["performed", "no_session", "failed"]


async def request_session_action(
    services: Services,
    task: TaskRecord,
    action: ActionDecl,
    out: Outbox,
    *,
    step_id: str,
    trigger: str,
    position: int,
    entry_seq: int | None = None,
    path: EntryPath | None = None,
) -> SessionOutcome:
    """Send `action` (declared at `position` of `step_id`'s `trigger` list) to the host for the task's
    live session; the request and the `session_action` event carry that identity.

    With no live session the action is skipped (info diagnostic, "no_session") and nothing durable is
    recorded (on-enter-action-dispatch.md AC-A10, AC-B8); a host that raises gets an ERROR diagnostic
    `session_action_failed` ("failed") whose fields carry the exception: `error_type` (its class name),
    `error` (its message) and `cause` (its repr). Never raises for a host failure. Traced, the host call is
    the span `onceflow.host perform_session_action` (a raise recorded on it).
    """
    fields: dict[str, Any] = {
        "task_id": task.id,
        "step_id": step_id,
        "action": action.type,
        "trigger": trigger,
        "position": position,
        "entry_seq": entry_seq,
        "admission_seq": task.admissions,
    }
    if not task.session_id:
        out.diagnostic("info", "session_action_skipped_no_session", **fields)
        return "no_session"
    config = action.config.model_dump(mode="json", exclude_none=True)
    request = SessionActionRequest(
        task_id=task.id,
        session_id=task.session_id,
        step_id=step_id,
        action=action.type,
        config=config,
        entry_path=path,
        trigger=trigger,
        position=position,
        entry_seq=entry_seq,
        admission_seq=task.admissions,
    )
    try:
        tracer = services.tracing.tracer()
        if tracer is None:
            await services.host.perform_session_action(request)
        else:
            attributes = tracing.ids(
                task_id=task.id, step_id=step_id, entry_seq=entry_seq, entry_path=path, trigger=trigger
            )
            attributes[tracing.ACTION_TYPE] = action.type
            attributes[tracing.ACTION_POSITION] = position
            with tracing.span(tracer, "onceflow.host perform_session_action", attributes):
                await services.host.perform_session_action(request)
    except Exception as exc:
        error = {"cause": repr(exc), "error_type": type(exc).__name__, "error": str(exc)}
        out.diagnostic("error", "session_action_failed", **error, **fields)
        return "failed"
    out.emit(SessionAction(**attrs.asdict(request)))  # the event shows exactly what the host was asked
    return "performed"
