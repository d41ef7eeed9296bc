"""Malformed or refused messages get a typed error reply, and the runtime keeps serving with state intact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import APPROVER, OFFICE, decide, list_runs, send, step_of, to_review, turn_complete
from hypothesis import given
from hypothesis import strategies as st

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol import commands as c
from onceflow.protocol.codec import decode_command, encode

# (message, expected error code, expected error field)
BAD_MESSAGES: dict[str, tuple[dict[str, Any] | str, str, str | None]] = {
    "invalid_json": ('{"type": "get_task", ', "invalid_message", None),
    "json_array": ('[{"type": "get_task", "task_id": "T1"}]', "invalid_message", None),
    "json_null": ("null", "invalid_message", None),
    "unknown_type": ({"type": "teleport_task", "task_id": "T1"}, "invalid_message", "type"),
    "missing_type": ({"task_id": "T1"}, "invalid_message", "type"),
    "missing_field": ({"type": "move_task", "step_id": "work"}, "invalid_message", "task_id"),
    "empty_id": ({"type": "turn_complete", "task_id": ""}, "invalid_message", "task_id"),
    "wrong_type": ({"type": "move_task", "task_id": 7, "step_id": "work"}, "invalid_message", "task_id"),
    "wrong_int": ({"type": "finish_run", "run_id": "first"}, "invalid_message", "run_id"),
    "bad_literal": (
        {
            "type": "record_decision",
            "task_id": "T1",
            "step_id": "review",
            "decider_type": "agent",
            "decider_id": "rev-a",
            "decision": "maybe",
        },
        "invalid_message",
        "decision",
    ),
    "extra_field": (
        {"type": "move_task", "task_id": "T1", "step_id": "work", "force": True},
        "invalid_message",
        "force",
    ),
    "nested_field": (
        {"type": "children_completed", "task_id": "T1", "children": [{"task_id": "c1"}]},
        "invalid_message",
        "children.0.state",
    ),
    "unknown_task": ({"type": "turn_complete", "task_id": "ghost"}, "not_found", "task_id"),
    "unknown_step": ({"type": "move_task", "task_id": "T1", "step_id": "limbo"}, "not_found", "step_id"),
    "unknown_workflow": (
        {"type": "create_task", "task_id": "T2", "workflow_id": "nope"},
        "not_found",
        "workflow_id",
    ),
    "duplicate_task": (
        {"type": "create_task", "task_id": "T1", "workflow_id": OFFICE, "step_id": "done"},
        "conflict",
        "task_id",
    ),
    "unknown_run": ({"type": "finish_run", "run_id": 4242}, "not_found", "run_id"),
    "unknown_participant": (
        {"type": "remove_participant", "participant_id": 4242},
        "not_found",
        "participant_id",
    ),
}


@pytest.fixture
async def reviewing(office: Runtime) -> Runtime:
    """T1 sits in Review with its two reviewer runs queued."""
    await to_review(office, "T1")
    return office


async def assert_intact(rt: Runtime) -> None:
    """A good command still works and T1's committed state is what it was before the bad message."""
    assert await step_of(rt, "T1") == "review"
    runs = await list_runs(rt, task_id="T1")
    assert [(r["agent_profile_id"], r["status"]) for r in runs] == [("rev-a", "queued"), ("rev-b", "queued")]


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
async def test_bad_message_gets_typed_error_and_runtime_keeps_serving(reviewing: Runtime, case: str) -> None:
    message, code, field = BAD_MESSAGES[case]
    reply = await send(reviewing, message)
    assert not reply.ok
    assert reply.result is None
    assert (reply.error.code, reply.error.field) == (code, field), reply.error
    assert reply.error.message
    await assert_intact(reviewing)


async def test_invalid_workflow_is_refused_and_the_registered_one_stays(
    reviewing: Runtime, kandev_templates: Path
) -> None:
    text = (kandev_templates / "office-default.yml").read_text(encoding="utf-8")
    broken = text.replace("threshold: all_approve", "threshold: most_approve", 1)
    reply = await send(reviewing, {"type": "register_workflow", "yaml": broken, "source": "broken.yml"})
    assert not reply.ok
    assert reply.error.code == "workflow_invalid"
    assert reply.error.field == "steps[2].events.on_turn_complete[0].config.wait_for_quorum.threshold"
    assert "broken.yml" in reply.error.message
    await assert_intact(reviewing)
    # the original definition (all_approve) still gates Review
    await decide(reviewing, "T1", "review", "rev-a", "approved")
    assert await step_of(reviewing, "T1") == "review"
    approved = await decide(reviewing, "T1", "review", "rev-b", "approved")
    assert approved.result["moved_to"] == "approval"


async def test_not_yaml_is_a_workflow_error_on_the_document(runtime: Runtime) -> None:
    reply = await send(runtime, {"type": "register_workflow", "yaml": "steps: [unclosed"})
    assert (reply.ok, reply.error.code, reply.error.field) == (False, "workflow_invalid", None)


