"""A template's actions: the triggers, which action types each allows, and each type's typed config. Pure.

Source: kandev-engine-notes.md, "Template format". `ActionDecl` is one declared `{type, config}`; its config
is validated by the model `CONFIG_MODELS` names for its type. Whether the type is allowed for its trigger is
checked by the step's events (`workflow_model.py`) against `ALLOWED_ACTIONS`, or `IMPORT_ALLOWED_ACTIONS` on
the import path.
"""

import re
from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import MAX_PAYLOAD_BYTES, MAX_TEMPLATE_ACTIONS
from onceflow.protocol.suggest import did_you_mean
from onceflow.protocol.template.problems import Located, problem


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

_THRESHOLDS = frozenset({"all_approve", "all_decide", "majority_approve", "any_reject"})
_N_APPROVE = re.compile(r"n_approve:([0-9]+)")
THRESHOLD_PATTERN = r"^(all_approve|all_decide|majority_approve|any_reject|n_approve:0*[1-9][0-9]*)$"
"""The thresholds `_known_threshold` accepts, for the template's JSON Schema."""
QUEUE_TARGET_PATTERN = r"^(primary|workspace\.ceo_agent|(participant_role|agent_profile_id):.+)$"
_QUEUE_TARGET = re.compile(QUEUE_TARGET_PATTERN)


class TemplateModel(BaseModel):
    """The base of every template model: unknown keys refused, immutable, strict (no scalar coerced); its
    fields' docstrings are the descriptions `onceflow schema --template` shows in an editor."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra=describe_fields)


def _json_payload(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A payload must encode as canonical JSON (string keys, no NaN) within MAX_PAYLOAD_BYTES: it is
    stored and hashed at every entry of its step, so its cost is paid at load time."""
    if value is None:
        return None
    import json  # here, not at the top: few templates have payloads (~5 M instructions of a CLI start)

    try:
        encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise Located((), f"must be JSON (string keys, no NaN or infinity): {exc}") from None
    if len(encoded) > MAX_PAYLOAD_BYTES:
        raise Located((), f"encodes to {len(encoded)} bytes of JSON; the limit is {MAX_PAYLOAD_BYTES}")
    return value


_Payload = Annotated[dict[str, Any] | None, AfterValidator(_json_payload)]
RunPriority = Annotated[int, Field(ge=0, le=3)]
"""A run's priority class (0 human, 1 recovery, 2 event, 3 periodic)."""


class QuorumGuard(TemplateModel):
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
        raise Located(
            (),
            f"threshold {value!r} is not all_approve, all_decide, majority_approve, any_reject "
            "or n_approve:N with N a positive integer",
        )


class QuorumCondition(TemplateModel):
    """The `if:` form of a guard: `{wait_for_quorum: {role, threshold}}`."""

    wait_for_quorum: QuorumGuard
    """The guard."""


class MoveConfig(TemplateModel):
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
            raise Located(
                ("if",), "give the guard either as wait_for_quorum or as if.wait_for_quorum, not both"
            )
        return self

    @property
    def guard(self) -> QuorumGuard | None:
        """The transition's quorum guard, or None when it is unguarded."""
        return self.if_.wait_for_quorum if self.if_ is not None else self.wait_for_quorum


class QueueRunConfig(TemplateModel):
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
            raise Located(
                (),
                f"target {value!r} is not primary, workspace.ceo_agent, participant_role:<role> "
                "or agent_profile_id:<id>",
            )
        return value


class QueueRunForEachParticipantConfig(TemplateModel):
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


class SetSessionModeConfig(TemplateModel):
    """Config of set_session_mode: `mode` is a required non-empty string."""

    mode: str = Field(min_length=1)
    """The session mode to set (the host interprets it)."""


class EnsureParticipantSeatConfig(TemplateModel):
    """Config of ensure_participant_seat: the (non-empty) role whose seat must exist."""

    role: str = Field(min_length=1)
    """The role whose seat must exist."""


class ConfigureSessionRule(TemplateModel):
    """One rule of configure_session."""

    agent_name: str
    """The agent the rule is for."""
    operation: Literal["set", "keep", "restore_original"]
    """What to do with the agent's session configuration."""
    model: str | None = None
    """The model to set."""
    config_options: _Payload = None
    """Options to set (a mapping, at most 64 KiB as canonical JSON)."""


class ConfigureSessionConfig(TemplateModel):
    """Config of configure_session (declarable only by a template registered with `import_path: true`)."""

    rules: Annotated[tuple[ConfigureSessionRule, ...], Strict(False), Field(max_length=MAX_TEMPLATE_ACTIONS)]
    """The rules, applied in order."""


class RunCodeReviewConfig(TemplateModel):
    """Config of run_code_review (declarable only by a template registered with `import_path: true`)."""

    agent_profile_id: str | None = None
    """The reviewing agent profile, if not the host's default."""


class EmptyConfig(TemplateModel):
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

CONFIG_MODELS: Mapping[str, type[TemplateModel]] = MappingProxyType(
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


class ActionDecl(TemplateModel):
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
            raise Located(("type",), "required key is missing")
        config_model = CONFIG_MODELS.get(data["type"]) if isinstance(data["type"], str) else None
        if config_model is None:
            hint = did_you_mean(data["type"], CONFIG_MODELS)
            raise Located(("type",), f"unknown action type {data['type']!r}{hint}")
        raw = data.get("config")
        try:
            config = config_model.model_validate({} if raw is None else raw)
        except ValidationError as exc:
            loc, message = problem(exc.errors()[0], config_model)
            raise Located(("config", *loc), message) from exc
        return {**data, "config": config}

    @model_validator(mode="after")
    def _move_target(self) -> Self:
        if isinstance(self.config, MoveConfig):
            if self.type == "move_to_step" and not self.config.step_id:
                raise Located(("config", "step_id"), "move_to_step needs a non-empty step_id")
            if self.type != "move_to_step" and self.config.step_id is not None:
                raise Located(("config", "step_id"), f"{self.type} takes no step_id")
        return self
