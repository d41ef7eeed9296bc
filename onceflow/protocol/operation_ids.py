"""Operation-id producers: the exact idempotency-key shape of every trigger that carries one.

on_turn_start and on_turn_complete carry none (operation-ledger-lifetime.md, "Operation id shape"). Pure.
"""

from __future__ import annotations

import hashlib
import json

from onceflow.protocol import commands as c


def children_rows_digest(children: list[c.ChildRow]) -> str:
    """SHA-256 hex over the canonical JSON of the child rows, sorted so delivery order does not matter."""
    rows = sorted([child.task_id, child.state] for child in children)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def operation_id(command: c.EventTrigger) -> str:
    """The operation id of an event-trigger command."""
    match command:
        case c.TaskComment():
            return f"task_comment:{command.comment_id}"
        case c.BlockersResolved():
            return f"blockers_resolved:{command.task_id}"
        case c.ChildrenCompleted():
            return f"on_children_completed:{command.task_id}:{children_rows_digest(command.children)}"
        case c.ApprovalResolved():
            return f"approval_resolved:{command.approval_id}"
        case c.AgentError():
            if command.run_id:
                return f"agent_error:{command.run_id}"
            return f"agent_error:{command.session_id}:{command.execution_id}"
        case c.Heartbeat():
            return f"heartbeat:{command.task_id}:{command.step_id}:{command.unix}"
        case c.BudgetAlert():
            return (
                f"budget:{command.workspace_id}:{command.scope}:{command.scope_id}:{command.pct}"
                f":{command.period_start}"
            )
    raise TypeError(f"not an event trigger: {type(command).__name__}")


def decision_operation_id(task_id: str, step_id: str, decision_id: str) -> str:
    return f"decision:{task_id}:{step_id}:{decision_id}"


def switch_workflow_operation_id(operation_id: str, phase: str) -> str:
    """`<op>:switch_workflow:on_exit` or `<op>:switch_workflow:on_enter`."""
    return f"{operation_id}:switch_workflow:{phase}"
