"""The protocol reference page (docs/protocol.md), generated from the models: `onceflow schema --markdown`.
Pure.

Commands with their fields (type, bounds, default, description) and result, the reply, events, error codes
(with `retryable`) and limits, all read from `onceflow.protocol` (field docstrings, JSON Schema bounds,
`limits.py`'s documented constants), so the page cannot say what the code does not. A test keeps the
committed page equal to `render()`. The socket sections are `reference_serve.py`'s; the tables, types and
links every section is made of, `reference_tables.py`'s.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from onceflow.cli.reference_serve import hosts_section, socket_section
from onceflow.cli.reference_tables import (
    EVENT_TYPES,
    field_table,
    first_paragraph,
    link,
    module_docstrings,
    one_line,
    paragraphs,
    python_type,
    table_cell,
    tag_of,
)
from onceflow.protocol import causation, errors, limits, results, tracecontext
from onceflow.protocol.causation import CAUSE_FIELDS
from onceflow.protocol.codec import COMMAND_ADAPTER, EVENT_ADAPTER
from onceflow.protocol.commands import COMMAND_TYPES
from onceflow.protocol.events import Reply
from onceflow.protocol.tracecontext import TRACE_FIELDS
from onceflow.serve import EvictedError, IdleTimeoutError, SlowConsumerError

PAGE = "docs/protocol.md"
REGENERATE = f"onceflow schema --markdown > {PAGE}"

_INTRO = f"""\
# onceflow protocol reference

<!-- Generated from the models in protocol/ by `{REGENERATE}`; edit the models, not this file. -->

