"""A transition's stored detail is written out field by field (`history.transition_detail`): its text is
byte for byte what the compact JSON encoder gives the same fields, whatever the ids hold."""

from __future__ import annotations

import json
from typing import Any

import pytest

from onceflow.store.tasks import history

ODD = ['a"b\\c', "é→☃", "tab\there", "\x7f", "\U0001f600", ""]


@pytest.mark.parametrize("text", ODD)
@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize("seq", [None, 1, 2**40])
def test_transition_detail_is_the_compact_encoding_of_its_fields(
    text: str, queued: bool, seq: int | None
) -> None:
    fields: dict[str, Any] = {
        "from_step": None if seq is None else f"from{text}",
        "to_step": f"to{text}",
        "workflow_id": text,
        "trigger": f"trig{text}",
        "entry_path": None if queued else "E1",
        "entry_seq": seq,
    }
    operation_id = f"op:{text}" if text else ""
    expected = dict(fields)
    if operation_id:
        expected["operation_id"] = operation_id
    if queued:
        expected["queued"] = True
    detail = history.transition_detail(
        from_step=fields["from_step"],
        to_step=fields["to_step"],
        workflow_id=fields["workflow_id"],
        trigger=fields["trigger"],
        operation_id=operation_id,
        path=fields["entry_path"],
        entry_seq=seq,
        queued=queued,
    )
    assert detail == json.dumps(expected, separators=(",", ":"))
