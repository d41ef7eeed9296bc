"""Asking the host to perform one session-scoped action, with its outcome as events and diagnostics."""

from __future__ import annotations

from typing import Any

from onceflow.actors.host import SessionActionRequest
from onceflow.actors.outbox import Outbox
from onceflow.actors.services import Services
from onceflow.protocol.events import EntryPath, SessionAction
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.records import TaskRecord


async def request_session_action(
    services: Services,
    task: TaskRecord,
    step_id: str,
    action: ActionDecl,
    path: EntryPath | None,
    out: Outbox,
) -> bool:
    """Send `action` to the host for the task's live session. Returns True when the host accepted it.

    With no live session the action is skipped (info diagnostic) and nothing durable is recorded
    (on-enter-action-dispatch.md AC-A10, AC-B8); a host that raises gets an ERROR diagnostic.
    """
    fields: dict[str, Any] = {"task_id": task.id, "step_id": step_id, "action": action.type}
    if not task.session_id:
        out.diagnostic("info", "session_action_skipped_no_session", **fields)
        return False
    config = action.config.model_dump(mode="json", exclude_none=True)
    request = SessionActionRequest(task.id, task.session_id, step_id, action.type, config, path)
    try:
        await services.host.perform_session_action(request)
    except Exception as exc:
        out.diagnostic("error", "session_action_failed", cause=repr(exc), **fields)
        return False
    out.emit(
        SessionAction(
            task_id=task.id,
            session_id=task.session_id,
            step_id=step_id,
            action=action.type,
            config=config,
            entry_path=path,
        )
    )
    return True