A host talks to onceflow in commands and replies: in process, `await runtime.send(command)` takes a command
model, a dict or a JSON line and returns a [`Reply`](#reply); over `onceflow serve`, each line is one
command object and each reply one line. Every command is a JSON object whose `type` names it; unknown
fields are refused. A reply carries the command's `result` (its shape is listed with each command) or an
[`error`](#errorinfo), and the [events](#events) the command caused, in order; `subscribe` streams every
event as it is emitted, each with its `event_seq`, and resumes after a seq. Times are RFC 3339 text in
UTC (`2026-03-01T12:00:00.250000Z`: results and events always write six fraction digits and `Z`); a time a
command carries (`finish_run.retry_at`, `heartbeat.unix`, `budget_alert.period_start`) also accepts a
number of Unix seconds, as it always has. `None` in a description is JSON `null`.

`onceflow schema` prints the same as JSON Schema (`command`, `event`, `reply`, and `results` per command
type). `onceflow schema --template` prints the JSON Schema of the workflow template format (add
`--import-path` for the import path's allow-lists), for an editor: save it, e.g. as
`onceflow-template.schema.json`, and start a template with
`# yaml-language-server: $schema=./onceflow-template.schema.json`, or map it to your templates in the
editor's settings (VS Code: `yaml.schemas`). Checks a schema cannot express (unique step ids and positions,
one start step, move targets and feeders that exist) are `onceflow validate`'s. What each template key does is
[docs/templates.md](templates.md); what survives a crash, a restart or a database fault is
[docs/guarantees.md](guarantees.md).
"""

_INTERNAL = (
    "internal",
    False,
    "Anything unexpected inside the runtime (a bug): logged at ERROR with its traceback; the runtime keeps "
    "serving.",
)


def render() -> str:
    """The whole page, as Markdown (ends with one newline)."""
    sections = [_INTRO.rstrip(), _contents(), socket_section(), hosts_section()]
    sections += [_reply(), _commands(), _events(), _types(), _results(), _errors(), _limits()]
    return "\n\n".join(sections) + "\n"


def _contents() -> str:
    return "\n".join(
        [
            "## Contents",
            "",
            "- [Over a socket: framing and ids](#over-a-socket-framing-and-ids)",
            "- [Over a socket: the host role](#over-a-socket-the-host-role)",
            "- [Replies](#replies)",
            "- [Commands](#commands): " + ", ".join(link(m) for m in COMMAND_TYPES),
            "- [Events](#events): " + ", ".join(link(m) for m in EVENT_TYPES),
            "- [Types used in commands](#types-used-in-commands)",
            "- [Result types](#result-types)",
            "- [Error codes](#error-codes)",
            "- [Limits](#limits)",
        ]
    )


# --- sections -----------------------------------------------------------------------------------------


def _reply() -> str:
    schema = Reply.model_json_schema()
    parts = ["## Replies", "", "### Reply", "", paragraphs(schema["description"]), ""]
    parts.append(field_table(schema, host_sends=False))
    error = schema["$defs"]["ErrorInfo"]
    parts += [
        "",
        "### ErrorInfo",
        "",
        paragraphs(error["description"]),
        "",
        field_table(error, host_sends=False),
    ]
    return "\n".join(parts)


def _commands() -> str:
    defs = COMMAND_ADAPTER.json_schema()["$defs"]
    parts = [
        "## Commands",
        _shared_fields(defs, "Trace context", TRACE_FIELDS, tracecontext),
        _shared_fields(defs, "Causation", CAUSE_FIELDS, causation),
    ]
    for model in COMMAND_TYPES:
        schema = defs[model.__name__]
        tag = tag_of(model)
        result = python_type(results.RESULTS[tag])
        skip = ("type", *TRACE_FIELDS, *CAUSE_FIELDS)
        parts += [f"### `{tag}`", paragraphs(schema.get("description", "")), field_table(schema, skip=skip)]
        parts.append(f"**Result:** {result}.")
    return "\n\n".join(parts)


def _shared_fields(
    defs: Mapping[str, Any], title: str, names: tuple[str, ...], module: types.ModuleType
) -> str:
    """Fields every command has, said once under `title` (their tables leave them out): `module`'s
    docstring after its first paragraph, then the fields' table. The trace context (protocol/tracecontext.py)
    and the causation (protocol/causation.py) are two such groups."""
    schema = defs[COMMAND_TYPES[0].__name__]
    fields = {"properties": {name: schema["properties"][name] for name in names}}
    text = paragraphs(inspect.getdoc(module) or "").split("\n\n", 1)[1]
    intro = (
        f"Every command below also accepts the two {title.lower()} fields, left out of its table: "
        + ", ".join(f"`{name}`" for name in names)
        + "."
    )
    return "\n\n".join([f"### {title}", intro, text, field_table(fields)])


def _events() -> str:
    defs = EVENT_ADAPTER.json_schema()["$defs"]
    parts = ["## Events", "Every event is a JSON object whose `type` names it."]
    for model in EVENT_TYPES:
        schema = defs[model.__name__]
        description = paragraphs(schema.get("description", ""))
        parts += [f"### `{tag_of(model)}`", description, field_table(schema, "type", host_sends=False)]
    return "\n\n".join(parts)


def _types() -> str:
    command_models = {model.__name__ for model in COMMAND_TYPES}
    defs = COMMAND_ADAPTER.json_schema()["$defs"]
    parts = ["## Types used in commands"]
    for name, schema in defs.items():
        if name not in command_models:
            parts += [f"### {name}", paragraphs(schema.get("description", "")), field_table(schema)]
    return "\n\n".join(parts)


def _results() -> str:
    parts = [
        "## Result types",
        "What `Reply.result` holds when `ok`, per the command's **Result** line; "
        "`onceflow.protocol.result_of(reply)` validates it into the model.",
    ]
    shown = set(COMMAND_ADAPTER.json_schema()["$defs"])
    for name, schema in _result_models():
        if name not in shown:
            shown.add(name)
            description = paragraphs(schema.get("description", ""))
            parts += [f"### {name}", description, field_table(schema, host_sends=False)]
    return "\n\n".join(parts)


def _errors() -> str:
    rows = [(cls.code, cls.retryable, first_paragraph(cls.__doc__ or "")) for cls in _error_classes()]
    rows.insert(1, _INTERNAL)
    storage = _storage_kinds()
    for kind in typing.get_args(errors.StorageKind):
        retryable = kind in errors.RETRYABLE_STORAGE_KINDS
        rows.append((f"storage_{kind}", retryable, storage[kind]))
    lines = [
        "## Error codes",
        "",
        "`error.code` is stable. `retryable` is true when nothing of the command was committed and "
        "sending the same command again may succeed once the condition clears. A storage fault rolls back "
        "the failing request's writes (and, when it ended the transaction, those of every request sharing "
        "its group commit); an earlier, separate transaction of the same command stands.",
        "",
        "| Code | Retryable | Meaning |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| `{code}` | {'yes' if retry else 'no'} | {table_cell(meaning)} |" for code, retry, meaning in rows
    ]
    return "\n".join(lines)


def _limits() -> str:
    documented = module_docstrings(limits)
    lines = [
        "## Limits",
        "",
        "From `protocol/limits.py`. Anything beyond a limit is refused with a typed error naming the field "
        "(`invalid_message`, or `workflow_invalid` for a template) before anything is stored.",
        "",
        "| Name | Value | Meaning |",
        "| --- | --- | --- |",
    ]
    for name, doc in documented.items():
        value = getattr(limits, name)
        shown = f"{value:,}" if isinstance(value, int) else f"`{value}`"
        lines.append(f"| `{name}` | {table_cell(shown)} | {table_cell(one_line(doc))} |")
    return "\n".join(lines)


def _result_models() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every model a result is made of (top level, then nested), in `RESULTS` order."""
    for command in results.RESULTS:
        schema = results.result_adapter(command).json_schema()
        if "properties" in schema:
            yield schema["title"], schema
        yield from schema.get("$defs", {}).items()


def _error_classes() -> list[type[errors.OnceflowError]]:
    """Every error class with a code of its own, in definition order (storage errors are per kind; a
    `RefusedError` carries the code of the reply it raises)."""
    found = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.OnceflowError)
        if cls not in (errors.OnceflowError, errors.StorageError, errors.RefusedError)
    ]
    from onceflow.serve.http.api import ForbiddenError, TooLargeError, UnauthorizedError

    return [
        *found,
        SlowConsumerError,
        IdleTimeoutError,
        EvictedError,
        UnauthorizedError,
        ForbiddenError,
        TooLargeError,
    ]


def _storage_kinds() -> dict[str, str]:
    """Each storage kind's meaning: its line in `StorageKind`'s docstring (with the SQLite codes)."""
    doc = module_docstrings(errors)["StorageKind"]
    bullets = re.findall(r"^- (\w+): (.*?)(?=^- |\Z)", doc, flags=re.MULTILINE | re.DOTALL)
    return {kind: one_line(text).rstrip(";.").capitalize() + "." for kind, text in bullets}
