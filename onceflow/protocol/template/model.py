"""The workflow template model: steps, their events, the workflow and its template checks. Pure.

Source: kandev-engine-notes.md, "Template format". A `Workflow` is typed and immutable; validating one checks
every field (strict: scalars are not coerced, an unknown key is an error) and then the template checks: one
start step, unique step ids and positions, existing `move_to_step` targets and `pull_from_step_id` feeders
without a cycle. onceflow adds two optional step keys, `wip_limit` and `pull_from_step_id`, so WIP promotion
(entry path E3, kandev-engine-notes.md, "WIP limits") can be declared. The actions a step declares are
`workflow_actions.py`'s; loading a template from text is `workflow.py`'s.
"""

from collections.abc import Mapping
from functools import cached_property
from types import MappingProxyType
from typing import Annotated, Any, Literal, Self, cast

from pydantic import Field, Strict, ValidationInfo, WithJsonSchema, field_validator, model_validator

from onceflow.protocol.errors import NotFoundError
from onceflow.protocol.limits import (
    ID_PATTERN,
    INT64_MAX,
    INT64_MIN,
    MAX_ID_CHARS,
    MAX_TEMPLATE_ACTIONS,
    MAX_TEMPLATE_STEPS,
)
from onceflow.protocol.template.actions import ALLOWED_ACTIONS, ActionDecl, MoveConfig, TemplateModel, Trigger
from onceflow.protocol.template.problems import Loc, Located

ALLOWED_CONTEXT_KEY = "allowed_actions"
"""The validation context key holding the per-trigger allow-list `StepEvents` checks against."""

_StepId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
_Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
_ActionList = Annotated[tuple[ActionDecl, ...], Strict(False), Field(max_length=MAX_TEMPLATE_ACTIONS)]


class StepEvents(TemplateModel):
    """A step's `events`: for each Trigger, the actions declared for it, in order.

    Error: an action type not in the allow-list for its trigger (ALLOWED_ACTIONS, or the `allowed_actions`
    the loader was given).
    """

    on_enter: _ActionList = ()
    """When a task enters the step (every entry path): session actions and engine-owned actions."""
    on_turn_start: _ActionList = ()
    """When the task's agent starts a turn: transitions."""
    on_turn_complete: _ActionList = ()
    """When the task's agent finishes a turn (and when a decision is recorded, for guarded moves)."""
    on_exit: _ActionList = ()
    """When the task leaves the step: disable_plan_mode."""
    on_comment: _ActionList = ()
    """`task_comment`."""
    on_blocker_resolved: _ActionList = ()
    """`blockers_resolved`."""
    on_children_completed: _ActionList = ()
    """`children_completed`, once every child is terminal."""
    on_approval_resolved: _ActionList = ()
    """`approval_resolved`."""
    on_heartbeat: _ActionList = ()
    """`heartbeat`."""
    on_budget_alert: _ActionList = ()
    """`budget_alert`."""
    on_agent_error: _ActionList = ()
    """`agent_error`."""

    def actions(self, trigger: Trigger) -> tuple[ActionDecl, ...]:
        """The actions declared for `trigger`, in declared order (empty when none)."""
        return cast(tuple[ActionDecl, ...], getattr(self, trigger.value))

    @model_validator(mode="after")
    def _allowed_for_trigger(self, info: ValidationInfo) -> Self:
        allowed = (info.context or {}).get(ALLOWED_CONTEXT_KEY, ALLOWED_ACTIONS)
        for trigger in Trigger:
            for index, action in enumerate(self.actions(trigger)):
                if action.type not in allowed.get(trigger, frozenset()):
                    raise Located(
                        (trigger.value, index, "type"),
                        f"action {action.type!r} is not allowed for trigger {trigger.value}",
                    )
        return self


