"""A parsed template validated into a `Workflow`, every problem reported as a `WorkflowError`. Pure.

Every problem names the source, the step id (when inside a step) and the dotted field path; the error is the
first problem found and its `others` hold the rest of what the same pass found (`onceflow validate` prints
them all), except that a template over a count limit (steps, actions per trigger) is refused with the first
count problem alone (`workflow_counts.py`), before any step is validated. An unknown key or action type names
the closest known one.
"""

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from onceflow.protocol.template.actions import ALLOWED_ACTIONS, Trigger
from onceflow.protocol.template.counts import first_count_problem
from onceflow.protocol.template.model import ALLOWED_CONTEXT_KEY, Workflow
from onceflow.protocol.template.problems import Loc, problem


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
    `first_count_problem`). Source: kandev-engine-notes.md, Template format.
    """
    counted = first_count_problem(data)
    if counted is not None:
        raise workflow_error(data, source, [counted])
    try:
        return Workflow.model_validate(dict(data), context={ALLOWED_CONTEXT_KEY: allowed_actions})
    except ValidationError as exc:
        errors = exc.errors()
        problems = [problem(error, Workflow) for error in errors]
        if all(error["loc"] for error in errors):  # field errors: the template checks did not run
            seen = {loc for loc, _ in problems}
            hidden = [found for found in _raw_move_targets(data) if found[0] not in seen]
            if hidden:
                problems = sorted(problems + hidden, key=lambda found: _document_order(found[0]))
        raise workflow_error(data, source, problems) from exc


def _document_order(loc: Loc) -> tuple[tuple[int, int | str], ...]:
    """A sort key putting locations in document order (indexes numerically, keys as written)."""
    return tuple((0, part) if isinstance(part, int) else (1, part) for part in loc)


def _raw_move_targets(data: Mapping[str, Any]) -> list[tuple[Loc, str]]:
    """The move_to_step targets of the raw template that name no step id it declares: the template check
    `_check_move_targets` (workflow_model.py) on the raw data, so a field error elsewhere does not hide them
    (every problem of a file at once)."""
    steps = data.get("steps")
    if not isinstance(steps, list | tuple):
        return []
    ids = {step.get("id") for step in steps if isinstance(step, Mapping)}
    found: list[tuple[Loc, str]] = []
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
                    loc: Loc = ("steps", index, "events", trigger, position, "config", "step_id")
                    found.append((loc, f"move_to_step target {target!r} is not a step of this workflow"))
    return found


def workflow_error(
    data: Mapping[str, Any], source: str, problems: Sequence[tuple[Loc, str]]
) -> WorkflowError:
    first, *others = (
        WorkflowError(source, _step_id_at(data, loc), _dotted(loc), message) for loc, message in problems
    )
    return WorkflowError(first.source, first.step_id, first.field, first.message, others=others)


def _dotted(loc: Loc) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _step_id_at(data: Mapping[str, Any], loc: Loc) -> str | None:
    """The raw `id` of the step `loc` points into, if it has a string one."""
    if len(loc) < 2 or loc[0] != "steps" or not isinstance(loc[1], int):
        return None
    steps = data.get("steps")
    step = steps[loc[1]] if isinstance(steps, list | tuple) and loc[1] < len(steps) else None
    step_id = step.get("id") if isinstance(step, Mapping) else None
    return step_id if isinstance(step_id, str) else None
