"""The pieces docs/protocol.md is made of: a model's fields as a Markdown table, a JSON Schema type and its
bounds in words, links between sections, docstrings as Markdown. Pure.

`onceflow/cli/reference.py` (the page and its protocol sections) and `reference_serve.py` (the socket
sections) build the page from them.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from onceflow.protocol import limits, times
from onceflow.protocol.commands import COMMAND_TYPES
from onceflow.protocol.events import Event

EVENT_TYPES: tuple[type[BaseModel], ...] = typing.get_args(typing.get_args(Event)[0])
"""Every event model, in the `Event` union's order."""


def tag_of(model: type[BaseModel]) -> str:
    """A command or event model's `type` tag (its name on the wire)."""
    return str(model.model_fields["type"].default)


def _anchor(name: str) -> str:
    """The anchor GitHub gives a heading: command and event sections are headed by their `type` tag."""
    for model in (*COMMAND_TYPES, *EVENT_TYPES):
        if model.__name__ == name:
            return tag_of(model)
    return name.lower()


def link(model: type[BaseModel] | str) -> str:
    """A Markdown link to the section of a model (a command or event by its tag) or of a named type."""
    name = model if isinstance(model, str) else model.__name__
    label = name if isinstance(model, str) else f"`{tag_of(model)}`"
    return f"[{label}](#{_anchor(name)})"


def field_table(
    schema: Mapping[str, Any], skip: tuple[str, ...] | str = (), *, host_sends: bool = True
) -> str:
    """A table of the model's fields: name, type with bounds, default (or required), description. A model
    the runtime sends (`host_sends=False`: replies, events, results) has every field present, so it gets
    no default column."""
    required = set(schema.get("required", ()))
    lines = ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    if not host_sends:
        lines = ["| Field | Type | Description |", "| --- | --- | --- |"]
    for name, prop in schema.get("properties", {}).items():
        if name in ((skip,) if isinstance(skip, str) else skip):
            continue
        cells = [f"`{name}`", schema_type(prop)]
        if host_sends:
            cells.append("required" if name in required else f"`{json.dumps(_default(prop))}`")
        cells.append(one_line(prop.get("description", "")))
        lines.append("| " + " | ".join(table_cell(cell) for cell in cells) + " |")
    return "\n".join(lines)


def _default(prop: Mapping[str, Any]) -> Any:
    """The default of an optional field; a schema shows none for a default factory (an empty list or
    mapping here)."""
    if "default" in prop:
        return prop["default"]
    return [] if prop.get("type") == "array" else {}


def schema_type(prop: Mapping[str, Any]) -> str:
    """A JSON Schema property as words: its type, then its bounds."""
    if "$ref" in prop:
        return link(prop["$ref"].rsplit("/", 1)[1])
    if "discriminator" in prop:
        return "[an event](#events)"
    if "anyOf" in prop:
        return " or ".join(schema_type(option) for option in prop["anyOf"])
    if "allOf" in prop and len(prop["allOf"]) == 1:
        return schema_type(prop["allOf"][0])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    if "enum" in prop:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        items = schema_type(prop.get("items", {}))
        return f"list of {items}" + _bounded(_size(prop, "minItems", "maxItems", "items"))
    if kind == "string":
        return "string" + _bounded([*_size(prop, "minLength", "maxLength", "characters"), *_pattern(prop)])
    if kind == "integer":
        if (prop.get("minimum"), prop.get("maximum")) == (limits.INT64_MIN, limits.INT64_MAX):
            return "integer (int64)"
        return "integer" + _bounded(_range(prop))
    return str(kind) if kind else "any JSON"


def _bounded(bounds: list[str]) -> str:
    return f" ({', '.join(bounds)})" if bounds else ""


def _size(prop: Mapping[str, Any], low: str, high: str, unit: str) -> list[str]:
    lo: int | None = prop.get(low)
    hi: int | None = prop.get(high)
    if lo is not None and hi is not None:
        return [f"{lo:,} to {hi:,} {unit}"]
    if hi is not None:
        return [f"at most {hi:,} {_unit(hi, unit)}"]
    if lo is not None:
        return [f"at least {lo:,} {_unit(lo, unit)}"]
    return []


def _unit(count: int, unit: str) -> str:
    return unit.removesuffix("s") if count == 1 else unit


def _range(prop: Mapping[str, Any]) -> list[str]:
    bounds = []
    for key, sign in [
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ]:
        if key in prop:
            value = prop[key]
            shown = "int64 max" if value == limits.INT64_MAX else f"{value:,}"
            bounds.append(f"{sign} {shown}")
    return bounds


def _pattern(prop: Mapping[str, Any]) -> list[str]:
    pattern = prop.get("pattern")
    if pattern is None:
        return []
    if pattern == limits.ID_PATTERN:
        return ["no control characters"]
    if pattern == times.RFC3339_UTC.pattern:
        return ["RFC 3339 UTC, `2026-03-01T12:00:00Z`"]
    return [f"matching `{pattern}`"]


def python_type(tp: Any) -> str:
    """A result type (`RESULTS` value) as words with links."""
    if tp is None or tp is type(None):
        return "`null`"
    if typing.get_origin(tp) is list:
        return f"list of {python_type(typing.get_args(tp)[0])}"
    if isinstance(tp, types.UnionType):
        return " or ".join(python_type(arg) for arg in typing.get_args(tp))
    return link(tp.__name__)


def module_docstrings(module: types.ModuleType) -> dict[str, str]:
    """The documented module-level names, in order: `NAME = ...` followed by a string literal."""
    body = ast.parse(inspect.getsource(module)).body
    found: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        target = (
            statement.targets[0] if isinstance(statement, ast.Assign) else getattr(statement, "target", None)
        )
        literal = following.value if isinstance(following, ast.Expr) else None
        if (
            isinstance(target, ast.Name)
            and isinstance(literal, ast.Constant)
            and isinstance(literal.value, str)
        ):
            found[target.id] = inspect.cleandoc(literal.value)
    return found


def first_paragraph(text: str) -> str:
    """A docstring's first paragraph, as one line."""
    return one_line(inspect.cleandoc(text).split("\n\n")[0])


def paragraphs(text: str) -> str:
    """A docstring's paragraphs, each as one line, separated by blank lines."""
    return "\n\n".join(one_line(paragraph) for paragraph in inspect.cleandoc(text).split("\n\n"))


def one_line(text: str) -> str:
    """Docstring lines as one line."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def table_cell(text: str) -> str:
    """Text made safe for a Markdown table cell (`|` escaped)."""
    return text.replace("|", "\\|")
