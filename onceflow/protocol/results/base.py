"""How a command's result is declared: a `TypedDict` made a pydantic-validated, documented result. Pure.

The handlers build results as plain typed dicts (mypy checks every key and value) and a reply carries them
as they are; `as_result` gives a typed dict what `result_of` and `onceflow schema` need: unknown keys refused,
and its attribute docstrings as its JSON Schema's descriptions.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import ConfigDict

from onceflow.protocol.field_docs import attribute_docs

R = TypeVar("R", bound=type)


def as_result(cls: R) -> R:
    """Declare `cls` a result: unknown keys refused, and its (and its bases') attribute docstrings the
    descriptions of its JSON Schema's properties (pydantic reads them from models, not typed dicts). The
    docstrings are read when a schema is first built, never at import."""
    docs: dict[str, str] = {}

    def describe(schema: dict[str, Any]) -> None:
        if not docs:
            for klass in reversed(_lineage(cls)):
                docs.update(attribute_docs(klass))
        for name, prop in schema.get("properties", {}).items():
            if name in docs:
                prop["description"] = docs[name]

    cls.__pydantic_config__ = ConfigDict(  # type: ignore[attr-defined]
        extra="forbid", title=cls.__name__, json_schema_extra=describe
    )
    return cls


def _lineage(cls: type) -> list[type]:
    """`cls` and the typed dicts it extends, nearest first."""
    found = [cls]
    for base in getattr(cls, "__orig_bases__", ()):
        if isinstance(base, type) and base is not dict and hasattr(base, "__annotations__"):
            found.extend(_lineage(base))
    return found
