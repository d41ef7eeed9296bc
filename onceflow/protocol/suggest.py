""" "Did you mean": the closest known name to one a host or a template author misspelt. Pure.

One helper for every place a name is looked up and not found: a template's unknown key or action type
(protocol/template/problems.py, protocol/template/actions.py), a command's unknown `type` or field
(protocol/codec.py).
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Sequence

from pydantic import BaseModel


def did_you_mean(word: object, known: Collection[str]) -> str:
    """` (did you mean 'x'?)` naming the closest of `known` to `word` (difflib's ratio of at least 0.6),
    or the empty string when none is close."""
    import difflib  # here, not at the top: only a miss needs it (~3 M instructions of a CLI start)

    close = difflib.get_close_matches(str(word), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def keys_at(model: type[BaseModel], loc: Sequence[str | int]) -> Collection[str]:
    """The keys the mapping at `loc` inside a `model` document accepts (empty when `loc` leaves the models).
    List indexes are skipped: a list field's model is its items' model."""
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, str):
            field = current.model_fields.get(part) if current is not None else None
            current = model_in(field.annotation) if field is not None else None
    return current.model_fields.keys() if current is not None else ()


def model_in(annotation: object) -> type[BaseModel] | None:
    """The first model class inside a field annotation (`tuple[Step, ...]` -> Step, `X | None` -> X)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := model_in(arg)) is not None:
            return found
    return None
