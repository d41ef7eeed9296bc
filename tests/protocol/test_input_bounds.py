"""`Runtime.send` never raises, whatever the bytes, and every field is bounded.

Each hostile message gets one typed `invalid_message` reply naming the field where there is one; the reply
itself encodes as a JSON line (no lone surrogate or raw control character leaks into it); the runtime keeps
serving and committed state is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from helpers import FIXTURES, FakeClock, list_runs, ok, register, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.cli.main import main
from onceflow.protocol import commands as c
from onceflow.protocol.codec import command_schema, encode
from onceflow.protocol.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_ID_CHARS,
    MAX_JSON_DEPTH,
    MAX_LIST_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_TEMPLATE_BYTES,
)
from onceflow.testing import RecordingHost

MINIMAL = (FIXTURES / "workflows" / "minimal.yml").read_text(encoding="utf-8")
WF = "fixture"  # minimal.yml: todo, work (start), review (fans out to reviewers), done


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def finish_run_with(literal: str) -> str:
    return '{"type": "finish_run", "run_id": ' + literal + "}"


# (message, expected error field); every one is refused as invalid_message.
HOSTILE: dict[str, tuple[Any, str | None]] = {
    "not_utf8": (b'{"type": "get_task", "task_id": "T\xff"}', None),
    "overlong_utf8": (b'{"type": "get_task", "task_id": "\xc0\xaf"}', None),
    "lone_surrogate_escaped_in_id": ('{"type": "get_task", "task_id": "\\udfff"}', "task_id"),
    "lone_surrogate_raw_in_id": ('{"type": "get_task", "task_id": "\udfff"}', "task_id"),
    "lone_surrogate_in_source": (
        json.dumps({"type": "register_workflow", "yaml": MINIMAL, "source": "\udfff"}),
        "source",
    ),
    "lone_surrogate_in_yaml": (
        json.dumps({"type": "register_workflow", "yaml": MINIMAL + "# \udfff\n"}),
        "yaml",
    ),
    "nested_100000": (nested(100_000), None),
    "nested_100000_in_a_field": ('{"type": "get_task", "task_id": ' + nested(100_000) + "}", None),
    "nested_just_past_the_limit": ('{"type": "get_task", "x": ' + nested(MAX_JSON_DEPTH) + "}", None),
    "int_5000_digits": (finish_run_with("9" * 5000), "run_id"),
    "negative_int_5000_digits": (finish_run_with("-" + "9" * 5000), "run_id"),
    "int_5000_digits_alone": ("9" * 5000, None),
    "run_id_2_63": (finish_run_with(str(2**63)), "run_id"),
    "run_id_below_int64": (finish_run_with(str(-(2**63) - 1)), "run_id"),
    "participant_id_2_63": ({"type": "remove_participant", "participant_id": 2**63}, "participant_id"),
    "position_2_63": (
        {
            "type": "add_participant",
            "workflow_id": WF,
            "step_id": "review",
            "role": "reviewer",
            "position": 2**63,
        },
        "position",
    ),
    "heartbeat_unix_2_63": ({"type": "heartbeat", "task_id": "T1", "step_id": "work", "unix": 2**63}, "unix"),
    "decision_participant_2_64": (
        {
            "type": "record_decision",
            "task_id": "T1",
            "step_id": "review",
            "decider_type": "agent",
            "decider_id": "rev-a",
            "decision": "approved",
            "participant_id": 2**64,
        },
        "participant_id",
    ),
    "nan_constant": (finish_run_with("NaN"), None),
    "infinity_constant": (finish_run_with("-Infinity"), None),
    "message_too_large": ('{"type": "get_task", "task_id": "' + "x" * MAX_MESSAGE_BYTES + '"}', None),
    "message_too_large_in_utf8_only": (
        '{"type": "get_task", "task_id": "' + "é" * (MAX_MESSAGE_BYTES // 2) + '"}',
        None,
    ),
    "id_too_long": ({"type": "get_task", "task_id": "x" * (MAX_ID_CHARS + 1)}, "task_id"),
    "comment_id_of_1_mb": (
        {"type": "task_comment", "task_id": "T1", "comment_id": "c" * 2**20},
        "comment_id",
    ),
    "newline_in_id": ({"type": "get_task", "task_id": "T1\nforged line"}, "task_id"),
    "ansi_escape_in_id": ({"type": "move_task", "task_id": "T1", "step_id": "\x1b[31mwork"}, "step_id"),
    "too_many_children": (
        {
            "type": "children_completed",
            "task_id": "T1",
            "children": [{"task_id": f"c{i}", "state": "done"} for i in range(MAX_LIST_ITEMS + 1)],
        },
        "children",
    ),
    "template_too_long": ({"type": "register_workflow", "yaml": "#" * (MAX_TEMPLATE_BYTES + 1)}, "yaml"),
    "source_with_newline": ({"type": "register_workflow", "yaml": MINIMAL, "source": "a\nb"}, "source"),
    # the dict path: values no JSON line can carry
    "dict_huge_int": ({"type": "finish_run", "run_id": 10**5000}, "run_id"),
    "dict_huge_int_as_type": ({"type": 10**5000}, "type"),
    "dict_surrogate_key": ({"type": "get_task", "task_id": "T1", "\udfff\x1b": 1}, None),
    "dict_deep_list": ({"type": "get_task", "task_id": "T1", "x": [[[[[]]]]] * 3}, "x"),
    "not_a_command_model": (c.ChildRow(task_id="T1", state="done"), None),
}


def _deep_dict_value(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE["dict_nested_100000"] = ({"type": "get_task", "task_id": "T1", "x": _deep_dict_value(100_000)}, None)


@pytest.fixture
async def seeded(runtime: Runtime) -> Runtime:
    """minimal.yml registered with two template reviewers; T1 moved into review (two runs queued)."""
    await register(runtime, MINIMAL, "minimal.yml")
    for agent in ("rev-a", "rev-b"):
        await ok(
            runtime,
            {
                "type": "add_participant",
                "workflow_id": WF,
                "step_id": "review",
                "role": "reviewer",
                "agent_profile_id": agent,
            },
        )
    await ok(runtime, {"type": "create_task", "task_id": "T1", "workflow_id": WF, "primary_agent_id": "w"})
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    return runtime


READS: list[dict[str, Any]] = [
    {"type": "get_task", "task_id": "T1"},
    {"type": "list_runs"},
    {"type": "list_step_entries", "task_id": "T1"},
    {"type": "list_decisions", "task_id": "T1"},
]


async def snapshot(rt: Runtime) -> list[Any]:
    """Every committed fact the fixture made, read through the protocol."""
    return [(await ok(rt, read)).result for read in READS]


def assert_typed(reply: Any, field: str | None) -> None:
    assert not reply.ok and reply.result is None
    assert (reply.error.code, reply.error.field) == ("invalid_message", field), reply.error
    line = encode(reply)  # the reply is always a valid UTF-8 JSON line a host can print
    line.encode("utf-8")
    assert reply.error.message.isprintable() and len(reply.error.message) < 1_000


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_send_types_every_hostile_message(seeded: Runtime, case: str) -> None:
    before = await snapshot(seeded)
    message, field = HOSTILE[case]
    reply = await seeded.send(message)
    assert_typed(reply, field)
    assert await snapshot(seeded) == before


async def test_limits_accept_their_boundary_values(seeded: Runtime) -> None:
    """The limits refuse only what is beyond them: an id of exactly MAX_ID_CHARS, int64's extremes, and
    MAX_JSON_DEPTH levels of nesting are refused only for what they are, not for their size."""
    long_id = "t" * MAX_ID_CHARS
    await ok(seeded, {"type": "create_task", "task_id": long_id, "workflow_id": WF})
    assert (await ok(seeded, {"type": "get_task", "task_id": long_id})).result["task_id"] == long_id
    for position in (INT64_MIN, INT64_MAX):
        await ok(
            seeded,
            {
                "type": "add_participant",
                "workflow_id": WF,
                "step_id": "review",
                "role": "watcher",
                "agent_profile_id": "w",
                "position": position,
            },
        )
    unknown_run = await send(seeded, finish_run_with(str(INT64_MAX)))
    assert (unknown_run.error.code, unknown_run.error.field) == ("not_found", "run_id")
    deep_but_allowed = await send(
        seeded, '{"type": "get_task", "task_id": "T1", "x": ' + nested(MAX_JSON_DEPTH - 1) + "}"
    )
    assert deep_but_allowed.error.field == "x"  # the extra key is named, not the depth


async def test_unexpected_failure_is_an_internal_reply_logged_at_error(seeded: Runtime) -> None:
    """A command model built without validation (`model_construct`) reaches the store with an integer
    SQLite cannot bind: the reply is `internal`, an ERROR log says so, and the runtime keeps serving."""
    before = await snapshot(seeded)
    with structlog.testing.capture_logs() as logs:
        reply = await seeded.send(c.FinishRun.model_construct(run_id=2**70, status="finished"))
    assert not reply.ok and reply.error.code == "internal" and "OverflowError" in reply.error.message
    assert [(log["log_level"], log["event"], log["command"]) for log in logs] == [
        ("error", "command_failed", "finish_run")
    ]
    assert await snapshot(seeded) == before


def test_schema_declares_the_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """`onceflow schema` shows every bound: ids' maxLength and pattern, int64 minimum/maximum, list and
    template sizes."""
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(command_schema()))
    defs = printed["command"]["$defs"]
    task_id = defs["MoveTask"]["properties"]["task_id"]
    assert (task_id["maxLength"], task_id["minLength"]) == (MAX_ID_CHARS, 1) and "pattern" in task_id
    for model, name in [
        ("FinishRun", "run_id"),
        ("RemoveParticipant", "participant_id"),
        ("Heartbeat", "unix"),
    ]:
        prop = defs[model]["properties"][name]  # a time also accepts RFC 3339 text: its integer option
        bound = next(option for option in prop.get("anyOf", [prop]) if option.get("type") == "integer")
        assert (bound["minimum"], bound["maximum"]) == (INT64_MIN, INT64_MAX), (model, name)
    position = defs["AddParticipant"]["properties"]["position"]
    assert position["maximum"] == INT64_MAX
    assert defs["ChildrenCompleted"]["properties"]["children"]["maxItems"] == MAX_LIST_ITEMS
    assert defs["RegisterWorkflow"]["properties"]["yaml"]["maxLength"] == MAX_TEMPLATE_BYTES
    comment = defs["RecordDecision"]["properties"]["comment"]
    assert "maxLength" in comment
    # every string and integer property of every command carries a bound
    for model_name, model in defs.items():
        for name, prop in model.get("properties", {}).items():
            for option in prop.get("anyOf", [prop]):
                if option.get("type") == "string" and "enum" not in option and "const" not in option:
                    assert "maxLength" in option or "pattern" in option, (model_name, name)
                if option.get("type") == "integer" and "const" not in option:
                    assert "maximum" in option, (model_name, name)


def test_onceflow_run_answers_each_hostile_line_and_runs_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script line that is not UTF-8, not JSON or holds a 5,000-digit number gets its own typed reply;
    the lines after it still run (exit 1: some were refused)."""
    workflow = tmp_path / "minimal.yml"
    workflow.write_text(MINIMAL, encoding="utf-8")
    script = tmp_path / "script.jsonl"
    script.write_bytes(
        b'{"type": "get_task", "task_id": "\xff"}\n'
        + finish_run_with("9" * 5000).encode()
        + b"\n{not json\n"
        + b'{"type": "create_task", "task_id": "T9", "workflow_id": "fixture"}\n'
    )
    status = main(
        [
            "run",
            "--workflow",
            str(workflow),
            "--script",
            str(script),
            "--db",
            str(tmp_path / "r.db"),
            "--json",
        ]
    )
    assert status == 1
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["ok"], (r["error"] or {}).get("field")) for r in replies] == [
        (True, None),  # register_workflow
        (False, None),
        (False, "run_id"),
        (False, None),
        (True, None),
    ]


