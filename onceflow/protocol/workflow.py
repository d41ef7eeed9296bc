"""Workflow templates: the typed, immutable model of a Kandev template and its strict loader. Pure (CPU-bound:
the runtime parses on a worker thread).

Source: kandev-engine-notes.md, "Template format" (the files in shared/kandev-workflows/). The loader accepts
that format strictly: an unknown key anywhere is an error, every action type must be allowed for its trigger,
and the template checks (one start step, unique step ids and positions, existing `move_to_step` targets)
hold. onceflow adds two optional step keys, `wip_limit` and `pull_from_step_id`, so WIP promotion (entry path
E3, kandev-engine-notes.md, "WIP limits") can be declared.

Every problem is reported as a `WorkflowError` naming the source, the step id (when inside a step) and the
dotted field path; the error is the first problem found and its `others` hold the rest of what the same pass
found (`onceflow validate` prints them all), except that a template over a count limit (steps, actions
per trigger) is refused with the first count problem alone, found as the text is read: before the rest of it
is read, and before any step is validated. An unknown key or action type names the closest known one.
Scalars are not coerced (`position: "1"` and `mode: 5` are errors).
"""

import json
import os
import re
import typing
from collections.abc import Callable, Hashable, Mapping, Sequence
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, Self, TypeVar, cast

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

try:
    from yaml._yaml import CParser as _CParser  # libyaml, when PyYAML was built with it
except ImportError:  # pragma: no cover - PyYAML's wheels ship libyaml
    _CParser = None  # type: ignore[assignment,misc]

from onceflow.protocol.errors import NotFoundError, shown
from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import (
    ID_PATTERN,
    INT64_MAX,
    INT64_MIN,
    MAX_ID_CHARS,
    MAX_PAYLOAD_BYTES,
    MAX_TEMPLATE_ACTIONS,
    MAX_TEMPLATE_BYTES,
    MAX_TEMPLATE_STEPS,
    MAX_YAML_DEPTH,
)
from onceflow.protocol.suggest import did_you_mean, keys_at

_Loc = tuple[int | str, ...]
T = TypeVar("T")


class WorkflowError(ValueError):
    """A template that does not load.

    `source` is the file path (as given) or label; `step_id` is the id of the step the problem is inside, or
    None; `field` is the dotted path from the document root, e.g. `steps[2].events.on_enter[1].config.mode`
    ('' for a problem with the document itself); `message` says what is wrong. `str(err)` reads
    "office.yml: step 'review': field 'events.on_enter[1].type': action 'move_to_next' is not allowed for
    trigger on_enter" -- inside a step, the field is shown relative to it. `others` are the further problems
    found in the same pass, in document order: every field error at once (a template-wide check, such as
    unique ids, runs only once the fields are valid).
    """

    def __init__(
        self,
        source: str,
        step_id: str | None,
        field: str,
        message: str,
        *,
        others: Sequence["WorkflowError"] = (),
    ) -> None:
        self.others = tuple(others)
        self.source = source
        self.step_id = step_id
        self.field = field
        self.message = message
        parts = [source]
        shown = field
        if step_id is not None:
            parts.append(f"step {step_id!r}")
            shown = re.sub(r"^steps\[\d+\]\.?", "", field)
        if shown:
            parts.append(f"field {shown!r}")
        parts.append(message)
        super().__init__(": ".join(parts))


