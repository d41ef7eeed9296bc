"""Seats (store/entries/participants.py): the same seat sent twice is one row, on both backends."""

from __future__ import annotations

from typing import Any

from helpers import OFFICE, create_task, ok, send

from onceflow.actors.runtime.supervisor import Runtime


async def _seat(rt: Runtime, **fields: Any) -> dict[str, Any]:
    seat = {"type": "add_participant", "step_id": "review", "role": "reviewer", "agent_profile_id": "rev-c"}
    return dict((await ok(rt, {**seat, **fields})).result)


async def test_adding_an_identical_seat_again_is_idempotent(office: Runtime) -> None:
    first = await _seat(office, workflow_id=OFFICE)
    again = await _seat(office, workflow_id=OFFICE)
    assert first["already_existed"] is False
    assert again == {"participant_id": first["participant_id"], "already_existed": True}

    other = await _seat(office, workflow_id=OFFICE, position=1)  # another field: another seat
    assert other["already_existed"] is False and other["participant_id"] != first["participant_id"]
    await create_task(office, "T1")
    own = await _seat(office, task_id="T1")  # a per-task row is not the template row
    assert own["already_existed"] is False and own["participant_id"] != first["participant_id"]
    assert await _seat(office, task_id="T1") == {
        "participant_id": own["participant_id"],
        "already_existed": True,
    }

    for row in (first, own):  # one row each: it is removed once, then it is gone
        removed = {"type": "remove_participant", "participant_id": row["participant_id"]}
        assert (await send(office, removed)).ok
        gone = await send(office, removed)
        assert not gone.ok and gone.error is not None and gone.error.code == "not_found"
    assert (await _seat(office, workflow_id=OFFICE))["already_existed"] is False  # seated anew
