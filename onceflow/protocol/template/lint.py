"""The template lint: what a template that loads may still get wrong, as warnings. Pure: any thread.

`lint(workflow)` reports, in step (position) order. Tasks enter a board in three intended ways, none of them a
finding: by a transition, in a step before the start step (where `create_task` puts them to wait, Kandev's
backlog, until start_task or move_task moves them on), and by hand into a step that allows manual moves
(`allow_manual_move`). So:
- `unreachable_step`: no transition of the template (move_to_step, move_to_next/previous, a feeder's pull)
  leads to the step from the start step, from a step before it, or from a step open to manual moves, and
  the step itself is none of those: only a command (move_task, update_task, switch_workflow) puts a task
  there.
- `no_way_out`: a step with no transition out and no step pulling from it that is not the terminal step
  (the last step named done/complete/completed/approved), before the start step, or open to manual moves:
  a task there stays until a command moves it.
- `start_on_enter`: the start step declares on_enter and no step comes before it, so tasks are created in
  it, and create_task does not run on_enter (creation is not an entry); it runs only when a task enters
  the step: a transition (E1), move_task (E2), a WIP promotion (E3), switch_workflow (E4),
  update_task/start_task with a step (E5).
- `quorum_role_unseated`: a quorum guard's role that nothing else of its step names (no
  queue_run_for_each_participant, no ensure_participant_seat of it): a misspelt role, or seats nobody
  asks for; only add_participant seats a role, and with no seat the guard never passes.
- `fan_out_without_participants`: queue_run_for_each_participant for a role the step neither checks
  (ensure_participant_seat) nor waits a quorum of: with no seats it queues nothing.
`changes(old, new, live_steps)` reports what a new version does to live tasks: `step_removed` and
`step_renamed` (a removed step whose position a new step id took), one per such step holding tasks.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from onceflow.protocol.template.actions import MoveConfig, Trigger
from onceflow.protocol.template.model import Step, Workflow

TERMINAL_STEP_NAMES = frozenset({"done", "complete", "completed", "approved"})
"""A step with one of these names (trimmed, case-insensitive) that comes last of them is the terminal step."""

START_ENTRY_PATHS = (
    "a transition (E1), move_task (E2), a WIP promotion (E3), switch_workflow (E4), or update_task/start_task"
    " with a step (E5)"
)
_TRIGGERS = tuple(Trigger)


class LintWarning(BaseModel):
    """One lint finding: `code` (see the module docstring), the `step_id` it is about (None: the template),
    and `message`, a sentence naming the step."""

    model_config = ConfigDict(frozen=True)

    code: str
    step_id: str | None
    message: str


def terminal_step(workflow: Workflow) -> Step | None:
    """The last step by position whose name (trimmed, case-insensitive) is a terminal name; None if none."""
    named = [s for s in workflow.ordered_steps if s.name.strip().lower() in TERMINAL_STEP_NAMES]
    return named[-1] if named else None


def _targets(workflow: Workflow, step: Step) -> list[str]:
    """The steps a transition of `step` may move to (any trigger)."""
    found: list[str] = []
    for actions in (step.events.actions(trigger) for trigger in _TRIGGERS):
        for action in actions:
            if action.type == "move_to_step" and isinstance(action.config, MoveConfig):
                found.append(action.config.step_id or "")
            elif action.type == "move_to_next":
                following = workflow.next_step(step.id)
                found += [following.id] if following else []
            elif action.type == "move_to_previous":
                preceding = workflow.previous_step(step.id)
                found += [preceding.id] if preceding else []
    return [target for target in found if workflow.has_step(target)]


def _seated(step: Step) -> set[str]:
    return {
        str(getattr(action.config, "role", ""))
        for action in step.events.on_enter
        if action.type == "ensure_participant_seat"
    }


def _quorum_roles(step: Step) -> list[str]:
    roles: list[str] = []
    for trigger in _TRIGGERS:
        for action in step.events.actions(trigger):
            guard = action.config.guard if isinstance(action.config, MoveConfig) else None
            if guard is not None and guard.role not in roles:
                roles.append(guard.role)
    return roles


def _waiting_steps(workflow: Workflow) -> set[str]:
    """Where tasks enter other than by a transition: the start step, the steps before it (tasks are created
    there to wait) and the steps open to manual moves."""
    start = workflow.start_step
    return {
        step.id
        for step in workflow.ordered_steps
        if step is start or step.position < start.position or step.allow_manual_move
    }


def _reached(workflow: Workflow, roots: set[str]) -> set[str]:
    reached, frontier = set(roots), list(roots)
    while frontier:
        step = workflow.step(frontier.pop())
        for target in _targets(workflow, step) + [fed.id for fed in workflow.fed_by(step.id)]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    return reached


def lint(workflow: Workflow) -> list[LintWarning]:
    """Every warning of `workflow`, in step (position) order, each step's in the module docstring's order."""
    start = workflow.start_step
    waiting = _waiting_steps(workflow)
    reached = _reached(workflow, waiting)
    terminal = terminal_step(workflow)
    found: list[LintWarning] = []
    for step in workflow.ordered_steps:
        if step.id not in reached:
            found.append(
                LintWarning(
                    code="unreachable_step",
                    step_id=step.id,
                    message=f"step {step.id!r} is unreachable: no transition leads to it from the start step"
                    f" {start.id!r}, a step before it or a step open to manual moves, and it allows no manual"
                    " move (only move_task, update_task or switch_workflow put a task there)",
                )
            )
        way_out = bool(_targets(workflow, step)) or bool(workflow.fed_by(step.id))
        waits = step.allow_manual_move or step.position < start.position
        if not way_out and step is not terminal and not waits:
            found.append(
                LintWarning(
                    code="no_way_out",
                    step_id=step.id,
                    message=f"step {step.id!r} has no transition out, allows no manual move and is not the"
                    " terminal step: a task there stays until a command moves it",
                )
            )
        if (
            step is start
            and step.events.on_enter
            and not any(s.position < start.position for s in workflow.steps)
        ):
            found.append(
                LintWarning(
                    code="start_on_enter",
                    step_id=step.id,
                    message=f"start step {step.id!r} declares on_enter and no step comes before it, so tasks"
                    " are created in it, and create_task does not run on_enter; it runs when a task enters"
                    f" the step by {START_ENTRY_PATHS}",
                )
            )
        checked = _seated(step)
        fanned = {
            str(getattr(action.config, "role", ""))
            for action in step.events.on_enter
            if action.type == "queue_run_for_each_participant"
        }
        quorum = _quorum_roles(step)
        for role in quorum:
            if role not in checked and role not in fanned:
                found.append(
                    LintWarning(
                        code="quorum_role_unseated",
                        step_id=step.id,
                        message=f"step {step.id!r} waits for a quorum of role {role!r}, which nothing else of"
                        " the step names (no queue_run_for_each_participant or ensure_participant_seat of"
                        " it): check the role's name; only add_participant seats it, and with no seat the"
                        " guard never passes",
                    )
                )
        for action in step.events.on_enter:
            role = str(getattr(action.config, "role", ""))
            if action.type != "queue_run_for_each_participant" or role in checked or role in quorum:
                continue
            found.append(
                LintWarning(
                    code="fan_out_without_participants",
                    step_id=step.id,
                    message=f"step {step.id!r} queues a run for each participant of role {role!r}, but the"
                    " step neither checks that role's seat nor waits for its quorum: it may queue nothing",
                )
            )
    return found


def changes(old: Workflow, new: Workflow, live_steps: Mapping[str, int]) -> list[LintWarning]:
    """What replacing `old` by `new` does to the tasks standing at its steps (`live_steps`: step id -> how
    many): one `step_removed` or `step_renamed` warning per step of `old` that `new` lacks and that holds
    tasks. Those tasks stay on their version until `migrate_tasks` moves them."""
    found: list[LintWarning] = []
    by_position = {step.position: step for step in new.steps}
    for step in old.ordered_steps:
        held = live_steps.get(step.id, 0)
        if new.has_step(step.id) or not held:
            continue
        successor = by_position.get(step.position)
        if successor is not None and not old.has_step(successor.id):
            found.append(
                LintWarning(
                    code="step_renamed",
                    step_id=step.id,
                    message=f"step {step.id!r} was renamed to {successor.id!r}? {held} live task(s) stand at"
                    f" {step.id!r} and stay on their version until migrate_tasks maps them",
                )
            )
        else:
            found.append(
                LintWarning(
                    code="step_removed",
                    step_id=step.id,
                    message=f"step {step.id!r} was removed; {held} live task(s) stand there and stay on their"
                    " version until migrate_tasks maps them",
                )
            )
    return found