async def test_runtime_completes_the_cycle_after_a_burst_of_bad_messages(reviewing: Runtime) -> None:
    for message, _, _ in BAD_MESSAGES.values():
        assert not (await send(reviewing, message)).ok
    await decide(reviewing, "T1", "review", "rev-a", "rejected")
    await turn_complete(reviewing, "T1")
    await decide(reviewing, "T1", "review", "rev-a", "approved")
    await decide(reviewing, "T1", "review", "rev-b", "approved")
    await decide(reviewing, "T1", "approval", APPROVER, "approved", role="approver")
    assert await step_of(reviewing, "T1") == "done"
    assert len(await list_runs(reviewing, task_id="T1")) == 5


async def test_cross_field_validation_error_does_not_name_the_type_tag_as_field(runtime: Runtime) -> None:
    reply = await send(runtime, {"type": "add_participant", "step_id": "review", "role": "reviewer"})
    assert reply.error.code == "invalid_message"
    assert reply.error.field in (None, "task_id", "workflow_id")


# --- the JSON-lines codec ---------------------------------------------------------------------------

# Ids refuse control characters: category Cc is exactly those.
id_chars = st.characters(blacklist_categories=("Cc", "Cs"))
ids = st.text(id_chars, min_size=1, max_size=20)
move_tasks = st.builds(c.MoveTask, task_id=ids, step_id=ids)
decisions = st.builds(
    c.RecordDecision,
    task_id=ids,
    step_id=ids,
    decider_type=st.sampled_from(["agent", "user"]),
    decider_id=ids,
    decision=st.sampled_from(["approved", "rejected", "changes_requested"]),
    role=st.text(id_chars, max_size=10),
    participant_id=st.none() | st.integers(min_value=-(2**31), max_value=2**31),
    comment=st.text(max_size=40),
    decision_id=st.none() | ids,
)
children = st.builds(
    c.ChildrenCompleted,
    task_id=ids,
    children=st.lists(
        st.builds(c.ChildRow, task_id=ids, state=st.text(id_chars, max_size=10)), min_size=1, max_size=4
    ),
)
heartbeats = st.builds(c.Heartbeat, task_id=ids, step_id=ids, unix=st.integers(min_value=0, max_value=2**40))


@given(st.one_of(move_tasks, decisions, children, heartbeats))
def test_codec_round_trips_commands(command: c.Command) -> None:
    line = encode(command)
    assert "\n" not in line
    assert json.loads(line)["type"] == command.type
    assert decode_command(line) == command
    assert decode_command(line.encode()) == command


@pytest.mark.parametrize(
    ("message", "command"),
    [
        ({"type": "move_task", "step_id": "work"}, "move_task"),
        ('{"type": "move_task", "task_id": 7, "step_id": "work"}', "move_task"),
        (b'{"type": "create_task", "task_id": "T9", "priority": "urgent"}', "create_task"),
        ({"type": "teleport_task", "task_id": "T1"}, "teleport_task"),
        ({"type": "t" * 257}, "unknown"),
        ({"type": "line\nbreak"}, "unknown"),
        ('{"type": "\\ud800"}', "unknown"),
        ({"type": 7}, "unknown"),
        ({"task_id": "T1"}, "unknown"),
        ('{"type": "get_task", ', "unknown"),
    ],
)
async def test_a_refused_reply_names_the_type_it_read(
    runtime: Runtime, message: dict[str, Any] | str | bytes, command: str
) -> None:
    """Whatever the input form, a refusal's `command` is the `type` the message named whenever it named
    one shaped like a name, known or not; `unknown` only when there was none to read."""
    reply = await runtime.send(message)
    assert not reply.ok and reply.error is not None and reply.error.code == "invalid_message"
    assert reply.command == command
    encode(reply).encode("utf-8")  # whatever was sent, the reply encodes


@pytest.mark.parametrize(
    ("message", "field", "said"),
    [
        (
            {"type": "move_tsk", "task_id": "T1"},
            "type",
            "unknown command type 'move_tsk' (did you mean 'move_task'?)",
        ),
        ({"type": "move_task", "task_id": "T1", "stepid": "work"}, "stepid", "(did you mean 'step_id'?)"),
        (
            {"type": "children_completed", "task_id": "T1", "children": [{"task_id": "c1", "stat": "x"}]},
            "children.0.stat",
            "(did you mean 'state'?)",
        ),
        ({"type": "move_task", "task_id": "T1", "step_id": "work", "zzzzzz": 1}, "zzzzzz", "unknown field"),
    ],
)
async def test_an_unknown_command_or_field_is_answered_with_the_closest_known_name(
    reviewing: Runtime, message: dict[str, Any], field: str, said: str
) -> None:
    reply = await send(reviewing, message)
    assert reply.error is not None and (reply.error.code, reply.error.field) == ("invalid_message", field)
    assert said in reply.error.message and ("did you mean" in said) == ("did you mean" in reply.error.message)
    await assert_intact(reviewing)