# --- the fuzz: hostile messages interleaved with valid ones ------------------------------------------

BASES: list[dict[str, Any]] = [
    {"type": "get_task", "task_id": "T1"},
    {"type": "move_task", "task_id": "T1", "step_id": "done"},
    {"type": "delete_task", "task_id": "T1"},
    {"type": "finish_run", "run_id": 1},
    {"type": "remove_participant", "participant_id": 1},
    {"type": "add_participant", "workflow_id": WF, "step_id": "review", "role": "reviewer", "position": 3},
    {"type": "heartbeat", "task_id": "T1", "step_id": "review", "unix": 5},
    {"type": "task_comment", "task_id": "T1", "comment_id": "c1"},
    {
        "type": "record_decision",
        "task_id": "T1",
        "step_id": "review",
        "decider_type": "agent",
        "decider_id": "rev-a",
        "decision": "approved",
    },
    {"type": "register_workflow", "yaml": MINIMAL.replace("id: fixture", "id: other")},
    {"type": "create_task", "task_id": "T2", "workflow_id": WF},
]

# Values no command field accepts: a lone surrogate, an integer outside int64, NaN, nesting past the limit.
HUGE = "__huge__"
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
poison = st.one_of(
    st.builds(lambda prefix, s: prefix + s, st.text(max_size=5), surrogates),
    st.integers(min_value=2**63, max_value=2**200) | st.integers(min_value=-(2**200), max_value=-(2**63) - 1),
    st.just(float("nan")),
    st.integers(min_value=MAX_JSON_DEPTH + 1, max_value=MAX_JSON_DEPTH + 40).map(_deep_dict_value),
)


