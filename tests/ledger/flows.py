"""Workflows and helpers shared by the ledger tests (operation-ledger-lifetime.md)."""

from __future__ import annotations

from typing import Any

from helpers import ok

from onceflow.actors.runtime.supervisor import Runtime

# `waiting` turns an agent error into a fixer run plus a move to triage, and a completed set of children
# into a move to review (transitions under event triggers come through the import path).
PARENT_FLOW = """
id: parent-flow
name: Parent flow
steps:
  - id: waiting
    name: Waiting
    position: 0
    is_start_step: true
    events:
      on_agent_error:
        - type: queue_run
          config: {target: "agent_profile_id:fixer", reason: agent_error}
        - type: move_to_step
          config: {step_id: triage}
      on_children_completed:
        - type: move_to_step
          config: {step_id: review}
      on_comment:
        - type: queue_run
          config: {target: workspace.ceo_agent, reason: task_comment}
  - id: triage
    name: Triage
    position: 1
    events:
      on_agent_error:
        - type: queue_run
          config: {target: "agent_profile_id:triager", reason: agent_error}
  - id: review
    name: Review
    position: 2
    events:
      on_enter:
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_started}
  - id: elsewhere
    name: Elsewhere
    position: 3
"""

CHILDREN = [{"task_id": "child-1", "state": "COMPLETED"}, {"task_id": "child-2", "state": "COMPLETED"}]


async def parent_task(rt: Runtime, task_id: str = "P1", **fields: Any) -> None:
    """Register PARENT_FLOW (import path) with one reviewer, and create a task at `waiting`."""
    await ok(
        rt, {"type": "register_workflow", "yaml": PARENT_FLOW, "source": "parent.yml", "import_path": True}
    )
    await ok(
        rt,
        {
            "type": "add_participant",
            "workflow_id": "parent-flow",
            "step_id": "review",
            "role": "reviewer",
            "agent_profile_id": "rev-a",
        },
    )
    await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "parent-flow", **fields})


def agent_error(task_id: str = "P1", run_id: str = "run-7") -> dict[str, Any]:
    return {"type": "agent_error", "task_id": task_id, "run_id": run_id}


def children_completed(task_id: str = "P1") -> dict[str, Any]:
    return {"type": "children_completed", "task_id": task_id, "children": CHILDREN}