class Step(TemplateModel):
    """One workflow step.

    An empty or null stage_type means "custom". onceflow extensions: `wip_limit` (<= 0 is unlimited) and
    `pull_from_step_id` (the feeder step; checked by Workflow: another step of the same workflow, no cycles).
    """

    id: _StepId
    """The step's id, unique in the workflow (commands and move_to_step name it)."""
    name: str
    """Its display name (a last step named done/complete/completed/approved is the terminal step)."""
    position: _Int64
    """Its place in the board, unique; move_to_next and move_to_previous follow position order."""
    color: str = ""
    """A display color (accepted for Kandev compatibility; onceflow ignores it)."""
    prompt: str = ""
    """A prompt for the step's agent (accepted for Kandev compatibility; onceflow ignores it)."""
    stage_type: Annotated[
        Literal["work", "review", "approval", "custom"],
        WithJsonSchema({"enum": ["work", "review", "approval", "custom", "", None]}, mode="validation"),
    ] = "custom"
    """What kind of stage it is; empty or null mean custom."""
    is_start_step: bool = False
    """The step new tasks start at; exactly one step has it."""
    show_in_command_panel: bool = False
    """A UI flag (accepted for Kandev compatibility; onceflow ignores it)."""
    allow_manual_move: bool = False
    """A UI flag (accepted for Kandev compatibility; onceflow ignores it: move_task is always allowed)."""
    auto_archive_after_hours: _Int64 | None = None
    """Accepted for Kandev compatibility; onceflow ignores it."""
    auto_advance_requires_signal: bool = False
    """Accepted for Kandev compatibility; onceflow ignores it."""
    cancel_triggers_turn_complete: bool = False
    """Accepted for Kandev compatibility; onceflow ignores it."""
    events: StepEvents = StepEvents()
    """The actions declared per trigger."""
    agent_profile_id: str | None = None
    """The step's agent profile (accepted for Kandev compatibility; onceflow ignores it)."""
    profile_session_start_policy: str | None = None
    """Accepted for Kandev compatibility; onceflow ignores it."""
    profile_session_end_policy: str | None = None
    """Accepted for Kandev compatibility; onceflow ignores it."""
    session_target: str | None = None
    """Accepted for Kandev compatibility; onceflow ignores it."""
    complete_task_on_enter: bool = False
    """Accepted for Kandev compatibility; onceflow ignores it."""
    wip_limit: _Int64 = 0
    """At most this many admitted tasks at the step (<= 0: unlimited); a task moved into a full step waits
    there, queued, and its on_enter runs when it is admitted."""
    pull_from_step_id: str | None = None
    """The feeder step: when a slot frees here, a task waiting in the feeder is pulled in (another step of
    this workflow; the links may not form a cycle)."""

    @field_validator("stage_type", mode="before")
    @classmethod
    def _empty_is_custom(cls, value: Any) -> Any:
        return "custom" if value in ("", None) else value


class Workflow(TemplateModel):
    """A workflow template: `{id, name, description, hidden, steps}`; `steps` keeps the declared order.

    Template checks (errors located at the offending step and key): step ids unique; positions unique;
    exactly one start step; every move_to_step target exists; every pull_from_step_id names another step of
    this workflow and the pull_from links have no cycle.
    """

    id: _StepId
    """The workflow's id (commands name it as workflow_id)."""
    name: str
    """Its display name."""
    description: str = ""
    """What it is for."""
    hidden: bool = False
    """A UI flag (accepted for Kandev compatibility; onceflow ignores it)."""
    steps: Annotated[tuple[Step, ...], Strict(False), Field(max_length=MAX_TEMPLATE_STEPS)]
    """The steps, in any order (position orders them)."""

    @model_validator(mode="after")
    def _template_checks(self) -> Self:
        first_index: dict[str, int] = {}
        position_index: dict[int, int] = {}
        start_index: int | None = None
        for index, step in enumerate(self.steps):
            if step.id in first_index:
                raise Located(
                    ("steps", index, "id"),
                    f"duplicate step id {step.id!r} (also steps[{first_index[step.id]}])",
                )
            first_index[step.id] = index
            if step.position in position_index:
                other = self.steps[position_index[step.position]].id
                raise Located(
                    ("steps", index, "position"), f"position {step.position} is taken by step {other!r}"
                )
            position_index[step.position] = index
            if step.is_start_step and start_index is not None:
                other = self.steps[start_index].id
                raise Located(("steps", index, "is_start_step"), f"step {other!r} is already the start step")
            if step.is_start_step:
                start_index = index
        if start_index is None:
            raise Located(("steps",), "no start step: exactly one step needs is_start_step: true")
        on_cycle = _feeder_cycles(self.steps, first_index)
        for index, step in enumerate(self.steps):
            _check_move_targets(index, step, first_index)
            _check_pull_from(index, step, self.steps, first_index, on_cycle)
        return self

    # Indexes over the (frozen) steps, built on first use: lookups are O(1) however many steps there are.

    @cached_property
    def _by_id(self) -> Mapping[str, Step]:
        return MappingProxyType({step.id: step for step in self.steps})

    @cached_property
    def _order(self) -> Mapping[str, int]:
        return MappingProxyType({step.id: index for index, step in enumerate(self.ordered_steps)})

    @cached_property
    def _fed_by(self) -> Mapping[str, tuple[Step, ...]]:
        fed: dict[str, list[Step]] = {}
        for step in self.ordered_steps:
            if step.pull_from_step_id is not None:
                fed.setdefault(step.pull_from_step_id, []).append(step)
        return MappingProxyType({feeder: tuple(steps) for feeder, steps in fed.items()})

    def step(self, step_id: str) -> Step:
        """The step with id `step_id`; raises KeyError when there is none."""
        return self._by_id[step_id]

    def has_step(self, step_id: str) -> bool:
        """Whether a step with id `step_id` exists."""
        return step_id in self._by_id

    def fed_by(self, step_id: str) -> tuple[Step, ...]:
        """The steps whose `pull_from_step_id` is `step_id`, in position order (empty for none)."""
        return self._fed_by.get(step_id, ())

    @property
    def start_step(self) -> Step:
        """The one step with is_start_step."""
        return next(step for step in self.steps if step.is_start_step)

    @cached_property
    def ordered_steps(self) -> tuple[Step, ...]:
        """The steps sorted by position."""
        return tuple(sorted(self.steps, key=lambda step: step.position))

    def next_step(self, step_id: str) -> Step | None:
        """The step after `step_id` in position order (None at the end); KeyError for an unknown id."""
        index = self._order[step_id]
        ordered = self.ordered_steps
        return ordered[index + 1] if index + 1 < len(ordered) else None

    def previous_step(self, step_id: str) -> Step | None:
        """The step before `step_id` in position order (None at the start); KeyError for an unknown id."""
        index = self._order[step_id]
        return self.ordered_steps[index - 1] if index > 0 else None


