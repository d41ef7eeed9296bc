"""A template's count limits, measured on the raw data before any step is validated. Pure.

Steps at most MAX_TEMPLATE_STEPS; actions per trigger and rules per configure_session at most
MAX_TEMPLATE_ACTIONS. A template over one is refused with the first count problem alone, in the words full
validation gives it: the loader checks the parsed data (`first_count_problem`), and the YAML reader
(`workflow_parse.py`) measures each counted list as it ends, so it stops reading at the same problem.
"""

from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any

from pydantic import Field, Strict, TypeAdapter, ValidationError

from onceflow.protocol.limits import MAX_TEMPLATE_ACTIONS, MAX_TEMPLATE_STEPS
from onceflow.protocol.template.actions import Trigger
from onceflow.protocol.template.model import Workflow
from onceflow.protocol.template.problems import Loc, problem

TRIGGER_KEYS = frozenset(trigger.value for trigger in Trigger)
"""The trigger names a step's `events` may hold: only their lists are counted."""

STEPS_BOUND = MAX_TEMPLATE_STEPS
"""The most steps a template holds."""
ACTIONS_BOUND = MAX_TEMPLATE_ACTIONS
"""The most actions a trigger holds, and rules a configure_session action."""


def count_problem(items: list[Any] | tuple[Any, ...], bound: int, loc: Loc) -> tuple[Loc, str] | None:
    """The problem of a list of more than `bound` items, at `loc`, in the words full validation gives it
    (the same pydantic bound reports it), or None within it."""
    if len(items) <= bound:
        return None
    try:
        _bounded(bound).validate_python(items)
    except ValidationError as exc:
        at, message = problem(exc.errors()[0], Workflow)
        return (*loc, *at), message
    return None  # pragma: no cover - a list over the bound always fails it


@cache
def _bounded(bound: int) -> TypeAdapter[tuple[Any, ...]]:
    """The bound as pydantic checks a counted field, built on first use: a template within every bound (most
    of them) never builds it, which saves `onceflow validate` ~2 M instructions of start-up."""
    return TypeAdapter(Annotated[tuple[Any, ...], Strict(False), Field(max_length=bound)])


def rules_problem(action: Mapping[str, Any], loc: Loc) -> tuple[Loc, str] | None:
    """The count problem of the configure_session `action` at `loc` (rules over MAX_TEMPLATE_ACTIONS)."""
    config = action.get("config")
    rules = config.get("rules") if isinstance(config, Mapping) else None
    if isinstance(rules, list | tuple) and action.get("type") == "configure_session":
        return count_problem(rules, ACTIONS_BOUND, (*loc, "config", "rules"))
    return None


def first_count_problem(data: Mapping[str, Any]) -> tuple[Loc, str] | None:
    """The first count limit the raw template breaks, checked before any step is validated: steps at most
    MAX_TEMPLATE_STEPS, actions per trigger and rules per configure_session at most MAX_TEMPLATE_ACTIONS.

    First in reading order, a list measured where it ends: within a step, triggers in the order written,
    an action's rules before its trigger's list; the steps list after every step. It is the problem
    `workflow_parse._read_events` stops at when it reads the same text. Only lists are counted; anything of
    another shape is left to validation.
    """
    steps = data.get("steps")
    if not isinstance(steps, list | tuple):
        return None
    for index, step in enumerate(steps):
        events = step.get("events") if isinstance(step, Mapping) else None
        if not isinstance(events, Mapping):
            continue
        for trigger, actions in events.items():
            if trigger not in TRIGGER_KEYS or not isinstance(actions, list | tuple):
                continue
            where: Loc = ("steps", index, "events", trigger)
            for position, action in enumerate(actions):
                found = rules_problem(action, (*where, position)) if isinstance(action, Mapping) else None
                if found is not None:
                    return found
            found = count_problem(actions, ACTIONS_BOUND, where)
            if found is not None:
                return found
    return count_problem(steps, STEPS_BOUND, ("steps",))