def _poisoned(base: dict[str, Any], slot: int, value: Any, extra: bool) -> dict[str, Any]:
    """`base` with one field's value replaced by `value`, or `value` under an extra key."""
    key = f"extra{slot}" if extra else sorted(base)[slot % len(base)]
    return {**base, key: value}


hostile_commands = st.builds(
    _poisoned, st.sampled_from(BASES), st.integers(min_value=0, max_value=10), poison, st.booleans()
)


def _hostile_line(message: dict[str, Any], digits: int) -> str:
    """The message as a JSON line; an integer outside int64 is written as a literal of `digits` digits."""
    shown = {
        k: HUGE if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX else v for k, v in message.items()
    }
    return json.dumps(shown).replace(json.dumps(HUGE), "9" * digits)


def _mutated(base: dict[str, Any], cut: int, insert: str) -> bytes:
    line = json.dumps(base)
    return (line[:cut] + insert + line[cut:]).encode("utf-8", "surrogatepass")


raw_lines = st.one_of(
    st.binary(max_size=64),
    st.text(st.characters(codec=None), max_size=64),
    st.builds(
        _mutated,
        st.sampled_from(READS),
        st.integers(min_value=0, max_value=60),
        st.binary(max_size=8).map(lambda b: b.decode("latin-1")) | surrogates,
    ),
    st.builds(_hostile_line, hostile_commands, st.sampled_from([25, 5000])),
)

