"""The scenario file format: what `onceflow test` reads, validated before anything runs. Pure.

A scenario file holds one scenario (or several, as YAML documents separated by `---`):

    name: rejection round                  # default: the file name
    template: ../office-example.yml         # relative to the scenario file; registered first
    participants:                           # template-level seats, added after registering
      - {step_id: review, role: reviewer, agent_profile_id: reviewer-1}
    steps:
      - send: {type: create_task, task_id: T1, workflow_id: office-example, step_id: backlog}
        events: [{type: task_created, step_id: backlog}]
      - send: {type: turn_complete, task_id: T1}
        result: {to_step: review}           # a subset of the reply's result
        events:                             # type plus the fields that matter
          - {type: run_queued, agent_profile_id: reviewer-1}
        events_order: any_order             # or in_order (default)
        event_types: [run_queued, transition]   # compared types (default: those `events` names; or all)
      - send: {type: finish_run, run_id: 99}
        error: {code: not_found, field: run_id}  # or just `error: not_found`
      - advance: 6                          # seconds of wall clock and Trio time
      - restart: true                       # close the runtime, reopen it on the same file

Each step is exactly one of `send` (a protocol command), `advance`, `restart` or `coordinator` (`{down:
true}` or `{fence: ...}`: change the scenario's coordinator, declared with a top-level `coordinator: {}`).
A `send` must succeed unless the step names an `error`. Its events are the reply's, then any emitted in
the background before the runtime went idle (a promoted task's entry, an outcome's delivery); an `advance`
step's events are those emitted while time moved. Events of a type the step does not compare are ignored;
what a restart's recovery scan emits is not compared.

Time: the runtime's wall clock (Unix seconds, starting at 1,700,000,000) and Trio's clock are one mock
clock, and `advance` moves both, stopping at every Trio deadline on the way (coordinator retries,
redelivery timers) and letting the runtime go idle before moving on — so the 5 s coalescing window, the
outcome redelivery interval and the 24 h idempotency window are reached deterministically. Each scenario
runs on a fresh database in a temporary directory, with a `RecordingHost`.

A malformed scenario file is a `ScenarioError` naming the file, the step index and the field
(`steps[3].send.task_id`). Running is onceflow/scenario/runner.py.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onceflow.protocol.codec import COMMAND_ADAPTER, validation_error
from onceflow.protocol.commands import Role
from onceflow.protocol.events import Event
from onceflow.protocol.suggest import did_you_mean, keys_at

START = 1_700_000_000.0
"""The scenario's wall clock at its start, in Unix seconds."""

EVENT_FIELDS: dict[str, frozenset[str]] = {
    model.model_fields["type"].default: frozenset(model.model_fields)
    for model in typing.get_args(typing.get_args(Event)[0])
}
"""Every event type and its fields: what an expected event may name."""


class ScenarioError(ValueError):
    """A scenario file that cannot be run: unreadable, not YAML, or failing the format's rules.

    `path` is the file, `field` the offending field as a path (`steps[2].events[0].to_stp`), or None.
    """

    def __init__(self, path: Path, message: str, field: str | None = None) -> None:
        super().__init__(f"{path}: {field}: {message}" if field else f"{path}: {message}")
        self.path, self.field = path, field


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExpectedError(_Format):
    """The error a step's command must be refused with; `field`, when given, must match too."""

    code: str
    field: str | None = None


class CoordinatorChange(_Format):
    """A step changing the scenario's coordinator: `down` fails every call; `fence` is put in receipts."""

    down: bool | None = None
    fence: str | None = Field(default=None, min_length=1)


class Step(_Format):
    """One step: exactly one of `send`, `advance`, `restart`, `coordinator`, plus what must follow."""

    note: str = ""
    send: dict[str, Any] | None = None
    advance: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    restart: Literal[True] | None = None
    coordinator: CoordinatorChange | None = None
    events: list[dict[str, Any]] | None = None
    events_order: Literal["in_order", "any_order"] = "in_order"
    event_types: list[str] | Literal["all"] | None = None
    result: Any = None
    error: str | ExpectedError | None = None


class Participant(_Format):
    step_id: str = Field(min_length=1)
    role: Role
    agent_profile_id: str = Field(min_length=1)


class CoordinatorSettings(_Format):
    """The scenario's coordinator: it accepts deliveries (receipts carry `fence`) unless `down`."""

    fence: str = Field(default="coord-1", min_length=1)
    down: bool = False


