"""Human output escapes control characters: an id can neither forge a line nor drive
the terminal."""

from __future__ import annotations

import types
import typing
import unicodedata
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.cli.trace import describe, escape_controls
from onceflow.protocol import events as e


@given(st.text())
def test_escaped_text_holds_no_control_character_and_escaping_is_idempotent(text: str) -> None:
    shown = escape_controls(text)
    assert not any(unicodedata.category(ch) == "Cc" for ch in shown)
    assert "\u2028" not in shown and "\u202e" not in shown
    assert escape_controls(shown) == shown


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cf", "Zl", "Zp"))))
def test_text_without_control_characters_is_shown_unchanged(text: str) -> None:
    assert escape_controls(text) == text


def test_describe_escapes_the_ids_it_shows() -> None:
    event = e.TaskCreated(task_id="T1\n> forged\x1b[31m", workflow_id="wf", step_id="s\u202e")
    line = describe(event)
    assert line == "task T1\\n> forged\\x1b[31m created in wf at s\\u202e"


def _example(annotation: Any) -> Any:
    """A value of `annotation` (str, int, float, bool, a Literal, an optional or a dict of them)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return typing.get_args(annotation)[0]
    if origin in (typing.Union, types.UnionType):
        return _example(next(arg for arg in typing.get_args(annotation) if arg is not type(None)))
    if origin is dict or annotation is dict:
        return {}
    return {str: "x", int: 1, float: 1.0, bool: False}.get(annotation, "x")


EVENT_TYPES = typing.get_args(typing.get_args(e.Event)[0])


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
def test_every_event_type_is_worded_not_dumped(event_type: type[e.BaseModel]) -> None:
    """The trace has a sentence for every event the protocol defines (its JSON is only a fallback)."""
    fields = {name: _example(field.annotation) for name, field in event_type.model_fields.items()}
    assert not describe(event_type(**fields)).startswith("{")  # type: ignore[arg-type]
