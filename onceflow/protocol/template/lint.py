"""The template lint: what a template that loads may still get wrong, as warnings. Pure: any thread.

`lint(workflow)` reports, in step order:
- `unreachable_step`: no transition of the template (move_to_step, move_to_next/previous, a feeder's pull)
  leads from the start step to it; only move_task / update_task / switch_workflow put a task there.
- `no_way_out`: a step with no transition out and no step pulling from it that is not the terminal step
  (the last step named done/complete/completed/approved): a task there stays until moved by a command.
- `start_on_enter`: the start step declares on_enter, which create_task does not run (creation is not an
  entry); it runs only when a task enters the step: a transition (E1), move_task (E2), a WIP promotion
  (E3), switch_workflow (E4), update_task/start_task with a step (E5).
- `quorum_role_unseated`: a quorum guard's role that no ensure_participant_seat of its step declares: only
  add_participant seats it, and with no seat the guard never passes.
- `fan_out_without_participants`: queue_run_for_each_participant for a role the step neither seats
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


def lint(workflow: Workflow) -> list[LintWarning]:
    """Every warning of `workflow`, in step (position) order, each step's in the module docstring's order."""
    start = workflow.start_step
    reached = {start.id}
    frontier = [start.id]
    while frontier:
        step = workflow.step(frontier.pop())
        nexts = _targets(workflow, step) + [fed.id for fed in workflow.fed_by(step.id)]
        for target in nexts:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    terminal = terminal_step(workflow)
    found: list[LintWarning] = []
    for step in workflow.ordered_steps:
        if step.id not in reached:
            found.append(
                LintWarning(
                    code="unreachable_step",
                    step_id=step.id,
                    message=f"step {step.id!r} is unreachable: no transition leads to it from the start step"
                    f" {start.id!r} (only move_task, update_task or switch_workflow put a task there)",
                )
            )
        way_out = bool(_targets(workflow, step)) or bool(workflow.fed_by(step.id))
        if not way_out and step is not terminal:
            found.append(
                LintWarning(
                    code="no_way_out",
                    step_id=step.id,
                    message=f"step {step.id!r} has no transition out and is not the terminal step: a task"
                    " there stays until a command moves it",
                )
            )
        if step.is_start_step and step.events.on_enter:
            found.append(
                LintWarning(
                    code="start_on_enter",
                    step_id=step.id,
                    message=f"start step {step.id!r} declares on_enter, which create_task does not run; it"
                    f" runs when a task enters the step by {START_ENTRY_PATHS}",
                )
            )
        seated = _seated(step)
        quorum = _quorum_roles(step)
        for role in quorum:
            if role not in seated:
                found.append(
                    LintWarning(
                        code="quorum_role_unseated",
                        step_id=step.id,
                        message=f"step {step.id!r} waits for a quorum of role {role!r}, which no"
                        " ensure_participant_seat of the step seats: only add_participant fills it, and"
                        " without a seat the guard never passes",
                    )
                )
        for action in step.events.on_enter:
            role = str(getattr(action.config, "role", ""))
            if action.type == "queue_run_for_each_participant" and role not in seated and role not in quorum:
                found.append(
                    LintWarning(
                        code="fan_out_without_participants",
                        step_id=step.id,
                        message=f"step {step.id!r} queues a run for each participant of role {role!r}, but"
                        " the step neither seats that role nor waits for its quorum: it may queue nothing",
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