class Scenario(_Format):
    name: str | None = None
    template: str = Field(min_length=1)
    import_path: bool = False
    participants: list[Participant] = Field(default_factory=list)
    coordinator: CoordinatorSettings | None = None
    redelivery_interval: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    steps: list[Step] = Field(min_length=1)


@attrs.frozen
class LoadedScenario:
    """A validated scenario and its template's text; `path` is the scenario file."""

    name: str
    path: Path
    template_path: Path
    template_text: str
    spec: Scenario


def load_scenarios(path: Path) -> list[LoadedScenario]:
    """The scenarios of one file, validated (structure, known event types and fields, commands against
    the protocol unless the step expects `invalid_message`) and with their templates read.

    Raises:
        ScenarioError: naming the file, and the step index and field when one is to blame.
    """
    try:
        documents = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    except OSError as exc:
        raise ScenarioError(path, f"cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(path, f"not valid YAML: {exc}") from None
    if not documents:
        raise ScenarioError(path, "holds no scenario")
    loaded = []
    for number, document in enumerate(documents, start=1):
        prefix = f"[document {number}] " if len(documents) > 1 else ""
        try:
            spec = Scenario.model_validate(document)
        except ValidationError as exc:
            first = exc.errors()[0]
            message = first["msg"]
            if first["type"] == "extra_forbidden":
                message = "unknown key" + did_you_mean(first["loc"][-1], keys_at(Scenario, first["loc"][:-1]))
            raise ScenarioError(path, prefix + message, _dotted(first["loc"]) or None) from None
        try:
            _check(spec)
        except _Invalid as exc:
            raise ScenarioError(path, prefix + exc.message, exc.field) from None
        template = (path.parent / spec.template).resolve()
        try:
            text = template.read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(
                path, prefix + f"cannot read {template}: {exc.strerror}", "template"
            ) from None
        name = spec.name or (f"{path.stem}#{number}" if len(documents) > 1 else path.stem)
        loaded.append(LoadedScenario(name, path, template, text, spec))
    return loaded


class _Invalid(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _dotted(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _check(spec: Scenario) -> None:
    """The rules pydantic's structure cannot say; raises _Invalid naming the field."""
    for index, step in enumerate(spec.steps):
        at = f"steps[{index}]"
        kinds = [
            kind for kind in ("send", "advance", "restart", "coordinator") if getattr(step, kind) is not None
        ]
        if len(kinds) != 1:
            raise _Invalid(
                at, f"a step is exactly one of send, advance, restart, coordinator; got {kinds or 'none'}"
            )
        for key in ("result", "error"):
            if key in step.model_fields_set and step.send is None:
                raise _Invalid(f"{at}.{key}", "only a send step has a reply")
        if step.error is not None and "result" in step.model_fields_set:
            raise _Invalid(f"{at}.result", "a refused command has no result: give error or result, not both")
        if (step.restart or step.coordinator) and (step.events is not None or step.event_types is not None):
            raise _Invalid(f"{at}.events", "only send and advance steps have events")
        for number, pattern in enumerate(step.events or []):
            kind = pattern.get("type")
            if kind not in EVENT_FIELDS:
                hint = did_you_mean(kind, EVENT_FIELDS)
                raise _Invalid(f"{at}.events[{number}].type", f"unknown event type {kind!r}{hint}")
            for key in pattern:
                if key not in EVENT_FIELDS[kind]:
                    hint = did_you_mean(key, EVENT_FIELDS[kind])
                    raise _Invalid(f"{at}.events[{number}].{key}", f"not a field of event {kind}{hint}")
        if isinstance(step.event_types, list):
            for number, kind in enumerate(step.event_types):
                if kind not in EVENT_FIELDS:
                    hint = did_you_mean(kind, EVENT_FIELDS)
                    raise _Invalid(f"{at}.event_types[{number}]", f"unknown event type {kind!r}{hint}")
        expects_invalid = error_code(step.error) == "invalid_message"
        if step.send is not None and not expects_invalid:
            try:
                COMMAND_ADAPTER.validate_python(step.send)
            except ValidationError as exc:
                error = validation_error(exc)
                message = error.message.removeprefix(f"{error.field}: ")
                raise _Invalid(f"{at}.send" + (f".{error.field}" if error.field else ""), message) from None


def error_code(error: str | ExpectedError | None) -> str | None:
    """The error code a step expects (None: it expects success)."""
    return error.code if isinstance(error, ExpectedError) else error
