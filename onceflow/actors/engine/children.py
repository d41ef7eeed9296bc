"""When a set of children counts as completed: every child terminal (Kandev's orchestrator rule).

A child is terminal when its state is COMPLETED, FAILED or CANCELLED (case-insensitive), or when it sits in
the terminal step of its workflow: the last step by position whose name is done, complete, completed or
approved (case-insensitive). Where a child sits comes from its row (`workflow_id` + `step_id`), else from
its own task row when it is one of this runtime's tasks; a child whose place is unknown and whose state is
not terminal is not terminal. Pure: the rows of tasks of this runtime come from `store.tasks.places`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from onceflow.protocol import commands as c
from onceflow.protocol.errors import NotFoundError
from onceflow.protocol.results import OpenChild
from onceflow.protocol.template.lint import TERMINAL_STEP_NAMES, terminal_step
from onceflow.protocol.workflow import Workflow

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
__all__ = ["TERMINAL_STEP_NAMES", "terminal_step"]

Place = tuple[str, str]
"""(workflow_id, step_id) of a child."""


def state_is_terminal(state: str) -> bool:
    return state.strip().upper() in TERMINAL_STATES


def check_places(children: Sequence[c.ChildRow], workflows: Mapping[str, Workflow]) -> None:
    """Every place a row names must exist. Raises NotFoundError naming `children.<i>.workflow_id` or
    `children.<i>.step_id`."""
    for index, row in enumerate(children):
        if row.workflow_id is None or row.step_id is None:
            continue
        workflow = workflows.get(row.workflow_id)
        if workflow is None:
            raise NotFoundError(
                f"child {row.task_id!r}: workflow {row.workflow_id!r} is not registered",
                field=f"children.{index}.workflow_id",
            )
        if not workflow.has_step(row.step_id):
            raise NotFoundError(
                f"child {row.task_id!r}: workflow {row.workflow_id!r} has no step {row.step_id!r}",
                field=f"children.{index}.step_id",
            )


def unplaced(children: Iterable[c.ChildRow]) -> list[str]:
    """Children whose state is not terminal and whose row names no place: their task rows are needed."""
    return [row.task_id for row in children if not state_is_terminal(row.state) and row.step_id is None]


def not_terminal(
    children: Sequence[c.ChildRow], stored: Mapping[str, Place], workflows: Mapping[str, Workflow]
) -> list[OpenChild]:
    """The children that are not terminal, as {task_id, state, workflow_id, step_id} (place None when
    unknown), in row order; empty when the set is complete. Rows must have passed `check_places`."""
    open_rows: list[OpenChild] = []
    for row in children:
        if state_is_terminal(row.state):
            continue
        place = (row.workflow_id, row.step_id) if row.workflow_id and row.step_id else stored.get(row.task_id)
        workflow = workflows.get(place[0]) if place else None
        last = terminal_step(workflow) if workflow is not None else None
        if place is not None and last is not None and last.id == place[1]:
            continue
        workflow_id, step_id = place if place else (None, None)
        open_rows.append(
            OpenChild(task_id=row.task_id, state=row.state, workflow_id=workflow_id, step_id=step_id)
        )
    return open_rows