def _check_move_targets(index: int, step: Step, step_ids: Mapping[str, int]) -> None:
    for trigger in Trigger:
        for position, action in enumerate(step.events.actions(trigger)):
            target = action.config.step_id if isinstance(action.config, MoveConfig) else None
            if target is not None and target not in step_ids:
                raise Located(
                    ("steps", index, "events", trigger.value, position, "config", "step_id"),
                    f"move_to_step target {target!r} is not a step of this workflow",
                )


def _feeder_cycles(steps: tuple[Step, ...], step_ids: Mapping[str, int]) -> frozenset[str]:
    """The ids of the steps lying on a cycle of pull_from_step_id links, found in linear time.

    Each step has at most one feeder, so the links form a functional graph: walk from each unvisited step
    until reaching a step already seen; if it was seen on this very walk, the walk closed a cycle.
    """
    done: set[str] = set()
    on_cycle: set[str] = set()
    for start in steps:
        walk: dict[str, int] = {}  # step id -> its place on this walk
        current: str | None = start.id
        while current is not None and current not in done and current not in walk:
            walk[current] = len(walk)
            feeder = steps[step_ids[current]].pull_from_step_id
            current = feeder if feeder in step_ids else None  # an unknown feeder is reported per step
        if current is not None and current in walk:
            on_cycle.update(list(walk)[walk[current] :])
        done.update(walk)
    return frozenset(on_cycle)


def _check_pull_from(
    index: int,
    step: Step,
    steps: tuple[Step, ...],
    step_ids: Mapping[str, int],
    on_cycle: frozenset[str],
) -> None:
    feeder = step.pull_from_step_id
    loc: Loc = ("steps", index, "pull_from_step_id")
    if feeder is None:
        return
    if feeder == step.id:
        raise Located(loc, "a step cannot pull from itself")
    if feeder not in step_ids:
        raise Located(loc, f"pull_from_step_id {feeder!r} is not a step of this workflow")
    if step.id in on_cycle:
        chain = [step.id]
        while feeder != step.id and feeder is not None:
            chain.append(feeder)
            feeder = steps[step_ids[feeder]].pull_from_step_id
        raise Located(loc, "pull_from_step_id links form a cycle: " + " -> ".join([*chain, step.id]))


def find_workflow(workflows: Mapping[str, Workflow], workflow_id: str) -> Workflow:
    """The registered workflow `workflow_id`. Raises NotFoundError (field workflow_id) when there is none."""
    try:
        return workflows[workflow_id]
    except KeyError:
        raise NotFoundError(f"workflow {workflow_id!r} is not registered", field="workflow_id") from None


def find_step(workflow: Workflow, step_id: str) -> Step:
    """The workflow's step. Raises NotFoundError (field step_id) when it has no such step."""
    if not workflow.has_step(step_id):
        raise NotFoundError(f"workflow {workflow.id!r} has no step {step_id!r}", field="step_id")
    return workflow.step(step_id)