class _Located(ValueError):
    """Raised inside validators: `loc` extends pydantic's location of the failing value."""

    def __init__(self, loc: _Loc, message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


class Trigger(StrEnum):
    """The triggers a step may declare actions for: when the task enters or leaves the step, when its agent
    starts or finishes a turn, and the seven event commands (task_comment, blockers_resolved, ...)."""

    on_enter = "on_enter"
    on_turn_start = "on_turn_start"
    on_turn_complete = "on_turn_complete"
    on_exit = "on_exit"
    on_comment = "on_comment"
    on_blocker_resolved = "on_blocker_resolved"
    on_children_completed = "on_children_completed"
    on_approval_resolved = "on_approval_resolved"
    on_heartbeat = "on_heartbeat"
    on_budget_alert = "on_budget_alert"
    on_agent_error = "on_agent_error"


TRANSITION_TYPES = frozenset({"move_to_next", "move_to_previous", "move_to_step"})
# Host-owned (performed through host callbacks) on entry paths E1-E3 and E5.
SESSION_ACTION_TYPES = frozenset(
    {"reset_agent_context", "configure_session", "enable_plan_mode", "set_session_mode", "auto_start_agent"}
)
ENGINE_ACTION_TYPES = frozenset(
    {
        "clear_decisions",
        "queue_run_for_each_participant",
        "queue_run",
        "run_code_review",
        "ensure_participant_seat",
    }
)
HOST_ACTION_TYPES = SESSION_ACTION_TYPES | {"disable_plan_mode"}
"""Action types the host performs (through `Host.perform_session_action`) on any trigger, never an
executor."""

_EVENT_TRIGGERS = (
    Trigger.on_comment,
    Trigger.on_blocker_resolved,
    Trigger.on_children_completed,
    Trigger.on_approval_resolved,
    Trigger.on_heartbeat,
    Trigger.on_budget_alert,
    Trigger.on_agent_error,
)
_EVENT_ACTIONS = frozenset({"queue_run", "clear_decisions", "queue_run_for_each_participant"})
_IMPORT_ONLY_ACTIONS = frozenset({"run_code_review", "configure_session"})
_ON_ENTER_ACTIONS = (SESSION_ACTION_TYPES | ENGINE_ACTION_TYPES) - _IMPORT_ONLY_ACTIONS

ALLOWED_ACTIONS: Mapping[Trigger, frozenset[str]] = MappingProxyType(
    {
        Trigger.on_enter: _ON_ENTER_ACTIONS,
        Trigger.on_turn_start: TRANSITION_TYPES,
        Trigger.on_turn_complete: TRANSITION_TYPES | {"disable_plan_mode"},
        Trigger.on_exit: frozenset({"disable_plan_mode"}),
        **{trigger: _EVENT_ACTIONS for trigger in _EVENT_TRIGGERS},
    }
)
"""Per-trigger allow-list for templates (kandev-engine-notes.md, Template format)."""

IMPORT_ALLOWED_ACTIONS: Mapping[Trigger, frozenset[str]] = MappingProxyType(
    {
        **ALLOWED_ACTIONS,
        Trigger.on_enter: _ON_ENTER_ACTIONS | _IMPORT_ONLY_ACTIONS,
        **{trigger: _EVENT_ACTIONS | TRANSITION_TYPES for trigger in _EVENT_TRIGGERS},
    }
)
"""ALLOWED_ACTIONS plus what only the import/sync path declares: the two on_enter types of
on-enter-action-dispatch.md ("the ten on_enter action types in scope"), and transitions under the event
triggers (the engine evaluates them on any trigger; operation-ledger-lifetime.md's children-completed
transition). Pass it as `allowed_actions`."""

_ALLOWED_CONTEXT_KEY = "allowed_actions"

_THRESHOLDS = frozenset({"all_approve", "all_decide", "majority_approve", "any_reject"})
_N_APPROVE = re.compile(r"n_approve:([0-9]+)")
THRESHOLD_PATTERN = r"^(all_approve|all_decide|majority_approve|any_reject|n_approve:0*[1-9][0-9]*)$"
"""The thresholds `_known_threshold` accepts, for the template's JSON Schema."""
QUEUE_TARGET_PATTERN = r"^(primary|workspace\.ceo_agent|(participant_role|agent_profile_id):.+)$"
_QUEUE_TARGET = re.compile(QUEUE_TARGET_PATTERN)


class _Model(BaseModel):
    # Field docstrings are the descriptions `onceflow schema --template` shows in an editor.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra=describe_fields)


def _json_payload(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A payload must encode as canonical JSON (string keys, no NaN) within MAX_PAYLOAD_BYTES: it is
    stored and hashed at every entry of its step, so its cost is paid at load time."""
    if value is None:
        return None
    try:
        encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise _Located((), f"must be JSON (string keys, no NaN or infinity): {exc}") from None
    if len(encoded) > MAX_PAYLOAD_BYTES:
        raise _Located((), f"encodes to {len(encoded)} bytes of JSON; the limit is {MAX_PAYLOAD_BYTES}")
    return value


_Payload = Annotated[dict[str, Any] | None, AfterValidator(_json_payload)]
RunPriority = Annotated[int, Field(ge=0, le=3)]
"""A run's priority class (0 human, 1 recovery, 2 event, 3 periodic)."""
_StepId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
_Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class QuorumGuard(_Model):
    """`{role, threshold}`: a transition waits until the role's seats satisfy the threshold.

    threshold is all_approve | all_decide | majority_approve | any_reject | n_approve:N (N a positive
    integer). Both keys are required.
    """

    role: str = Field(min_length=1)
    """The role whose seats are counted (reviewer, approver, ...)."""
    threshold: Annotated[str, Field(json_schema_extra={"pattern": THRESHOLD_PATTERN})]
    """all_approve, all_decide, majority_approve, any_reject, or n_approve:N (N a positive integer)."""

    @field_validator("threshold")
    @classmethod
    def _known_threshold(cls, value: str) -> str:
        count = _N_APPROVE.fullmatch(value)
        if value in _THRESHOLDS or (count is not None and int(count.group(1)) > 0):
            return value
        raise _Located(
            (),
            f"threshold {value!r} is not all_approve, all_decide, majority_approve, any_reject "
            "or n_approve:N with N a positive integer",
        )


class QuorumCondition(_Model):
    """The `if:` form of a guard: `{wait_for_quorum: {role, threshold}}`."""

    wait_for_quorum: QuorumGuard
    """The guard."""


class MoveConfig(_Model):
    """Config of move_to_next, move_to_previous and move_to_step.

    `step_id` is required (non-empty) for move_to_step and must be absent for the other two. A guard is given
    either as `wait_for_quorum` or as `if: {wait_for_quorum: ...}`, not both; `guard` returns it.
    """

    step_id: str | None = None
    """move_to_step: the target step (required, non-empty); move_to_next/move_to_previous: absent."""
    wait_for_quorum: QuorumGuard | None = None
    """A quorum guard: the move happens only once the role's seats satisfy the threshold."""
    if_: QuorumCondition | None = Field(default=None, validation_alias="if", serialization_alias="if")
    """The guard in its `if: {wait_for_quorum: ...}` form (not together with wait_for_quorum)."""
    requires_approval: bool = False
    """The move waits for an approval: the engine never takes it on a trigger or a decision."""

    @model_validator(mode="after")
    def _one_guard(self) -> Self:
        if self.wait_for_quorum is not None and self.if_ is not None:
            raise _Located(
                ("if",), "give the guard either as wait_for_quorum or as if.wait_for_quorum, not both"
            )
        return self

    @property
    def guard(self) -> QuorumGuard | None:
        """The transition's quorum guard, or None when it is unguarded."""
        return self.if_.wait_for_quorum if self.if_ is not None else self.wait_for_quorum


class QueueRunConfig(_Model):
    """Config of queue_run. target: primary | workspace.ceo_agent | participant_role:<role> |
    agent_profile_id:<id>; task_id: this | <id>; reason None means the trigger's name."""

    target: Annotated[str, Field(json_schema_extra={"pattern": QUEUE_TARGET_PATTERN})] = "primary"
    """Whom the run is for: primary (the task's primary agent), workspace.ceo_agent, participant_role:<role>
    (one run per seat) or agent_profile_id:<id>."""
    task_id: str = Field(default="this", min_length=1)
    """The task the run is for: `this` (the trigger's task) or a task id."""
    reason: str | None = None
    """The run's reason; absent: the trigger's name."""
    payload: _Payload = None
    """Data handed to the agent with the run (a mapping, at most 64 KiB as canonical JSON)."""
    priority: RunPriority | None = None
    """The runs' priority class: 0 human, 1 recovery, 2 event (absent: 2), 3 periodic; claims take the
    lowest class first."""

    @field_validator("target")
    @classmethod
    def _known_target(cls, value: str) -> str:
        if _QUEUE_TARGET.fullmatch(value) is None:
            raise _Located(
                (),
                f"target {value!r} is not primary, workspace.ceo_agent, participant_role:<role> "
                "or agent_profile_id:<id>",
            )
        return value


class QueueRunForEachParticipantConfig(_Model):
    """Config of queue_run_for_each_participant. An empty role loads, but the action then fails when it runs
    (an ERROR diagnostic `fan_out_role_missing`)."""

    role: str = ""
    """The role whose seats each get a run (an empty role is a run-time error)."""
    reason: str | None = None
    """The runs' reason; absent: the trigger's name."""
    payload: _Payload = None
    """Data handed to each agent with its run (a mapping, at most 64 KiB as canonical JSON)."""
    priority: RunPriority | None = None
    """The runs' priority class: 0 human, 1 recovery, 2 event (absent: 2), 3 periodic; claims take the
    lowest class first."""


class SetSessionModeConfig(_Model):
    """Config of set_session_mode: `mode` is a required non-empty string."""

    mode: str = Field(min_length=1)
    """The session mode to set (the host interprets it)."""


class EnsureParticipantSeatConfig(_Model):
    """Config of ensure_participant_seat: the (non-empty) role whose seat must exist."""

    role: str = Field(min_length=1)
    """The role whose seat must exist."""


class ConfigureSessionRule(_Model):
    """One rule of configure_session."""

    agent_name: str
    """The agent the rule is for."""
    operation: Literal["set", "keep", "restore_original"]
    """What to do with the agent's session configuration."""
    model: str | None = None
    """The model to set."""
    config_options: _Payload = None
    """Options to set (a mapping, at most 64 KiB as canonical JSON)."""


class ConfigureSessionConfig(_Model):
    """Config of configure_session (declarable only by a template registered with `import_path: true`)."""

    rules: Annotated[tuple[ConfigureSessionRule, ...], Strict(False), Field(max_length=MAX_TEMPLATE_ACTIONS)]
    """The rules, applied in order."""


class RunCodeReviewConfig(_Model):
    """Config of run_code_review (declarable only by a template registered with `import_path: true`)."""

    agent_profile_id: str | None = None
    """The reviewing agent profile, if not the host's default."""


class EmptyConfig(_Model):
    """Config of the action types that take none: plan mode on/off, auto_start_agent, reset_agent_context,
    clear_decisions. Any key is an error."""


ActionConfig = (
    MoveConfig
    | QueueRunConfig
    | QueueRunForEachParticipantConfig
    | SetSessionModeConfig
    | EnsureParticipantSeatConfig
    | ConfigureSessionConfig
    | RunCodeReviewConfig
    | EmptyConfig
)

CONFIG_MODELS: Mapping[str, type[_Model]] = MappingProxyType(
    {
        **{kind: MoveConfig for kind in TRANSITION_TYPES},
        "queue_run": QueueRunConfig,
        "queue_run_for_each_participant": QueueRunForEachParticipantConfig,
        "set_session_mode": SetSessionModeConfig,
        "ensure_participant_seat": EnsureParticipantSeatConfig,
        "configure_session": ConfigureSessionConfig,
        "run_code_review": RunCodeReviewConfig,
        **{
            kind: EmptyConfig
            for kind in (
                "enable_plan_mode",
                "disable_plan_mode",
                "auto_start_agent",
                "reset_agent_context",
                "clear_decisions",
            )
        },
    }
)
"""Action type -> the model of its `config` (every action type a template may name)."""


class ActionDecl(_Model):
    """One declared action `{type, config}`; `config` is the typed model for `type` (absent -> defaults).

    Errors: an unknown type; a config that does not fit the type's model; move_to_step without a step_id or
    move_to_next/move_to_previous with one. Whether the type is allowed for its trigger is StepEvents' check.
    """

    type: str
    """The action type; each trigger allows a fixed set of types."""
    config: ActionConfig
    """The action's settings; absent or null: the type's defaults."""

    @model_validator(mode="before")
    @classmethod
    def _typed_config(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        if "type" not in data:
            raise _Located(("type",), "required key is missing")
        config_model = CONFIG_MODELS.get(data["type"]) if isinstance(data["type"], str) else None
        if config_model is None:
            hint = did_you_mean(data["type"], CONFIG_MODELS)
            raise _Located(("type",), f"unknown action type {data['type']!r}{hint}")
        raw = data.get("config")
        try:
            config = config_model.model_validate({} if raw is None else raw)
        except ValidationError as exc:
            loc, message = _problem(exc.errors()[0], config_model)
            raise _Located(("config", *loc), message) from exc
        return {**data, "config": config}

    @model_validator(mode="after")
    def _move_target(self) -> Self:
        if isinstance(self.config, MoveConfig):
            if self.type == "move_to_step" and not self.config.step_id:
                raise _Located(("config", "step_id"), "move_to_step needs a non-empty step_id")
            if self.type != "move_to_step" and self.config.step_id is not None:
                raise _Located(("config", "step_id"), f"{self.type} takes no step_id")
        return self


_ActionList = Annotated[tuple[ActionDecl, ...], Strict(False), Field(max_length=MAX_TEMPLATE_ACTIONS)]


class StepEvents(_Model):
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
        allowed = (info.context or {}).get(_ALLOWED_CONTEXT_KEY, ALLOWED_ACTIONS)
        for trigger in Trigger:
            for index, action in enumerate(self.actions(trigger)):
                if action.type not in allowed.get(trigger, frozenset()):
                    raise _Located(
                        (trigger.value, index, "type"),
                        f"action {action.type!r} is not allowed for trigger {trigger.value}",
                    )
        return self


class Step(_Model):
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


class Workflow(_Model):
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
                raise _Located(
                    ("steps", index, "id"),
                    f"duplicate step id {step.id!r} (also steps[{first_index[step.id]}])",
                )
            first_index[step.id] = index
            if step.position in position_index:
                other = self.steps[position_index[step.position]].id
                raise _Located(
                    ("steps", index, "position"), f"position {step.position} is taken by step {other!r}"
                )
            position_index[step.position] = index
            if step.is_start_step and start_index is not None:
                other = self.steps[start_index].id
                raise _Located(("steps", index, "is_start_step"), f"step {other!r} is already the start step")
            if step.is_start_step:
                start_index = index
        if start_index is None:
            raise _Located(("steps",), "no start step: exactly one step needs is_start_step: true")
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
                raise _Located(
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
    loc: _Loc = ("steps", index, "pull_from_step_id")
    if feeder is None:
        return
    if feeder == step.id:
        raise _Located(loc, "a step cannot pull from itself")
    if feeder not in step_ids:
        raise _Located(loc, f"pull_from_step_id {feeder!r} is not a step of this workflow")
    if step.id in on_cycle:
        chain = [step.id]
        while feeder != step.id and feeder is not None:
            chain.append(feeder)
            feeder = steps[step_ids[feeder]].pull_from_step_id
        raise _Located(loc, "pull_from_step_id links form a cycle: " + " -> ".join([*chain, step.id]))


def _problem(error: ErrorDetails, model: type[BaseModel]) -> tuple[_Loc, str]:
    """The location and message of one validation error of `model` (our own `_Located` messages kept
    verbatim; an unknown key names the closest key accepted there)."""
    loc: _Loc = tuple(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, _Located):
        return (*loc, *cause.loc), cause.message
    if error["type"] == "extra_forbidden":
        return loc, f"unknown key {loc[-1]!r}{did_you_mean(loc[-1], keys_at(model, loc[:-1]))}"
    if error["type"] == "missing":
        return loc, "required key is missing"
    if error["type"] == "tuple_type":
        return loc, f"expected a list (got {shown(error['input'])})"
    return loc, f"{error['msg']} (got {shown(error['input'])})"


def _dotted(loc: _Loc) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _step_id_at(data: Mapping[str, Any], loc: _Loc) -> str | None:
    """The raw `id` of the step `loc` points into, if it has a string one."""
    if len(loc) < 2 or loc[0] != "steps" or not isinstance(loc[1], int):
        return None
    steps = data.get("steps")
    step = steps[loc[1]] if isinstance(steps, list | tuple) and loc[1] < len(steps) else None
    step_id = step.get("id") if isinstance(step, Mapping) else None
    return step_id if isinstance(step_id, str) else None


class _HugeInt(int):
    """An integer literal too long for int64, kept as a value just outside int64 so the field's bound
    reports it where it stands (step and field); it shows how many digits were written."""

    digits: int

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


_INT_TEXT_LIMIT = 70  # an int64 in any YAML 1.1 form ("0b" + 64 binary digits, sign, base-60) is shorter


class _BoundedComposer(Composer):
    """PyYAML's composer, bounded for untrusted text: aliases are refused (no Kandev template uses one, and
    an alias bomb expands exponentially); mappings and sequences nest at most MAX_YAML_DEPTH levels (the
    composer recurses per level; a node inside MAX_YAML_DEPTH collections is one level too deep)."""

    _depth = 0

    if typing.TYPE_CHECKING:

        def peek_event(self) -> Any: ...

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()
        mark = cast(yaml.Mark, event.start_mark)
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not allowed in a template", mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _StrictConstructor(SafeConstructor):
    """PyYAML's safe constructor, as Kandev's Go decoder reads a template: a key repeated within one
    mapping is refused; a scalar YAML 1.1 reads as a timestamp stays its text (a date object, or
    `2001-13-45`'s ValueError, never escapes); an integer literal longer than int64 is never converted
    (Python refuses beyond 4,300 digits); a scalar an explicit tag makes unreadable (`!!int nope`,
    `!!bool maybe`) is a ConstructorError at its line, never a ValueError."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        if len(text) <= _INT_TEXT_LIMIT:
            return self._tagged(node, "an integer", super().construct_yaml_int)
        huge = _HugeInt(INT64_MIN - 1 if text.startswith("-") else INT64_MAX + 1)
        huge.digits = len(re.sub(r"^[-+]?(0[xob])?", "", text))
        return huge

    def construct_timestamp_text(self, node: yaml.ScalarNode) -> str:
        return str(self.construct_scalar(node))

    def construct_tagged_float(self, node: yaml.ScalarNode) -> float:
        return self._tagged(node, "a float", super().construct_yaml_float)

    def construct_tagged_bool(self, node: yaml.ScalarNode) -> bool:
        return self._tagged(node, "a boolean", super().construct_yaml_bool)

    def _tagged(self, node: yaml.ScalarNode, kind: str, construct: Callable[[yaml.ScalarNode], T]) -> T:
        """`construct(node)`, a scalar an explicit tag (`!!float nope`) made unreadable refused naming it."""
        try:
            return construct(node)
        except (ValueError, KeyError):
            message = f"{shown(node.value)} is not {kind}"
            raise yaml.constructor.ConstructorError(None, None, message, node.start_mark) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictConstructor.yaml_constructors = {
    **SafeConstructor.yaml_constructors,
    "tag:yaml.org,2002:int": _StrictConstructor.construct_yaml_int,
    "tag:yaml.org,2002:timestamp": _StrictConstructor.construct_timestamp_text,
    "tag:yaml.org,2002:float": _StrictConstructor.construct_tagged_float,
    "tag:yaml.org,2002:bool": _StrictConstructor.construct_tagged_bool,
}


class _StrictLoader(_BoundedComposer, _StrictConstructor, yaml.SafeLoader):
    """PyYAML's pure-Python safe loader, bounded and strict: the reference every other path must agree
    with, and the words a refusal uses. Its scanner also refuses deep flow nesting as it scans."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass: type[yaml.Token]) -> None:
        # The scanner looks ahead up to 1,024 characters per possible key, each step costing the flow
        # depth: refuse deep `[[[[...` as it is scanned rather than after that lookahead.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.get_mark()
            )
        super().fetch_flow_collection_start(TokenClass)


class _Unbounded(Exception):
    """The node graph libyaml composed holds an alias or nests too deep: `_StrictLoader` must say where."""


def _check_nodes(root: yaml.Node, aliases: bool) -> None:
    """Raise _Unbounded when a node lies deeper than `_BoundedComposer` allows or, if the text may hold
    `aliases` (it has both an `&` and a `*`), when a node is reached twice; one pass, level by level."""
    seen: set[int] = set()
    level, depth = [root], 1
    while level:
        if depth > MAX_YAML_DEPTH:
            raise _Unbounded
        if aliases:
            before = len(seen)
            seen.update(map(id, level))
            if len(seen) != before + len(level):
                raise _Unbounded
        below: list[yaml.Node] = []
        for node in level:
            if isinstance(node, yaml.MappingNode):
                for pair in node.value:
                    below += pair
            elif isinstance(node, yaml.SequenceNode):
                below += node.value
        level, depth = below, depth + 1


_CLoader: type[_StrictConstructor] | None = None
if _CParser is not None:

    class _CStrictLoader(_StrictConstructor, _CParser, Resolver):
        """libyaml's scanner, parser and composer (C) under `_StrictConstructor` (Python); the node graph
        is checked against `_BoundedComposer`'s rules before anything is constructed (raises _Unbounded).
        libyaml stops any nesting at 1,000 levels on its own."""

        def __init__(self, stream: bytes) -> None:
            _CParser.__init__(self, stream)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self._aliases = b"&" in stream and b"*" in stream  # an alias needs an anchor and a reference

        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            _check_nodes(node, self._aliases)
            return self.construct_document(node)

    _CLoader = _CStrictLoader


_SCALAR_TAGS = frozenset(
    f"tag:yaml.org,2002:{kind}" for kind in ("null", "bool", "int", "float", "binary", "timestamp", "str")
)
_MAPPING_TAGS = frozenset({None, "!", "tag:yaml.org,2002:map"})
_SEQUENCE_TAGS = frozenset({None, "!", "tag:yaml.org,2002:seq"})
_TRIGGER_KEYS = frozenset(trigger.value for trigger in Trigger)
_NO_KEY = object()


class _NotPlain(Exception):
    """`_read_events` met what only the node-based loaders read or word: an anchor or alias, a tag other than
    a scalar's or a plain map's or seq's, a merge (`<<`) or value (`=`) key, a collection as a key, a
    repeated key, a second document, nesting deeper than MAX_YAML_DEPTH, a scalar the constructor refuses."""


class _OverCount(Exception):
    """A count limit broken, found while the text is read: `loc` and `message` as `_first_count_problem`
    gives them; `data` holds the steps read so far (the one at `loc` complete, so its id is known)."""

    def __init__(self, loc: _Loc, message: str, data: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message
        self.data = data


def _read_events(encoded: bytes) -> Any:
    """The YAML value of `encoded`, built straight from libyaml's events, as `_StrictLoader` reads it; the
    count limits are measured as each list ends, and the first one broken stops the reading.

    One pass, no node graph: each scalar is resolved and constructed by `_StrictConstructor` as the
    node-based loaders do (once per distinct tag, text and implicitness: a repeated one reuses the value,
    floats apart); mappings and sequences become dicts and lists in document order. Raises
    _OverCount for the first count problem `_first_count_problem` would find in the same text (raised once
    the step it lies in has been read); _NotPlain for anything it leaves to the node-based loaders (see
    there), which then read the whole text again; yaml.YAMLError where libyaml's parser refuses the text.
    """
    next_event = _CParser(encoded).get_event
    scalar, mapping_start, sequence_start = yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent
    mapping_end, sequence_end = yaml.MappingEndEvent, yaml.SequenceEndEvent
    constructor = _StrictConstructor()
    resolve: Callable[..., str] = Resolver().resolve  # (node class, value, implicit) -> tag
    read: dict[tuple[str | None, str, tuple[bool, bool]], Any] = {}  # a scalar as written -> its value
    open_: list[Any] = []  # the open mappings and sequences, outermost first
    slots: list[Any] = []  # where each open one goes in its parent: key, index, or None for the root
    keys: list[Any] = []  # each open mapping's key awaiting its value, or _NO_KEY
    root: Any = None
    documents = 0
    over: tuple[_Loc, str] | None = None
    while True:
        event: Any = next_event()  # the stubs type it `Event | None`; branches test its type
        kind = type(event)
        if kind is scalar:
            if len(open_) >= MAX_YAML_DEPTH or event.anchor is not None:
                raise _NotPlain
            written = (event.tag, event.value, event.implicit)
            value = read.get(written, _NO_KEY)
            if value is _NO_KEY:
                value = _construct_scalar(event, constructor, resolve)
                if type(value) is not float:  # each NaN stays its own object, as the node loaders make it
                    read[written] = value
        elif kind is mapping_start or kind is sequence_start:
            mapping = kind is mapping_start
            tags = _MAPPING_TAGS if mapping else _SEQUENCE_TAGS
            if len(open_) >= MAX_YAML_DEPTH or event.tag not in tags or event.anchor is not None:
                raise _NotPlain
            if not open_:
                slots.append(None)
            elif type(open_[-1]) is list:
                slots.append(len(open_[-1]))
            elif keys[-1] is _NO_KEY:
                raise _NotPlain  # a mapping or sequence as a key
            else:
                slots.append(keys[-1])
            open_.append({} if mapping else [])
            keys.append(_NO_KEY)
            continue
        elif kind is mapping_end or kind is sequence_end:
            value = open_.pop()
            keys.pop()
            if over is None and (
                len(value) > MAX_TEMPLATE_ACTIONS
                or (len(open_) == 5 and kind is mapping_end and value.get("type") == "configure_session")
            ):
                over = _over_count(value, open_, slots)
            slots.pop()
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise _NotPlain
            continue
        elif kind is yaml.StreamEndEvent:
            return root
        elif kind is yaml.AliasEvent:
            raise _NotPlain
        else:  # the stream's start, a document's end
            continue
        if not open_:
            root = value
        elif type(parent := open_[-1]) is list:
            parent.append(value)
        elif keys[-1] is _NO_KEY:
            if value in parent:
                raise _NotPlain  # a repeated key: the constructor words it
            keys[-1] = value
        else:
            parent[keys[-1]] = value
            keys[-1] = _NO_KEY
        if over is not None and len(open_) <= 2:  # the step holding the problem is read: its id is known
            raise _OverCount(*over, {"steps": open_[1] if len(open_) == 2 else value})


def _construct_scalar(event: Any, constructor: _StrictConstructor, resolve: Callable[..., str]) -> Any:
    """The value of a ScalarEvent, resolved and constructed as the node loaders do; _NotPlain when its tag
    is not a scalar's or the constructor refuses it (the node loaders word that)."""
    tag = event.tag
    if tag is None or tag == "!":
        tag = resolve(yaml.ScalarNode, event.value, event.implicit)
    if tag not in _SCALAR_TAGS:
        raise _NotPlain
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    try:
        return _StrictConstructor.yaml_constructors[tag](constructor, node)
    except yaml.YAMLError:
        raise _NotPlain from None


def _over_count(closed: Any, open_: list[Any], slots: list[Any]) -> tuple[_Loc, str] | None:
    """The count problem of the mapping or sequence `closed` has just ended, if it is a counted one: the
    steps list, a trigger's actions, or a configure_session action's rules. `open_` holds its parents;
    `slots[i]` is where `open_[i]` (or, last, `closed`) goes in its parent."""
    depth = len(open_)
    if depth == 0 or type(open_[0]) is not dict or slots[1] != "steps":
        return None
    if depth == 1:
        return _count_problem(closed, _STEPS_BOUND, ("steps",)) if type(closed) is list else None
    if depth < 4 or type(open_[1]) is not list or type(open_[2]) is not dict or type(open_[3]) is not dict:
        return None
    if slots[3] != "events" or slots[4] not in _TRIGGER_KEYS:
        return None
    where: _Loc = ("steps", slots[2], "events", slots[4])
    if depth == 4 and type(closed) is list:
        return _count_problem(closed, _ACTIONS_BOUND, where)
    if depth == 5 and type(open_[4]) is list and type(closed) is dict:
        return _rules_problem(closed, (*where, slots[5]))
    return None


def _parse_yaml(text: str, encoded: bytes) -> Any:
    """The YAML value of `text` (`encoded` is its UTF-8, lone surrogates kept so libyaml refuses them), as
    `_StrictLoader` reads it. Raises yaml.YAMLError; _OverCount for a count limit broken (see
    `_read_events`), before the rest of the text is read.

    Read by libyaml when PyYAML has it: first straight from its events (`_read_events`, ~1.7x faster than
    a node graph), then, for what that leaves to the node-based loaders, composed in C, checked for
    aliases and depth, and constructed by `_StrictConstructor`. A refusal by the constructor's rules
    comes from the same Python code on both paths. Anything else libyaml refuses, or that breaks the
    composer's rules, is read again by `_StrictLoader`, so the refusal has its words and marks: libyaml's
    scanner and parser word their errors otherwise, and `_StrictLoader` refuses deep flow nesting as it
    scans, before the composer would.
    """
    if _CLoader is not None:
        try:
            return _read_events(encoded)
        except _NotPlain:
            try:
                return yaml.load(encoded, Loader=_CLoader)  # type: ignore[arg-type]
            except yaml.constructor.ConstructorError:
                raise
            except (yaml.YAMLError, _Unbounded):
                pass
        except yaml.YAMLError:
            pass
    return yaml.load(text, Loader=_StrictLoader)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return str(exc)


def workflow_from_dict(
    data: Mapping[str, Any],
    source: str,
    *,
    allowed_actions: Mapping[Trigger, frozenset[str]] = ALLOWED_ACTIONS,
) -> Workflow:
    """Validate an already-parsed template mapping into a Workflow; raises WorkflowError naming `source`.

    `allowed_actions` is the per-trigger allow-list (IMPORT_ALLOWED_ACTIONS for the import path).
    The count limits (steps, actions per trigger, rules per configure_session) are checked first, before
    any step is validated: a template over one is refused with the first count problem alone (see
    `_first_count_problem`). Source: kandev-engine-notes.md, Template format.
    """
    counted = _first_count_problem(data)
    if counted is not None:
        raise _workflow_error(data, source, [counted])
    try:
        return Workflow.model_validate(dict(data), context={_ALLOWED_CONTEXT_KEY: allowed_actions})
    except ValidationError as exc:
        errors = exc.errors()
        problems = [_problem(error, Workflow) for error in errors]
        if all(error["loc"] for error in errors):  # field errors: the template checks did not run
            seen = {loc for loc, _ in problems}
            hidden = [found for found in _raw_move_targets(data) if found[0] not in seen]
            if hidden:
                problems = sorted(problems + hidden, key=lambda found: _document_order(found[0]))
        raise _workflow_error(data, source, problems) from exc


def _document_order(loc: _Loc) -> tuple[tuple[int, int | str], ...]:
    """A sort key putting locations in document order (indexes numerically, keys as written)."""
    return tuple((0, part) if isinstance(part, int) else (1, part) for part in loc)


def _raw_move_targets(data: Mapping[str, Any]) -> list[tuple[_Loc, str]]:
    """The move_to_step targets of the raw template that name no step id it declares: the template check
    `_check_move_targets` on the raw data, so a field error elsewhere does not hide them (every problem of
    a file at once)."""
    steps = data.get("steps")
    if not isinstance(steps, list | tuple):
        return []
    ids = {step.get("id") for step in steps if isinstance(step, Mapping)}
    found: list[tuple[_Loc, str]] = []
    for index, step in enumerate(steps):
        events = step.get("events") if isinstance(step, Mapping) else None
        if not isinstance(events, Mapping):
            continue
        for trigger, actions in events.items():
            if not isinstance(actions, list | tuple):
                continue
            for position, action in enumerate(actions):
                config = action.get("config") if isinstance(action, Mapping) else None
                target = config.get("step_id") if isinstance(config, Mapping) else None
                if action.get("type") == "move_to_step" and isinstance(target, str) and target not in ids:
                    loc: _Loc = ("steps", index, "events", trigger, position, "config", "step_id")
                    found.append((loc, f"move_to_step target {target!r} is not a step of this workflow"))
    return found


def _workflow_error(
    data: Mapping[str, Any], source: str, problems: Sequence[tuple[_Loc, str]]
) -> WorkflowError:
    first, *others = (
        WorkflowError(source, _step_id_at(data, loc), _dotted(loc), message) for loc, message in problems
    )
    return WorkflowError(first.source, first.step_id, first.field, first.message, others=others)


_Items = Annotated[tuple[Any, ...], Strict(False)]
_STEPS_BOUND: TypeAdapter[tuple[Any, ...]] = TypeAdapter(
    Annotated[_Items, Field(max_length=MAX_TEMPLATE_STEPS)]
)
_ACTIONS_BOUND: TypeAdapter[tuple[Any, ...]] = TypeAdapter(
    Annotated[_Items, Field(max_length=MAX_TEMPLATE_ACTIONS)]
)


def _count_problem(
    items: list[Any] | tuple[Any, ...], bound: TypeAdapter[tuple[Any, ...]], loc: _Loc
) -> tuple[_Loc, str] | None:
    """The problem of a list over `bound`, at `loc`, in the words full validation gives it (the same
    pydantic bound reports it), or None within it."""
    try:
        bound.validate_python(items)
    except ValidationError as exc:
        at, message = _problem(exc.errors()[0], Workflow)
        return (*loc, *at), message
    return None


def _rules_problem(action: Mapping[str, Any], loc: _Loc) -> tuple[_Loc, str] | None:
    """The count problem of the configure_session `action` at `loc` (rules over MAX_TEMPLATE_ACTIONS)."""
    config = action.get("config")
    rules = config.get("rules") if isinstance(config, Mapping) else None
    if isinstance(rules, list | tuple) and action.get("type") == "configure_session":
        return _count_problem(rules, _ACTIONS_BOUND, (*loc, "config", "rules"))
    return None


def _first_count_problem(data: Mapping[str, Any]) -> tuple[_Loc, str] | None:
    """The first count limit the raw template breaks, checked before any step is validated: steps at most
    MAX_TEMPLATE_STEPS, actions per trigger and rules per configure_session at most MAX_TEMPLATE_ACTIONS.

    First in reading order, a list measured where it ends: within a step, triggers in the order written,
    an action's rules before its trigger's list; the steps list after every step. It is the problem
    `_read_events` stops at when it reads the same text. Only lists are counted; anything of another shape
    is left to validation.
    """
    steps = data.get("steps")
    if not isinstance(steps, list | tuple):
        return None
    for index, step in enumerate(steps):
        events = step.get("events") if isinstance(step, Mapping) else None
        if not isinstance(events, Mapping):
            continue
        for trigger, actions in events.items():
            if trigger not in _TRIGGER_KEYS or not isinstance(actions, list | tuple):
                continue
            where: _Loc = ("steps", index, "events", trigger)
            for position, action in enumerate(actions):
                found = _rules_problem(action, (*where, position)) if isinstance(action, Mapping) else None
                if found is not None:
                    return found
            found = _count_problem(actions, _ACTIONS_BOUND, where)
            if found is not None:
                return found
    return _count_problem(steps, _STEPS_BOUND, ("steps",))


def load_workflow_text(
    text: str,
    source: str = "<string>",
    *,
    allowed_actions: Mapping[Trigger, frozenset[str]] = ALLOWED_ACTIONS,
) -> Workflow:
    """Parse YAML `text` (safe loader, repeated keys rejected) into a Workflow.

    Bounded: at most MAX_TEMPLATE_BYTES of UTF-8, no aliases, nesting at most MAX_YAML_DEPTH,
    payloads at most MAX_PAYLOAD_BYTES, at most MAX_TEMPLATE_STEPS steps; the cost is linear in the text
    (libyaml parses it when PyYAML has it, see `_parse_yaml`). The count limits are checked first: with
    libyaml, each counted list as it ends while the text is read, so the first one broken is the refusal
    before the rest of the text is read; otherwise before any step is validated. CPU-bound: an async
    caller runs it in a worker thread.
    Raises WorkflowError (field '') when the text is too large, not valid YAML or not a mapping, and as
    workflow_from_dict does otherwise. Source: kandev-engine-notes.md, Template format.
    """
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_TEMPLATE_BYTES:
        raise WorkflowError(
            source, None, "", f"a template is at most {MAX_TEMPLATE_BYTES} bytes, not {len(encoded)}"
        )
    try:
        data = _parse_yaml(text, encoded)
    except yaml.YAMLError as exc:
        raise WorkflowError(source, None, "", f"not valid YAML: {_yaml_problem(exc)}") from exc
    except _OverCount as over:
        raise _workflow_error(over.data, source, [(over.loc, over.message)]) from None
    if not isinstance(data, Mapping):
        raise WorkflowError(source, None, "", f"the document must be a mapping, not {type(data).__name__}")
    return workflow_from_dict(data, source, allowed_actions=allowed_actions)


def load_workflow_file(
    path: str | os.PathLike[str],
    *,
    allowed_actions: Mapping[Trigger, frozenset[str]] = ALLOWED_ACTIONS,
) -> Workflow:
    """Read and load the template at `path` (UTF-8); the error source is the path as given.

    Raises WorkflowError as load_workflow_text does; OSError when the file cannot be read.
    """
    return load_workflow_text(
        Path(path).read_text(encoding="utf-8"), os.fspath(path), allowed_actions=allowed_actions
    )


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
