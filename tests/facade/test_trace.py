"""Human output escapes control characters (issue 11, section 6): an id can neither forge a line nor drive
the terminal."""

from __future__ import annotations

import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from onceflow.protocol import events as e
from onceflow.trace import describe, escape_controls


@given(st.text())
def test_issue11_escaped_text_holds_no_control_character_and_escaping_is_idempotent(text: str) -> None:
    shown = escape_controls(text)
    assert not any(unicodedata.category(ch) == "Cc" for ch in shown)
    assert "\u2028" not in shown and "\u202e" not in shown
    assert escape_controls(shown) == shown


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cf", "Zl", "Zp"))))
def test_issue11_text_without_control_characters_is_shown_unchanged(text: str) -> None:
    assert escape_controls(text) == text


def test_issue11_describe_escapes_the_ids_it_shows() -> None:
    event = e.TaskCreated(task_id="T1\n> forged\x1b[31m", workflow_id="wf", step_id="s\u202e")
    line = describe(event)
    assert line == "task T1\\n> forged\\x1b[31m created in wf at s\\u202e"