Round = list[tuple[str, Any]]


def rounds(hostile: st.SearchStrategy[Any], kind: str) -> st.SearchStrategy[Round]:
    """5-15 messages: hostile ones of `kind` interleaved with valid reads."""
    return st.lists(
        st.tuples(st.just(kind), hostile) | st.tuples(st.just("valid"), st.sampled_from(READS)),
        min_size=5,
        max_size=15,
    )


class _Served:
    """One seeded runtime for a whole hypothesis run, and what it held before the first example."""

    def __init__(self, rt: Runtime, before: list[Any]) -> None:
        self.rt, self.before = rt, before
        self.messages = 0


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[_Served]:
    async with open_runtime(tmp_path / "fuzz.db", host=RecordingHost(), clock=FakeClock()) as rt:
        await register(rt, MINIMAL, "minimal.yml")
        await ok(
            rt,
            {
                "type": "add_participant",
                "workflow_id": WF,
                "step_id": "review",
                "role": "reviewer",
                "agent_profile_id": "rev-a",
            },
        )
        await ok(rt, {"type": "create_task", "task_id": "T1", "workflow_id": WF, "primary_agent_id": "w"})
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        yield _Served(rt, await snapshot(rt))


async def _play(served: _Served, steps: Round) -> None:
    rt = served.rt
    for kind, message in steps:
        reply = await rt.send(message)  # never raises: an escaping exception fails the test
        served.messages += 1
        if kind == "valid":
            assert reply.ok, reply.error
            continue
        encode(reply).encode("utf-8")  # a printable, encodable reply
        if kind == "dict":
            assert not reply.ok and reply.error.code == "invalid_message", (message, reply.error)
        else:  # a mutated read may still be a valid read
            assert reply.ok or reply.error.code != "internal", (message, reply.error)
    assert await snapshot(rt) == served.before
    assert [run["agent_profile_id"] for run in await list_runs(rt, task_id="T1")] == ["rev-a"]


async def _fuzz(served: _Served, strategy: st.SearchStrategy[Round], examples: int) -> None:
    """Run hypothesis in a worker thread, each example played on the one runtime through the Trio token."""
    import trio

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(steps: Round) -> None:
        trio.from_thread.run(_play, served, steps)

    await trio.to_thread.run_sync(run)
    assert served.messages >= examples * 5


async def test_fuzz_json_lines_never_raise_keep_serving_and_keep_state(served: _Served) -> None:
    """The JSON-line codec: raw bytes, arbitrary text (lone surrogates included), valid lines with bytes
    spliced in, poisoned lines with 25- and 5,000-digit literals — about 2,000 messages interleaved with
    valid reads. No exception escapes `send`, none is answered `internal`, the reads succeed, and the
    committed state equals the snapshot taken before the first message."""
    await _fuzz(served, rounds(raw_lines, "raw"), examples=200)


async def test_fuzz_dict_path_is_always_invalid_message_and_keeps_state(served: _Served) -> None:
    """The dict path: every command shape with one field (or an extra key) poisoned by a lone surrogate, an
    integer outside int64, NaN or nesting past MAX_JSON_DEPTH — each is `invalid_message`, nothing changes."""
    await _fuzz(served, rounds(hostile_commands, "dict"), examples=200)
