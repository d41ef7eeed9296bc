"""Attribute docstrings as the descriptions of a JSON Schema's properties, read when a schema is built. Pure.

The string literal under a field (`name: str`, then its docstring) is its description in `onceflow schema`,
`onceflow schema --template` and docs/protocol.md. pydantic's `use_attribute_docstrings` reads them from the
source of every model as it is defined, which costs more than the rest of building the protocol's models;
`describe_fields` reads them only when a schema is asked for, so importing the protocol (every runtime,
`onceflow validate`) never parses its own source.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

_CACHE: dict[type, dict[str, str]] = {}


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring following each annotated attribute of `cls`'s own body (cleaned as `inspect.cleandoc`
    does), by attribute name. A class without source (frozen) gives none: its shapes still hold."""
    if cls not in _CACHE:
        _CACHE[cls] = _read(cls)
    return _CACHE[cls]


def _read(cls: type) -> dict[str, str]:
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError):
        return {}
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for item, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[item.target.id] = inspect.cleandoc(after.value.value)
    return docs


def describe_fields(schema: dict[str, Any], cls: type) -> None:
    """A pydantic `json_schema_extra`: give each property of `cls`'s schema that has no description the
    docstring of its field, from the nearest class of `cls`'s lineage that annotates it (a field a subclass
    declares again without a docstring has none, as with pydantic's own option). Properties are matched by
    field name and by each alias."""
    fields = getattr(cls, "model_fields", {})
    properties = schema.get("properties", {})
    for name, field in fields.items():
        owner = next((k for k in cls.__mro__ if name in inspect.get_annotations(k)), None)
        doc = attribute_docs(owner).get(name) if owner is not None else None
        if doc is None:
            continue
        keys = {name, field.alias, field.serialization_alias, field.validation_alias}
        for key in keys:
            if isinstance(key, str) and key in properties and "description" not in properties[key]:
                properties[key]["description"] = doc
