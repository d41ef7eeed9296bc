"""Events and replies built from the runtime's own typed values without pydantic validation (pure).

A validated event costs ~20k instructions (~2-3 us here); one built here ~10k, and a `Reply` built here keeps
its events as they are instead of re-validating each (~50k instructions for 9 events; ~11k here). Each builder
takes exactly its model's fields (bar `type`), typed as the model types them, so mypy checks every call; the
instance it returns equals the validated `Model(**same_arguments)`: the same `__dict__` in declaration order,
the same `model_fields_set`, the same `model_dump()` and JSON. tests/protocol/test_trusted.py pins that per
builder (hypothesis) and that each builder's parameters are still its model's fields. Values are NOT checked:
pass only what the runtime itself produced and typed (an `int` for an `int` field, a plain `str` for a `str`);
anything from outside goes through the models. A `dict` or `list` value is kept as given where validation
would copy it: pass one nobody mutates afterwards. An event is built once and never re-validated when it is
put in a `Reply`.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel

from onceflow.protocol.events import (
    ActionOutcome,
    DecisionsCleared,
    Diagnostic,
    EntryPath,
    ErrorInfo,
    Event,
    Reply,
    RunQueued,
    StepEntered,
    TaskCreated,
    Transition,
)

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
_set_dict = object.__setattr__
# BaseModel's own slots, set through their descriptors: what validation sets besides `__dict__`.
_set_fields_set = cast(Any, vars(BaseModel)["__pydantic_fields_set__"]).__set__
_set_extra = cast(Any, vars(BaseModel)["__pydantic_extra__"]).__set__
_set_private = cast(Any, vars(BaseModel)["__pydantic_private__"]).__set__


# Each event type's fields set, one set shared by all its events: they are frozen, so nothing adds to it
# (pydantic copies the set for `model_copy`), and a set per event would be one more object to build and for
# the cyclic GC to track while the event window keeps the event. A `Reply` (not frozen) gets its own.
_TASK_CREATED_SET = {"task_id", "workflow_id", "step_id"}
_TRANSITION_SET = {"task_id", "workflow_id", "from_step", "to_step", "trigger"}
_STEP_ENTERED_SET = {"task_id", "step_id", "entry_seq", "entry_path"}
_DECISIONS_CLEARED_SET = {"task_id", "step_id", "deleted"}
_RUN_QUEUED_SET = {
    "run_id",
    "task_id",
    "step_id",
    "agent_profile_id",
    "reason",
    "idempotency_key",
    "outcome",
    "priority",
    "parent_run_id",
    "causation_depth",
}
_ACTION_OUTCOME_SET = {"task_id", "step_id", "trigger", "position", "kind", "outcome", "detail"}
_DIAGNOSTIC_SET = {"level", "code", "fields"}


# The events whose every value is atomic (str, int, None): when built here their `__dict__` is a dict the
# cyclic GC does not track, so the event window keeps that dict (`held`) instead of the event.
COMPACT: dict[type[BaseModel], set[str]] = {
    TaskCreated: _TASK_CREATED_SET,
    Transition: _TRANSITION_SET,
    StepEntered: _STEP_ENTERED_SET,
    DecisionsCleared: _DECISIONS_CLEARED_SET,
    RunQueued: _RUN_QUEUED_SET,
    ActionOutcome: _ACTION_OUTCOME_SET,
}
"""The events whose every value is atomic (str, int, None), each with the fields set its builder here gives:
built here, its `__dict__` is a dict the cyclic GC does not track, which the event window keeps (`held`)."""
_BY_TYPE: dict[str, tuple[type[BaseModel], set[str]]] = {
    cast(str, model.model_fields["type"].default): (model, fields) for model, fields in COMPACT.items()
}


Held = Event | dict[str, Any] | tuple[str, str, tuple[str, ...], tuple[Any, ...]]
"""An event as `held` keeps it."""


def held(event: Event) -> Held:
    """What a store of many events (the event window) keeps of `event`: built here with only atomic values,
    its field values (a dict the cyclic GC does not track); a diagnostic built here, its level, code and
    fields' keys and values (tuples the GC stops tracking at their first collections when the values are
    atomic; a dict inside a tuple would keep it tracked); else the event itself. The window keeps ~10 events
    an entry alive: held as models, the GC traversing them cost ~6 us an entry. `restored` gives it back."""
    fields_set = event.__pydantic_fields_set__
    if fields_set is COMPACT.get(type(event)):
        return event.__dict__
    if fields_set is _DIAGNOSTIC_SET:
        values = event.__dict__
        fields = values["fields"]
        return (values["level"], values["code"], tuple(fields), tuple(fields.values()))
    return event


def restored(kept: Held) -> Event:
    """The event `held` kept: an equal instance of its model (the same values, fields set and JSON), built
    without validation from what the runtime itself built; the event itself when it was kept whole."""
    kind = type(kept)
    if kind is dict:
        model, fields = _BY_TYPE[cast(dict[str, Any], kept)["type"]]
        return cast(Event, _instance(model, cast(dict[str, Any], kept), fields))
    if kind is tuple:
        level, code, keys, values = cast(tuple[str, str, tuple[str, ...], tuple[Any, ...]], kept)
        return diagnostic(level=cast(Any, level), code=code, fields=dict(zip(keys, values, strict=True)))
    return cast(Event, kept)


def _instance(model: type[M], values: dict[str, Any], fields_set: set[str]) -> M:
    """An instance of `model` holding `values` (every field, in declaration order) as validation leaves it:
    no extra fields (the models forbid them), no private attributes (they declare none)."""
    instance = _new(model)
    _set_dict(instance, "__dict__", values)
    _set_fields_set(instance, fields_set)
    _set_extra(instance, None)
    _set_private(instance, None)
    return instance


def task_created(*, task_id: str, workflow_id: str, step_id: str) -> TaskCreated:
    """`TaskCreated(task_id=..., workflow_id=..., step_id=...)`, unvalidated (module docstring)."""
    values = {"type": "task_created", "task_id": task_id, "workflow_id": workflow_id, "step_id": step_id}
    return _instance(TaskCreated, values, _TASK_CREATED_SET)


def transition(*, task_id: str, workflow_id: str, from_step: str, to_step: str, trigger: str) -> Transition:
    """`Transition(...)`, unvalidated (module docstring)."""
    values = {
        "type": "transition",
        "task_id": task_id,
        "workflow_id": workflow_id,
        "from_step": from_step,
        "to_step": to_step,
        "trigger": trigger,
    }
    return _instance(Transition, values, _TRANSITION_SET)


def step_entered(*, task_id: str, step_id: str, entry_seq: int | None, entry_path: EntryPath) -> StepEntered:
    """`StepEntered(...)`, unvalidated (module docstring)."""
    values = {
        "type": "step_entered",
        "task_id": task_id,
        "step_id": step_id,
        "entry_seq": entry_seq,
        "entry_path": entry_path,
    }
    return _instance(StepEntered, values, _STEP_ENTERED_SET)


def decisions_cleared(*, task_id: str, step_id: str, deleted: int) -> DecisionsCleared:
    """`DecisionsCleared(task_id=..., step_id=..., deleted=...)`, unvalidated (module docstring)."""
    values = {"type": "decisions_cleared", "task_id": task_id, "step_id": step_id, "deleted": deleted}
    return _instance(DecisionsCleared, values, _DECISIONS_CLEARED_SET)


def run_queued(
    *,
    run_id: int,
    task_id: str | None,
    step_id: str | None,
    agent_profile_id: str,
    reason: str,
    idempotency_key: str | None,
    outcome: Literal["queued"] = "queued",
    priority: int = 2,
    parent_run_id: int | None = None,
    causation_depth: int = 0,
) -> RunQueued:
    """`RunQueued(...)` with every field given, unvalidated (module docstring)."""
    values = {
        "type": "run_queued",
        "run_id": run_id,
        "task_id": task_id,
        "step_id": step_id,
        "agent_profile_id": agent_profile_id,
        "reason": reason,
        "idempotency_key": idempotency_key,
        "outcome": outcome,
        "priority": priority,
        "parent_run_id": parent_run_id,
        "causation_depth": causation_depth,
    }
    return _instance(RunQueued, values, _RUN_QUEUED_SET)


def action_outcome(
    *, task_id: str, step_id: str, trigger: str, position: int, kind: str, outcome: str, detail: str
) -> ActionOutcome:
    """`ActionOutcome(...)` with every field given (`detail` too), unvalidated (module docstring)."""
    values = {
        "type": "action_outcome",
        "task_id": task_id,
        "step_id": step_id,
        "trigger": trigger,
        "position": position,
        "kind": kind,
        "outcome": outcome,
        "detail": detail,
    }
    return _instance(ActionOutcome, values, _ACTION_OUTCOME_SET)


def diagnostic(
    *, level: Literal["debug", "info", "warning", "error"], code: str, fields: dict[str, Any]
) -> Diagnostic:
    """`Diagnostic(level=..., code=..., fields=...)`, unvalidated; `fields` is kept, not copied."""
    values = {"type": "diagnostic", "level": level, "code": code, "fields": fields}
    return _instance(Diagnostic, values, _DIAGNOSTIC_SET)


def reply(command: str, events: list[Event], *, result: Any = None, error: ErrorInfo | None = None) -> Reply:
    """The reply to `command`: `Reply(command=..., ok=True, result=..., events=...)` when `error` is None,
    else `Reply(command=..., ok=False, error=..., events=...)`, unvalidated; `events` is kept, not copied."""
    if error is None:
        values = {
            "type": "reply",
            "command": command,
            "ok": True,
            "result": result,
            "error": None,
            "events": events,
        }
        return _instance(Reply, values, {"command", "ok", "result", "events"})
    values = {
        "type": "reply",
        "command": command,
        "ok": False,
        "result": None,
        "error": error,
        "events": events,
    }
    return _instance(Reply, values, {"command", "ok", "error", "events"})
