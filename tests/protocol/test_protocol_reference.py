"""A reference a user can read: described models, docs/protocol.md in sync, public names.

`onceflow schema` documents itself (every field has a description), docs/protocol.md is exactly what the
generator makes of the models, and a host finds what it needs in `onceflow` and `onceflow.protocol`.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from helpers import REPO

import onceflow
import onceflow.protocol
from onceflow.cli import reference
from onceflow.cli.main import main
from onceflow.protocol import errors, limits
from onceflow.protocol.codec import command_schema
from onceflow.protocol.commands import COMMAND_TYPES
from onceflow.protocol.events import Event
from onceflow.protocol.template.schema import template_schema

EVENT_TYPES = typing.get_args(typing.get_args(Event)[0])


def models_in(schema: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every object schema with properties: the root (if it is one) and each of `$defs` (`definitions` in
    the draft-07 template schema)."""
    if "properties" in schema:
        yield schema.get("title", "<root>"), schema
    yield from schema.get("$defs", {}).items()
    yield from schema.get("definitions", {}).items()


def undescribed(schema: Mapping[str, Any]) -> list[str]:
    missing = []
    for name, model in models_in(schema):
        if not model.get("description"):
            missing.append(name)
        missing += [
            f"{name}.{field}" for field, prop in model["properties"].items() if not prop.get("description")
        ]
    return missing


def test_every_command_event_reply_and_result_field_is_described() -> None:
    """Every model and field `onceflow schema` prints (commands, events, reply, each command's result) and
    every key of the template schema carries a description."""
    printed = command_schema()
    sections = [printed["command"], printed["event"], printed["reply"], *printed["results"].values()]
    assert [name for section in sections for name in undescribed(section)] == []
    template = template_schema()
    assert len(template["definitions"]) > 20 and undescribed(template) == []


def test_schema_keeps_the_bounds_beside_the_descriptions() -> None:
    """Descriptions were added without losing a bound (limits.py's Id, Text and Int64 types)."""
    defs = command_schema()["command"]["$defs"]
    task_id = defs["CreateTask"]["properties"]["task_id"]
    assert task_id["maxLength"] == limits.MAX_ID_CHARS and task_id["pattern"] == limits.ID_PATTERN
    assert task_id["description"]
    [unix] = [o for o in defs["Heartbeat"]["properties"]["unix"]["anyOf"] if o["type"] == "integer"]
    assert (unix["minimum"], unix["maximum"]) == (limits.INT64_MIN, limits.INT64_MAX)
    assert defs["RecordDecision"]["properties"]["comment"]["maxLength"] == limits.MAX_TEXT_CHARS


def test_docs_protocol_md_is_in_sync_with_the_models() -> None:
    committed = (REPO / reference.PAGE).read_text(encoding="utf-8")
    generated = reference.render()
    if committed != generated:
        diff = "".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(keepends=True),
                    generated.splitlines(keepends=True),
                    reference.PAGE,
                    "generated",
                )
            )[:40]
        )
        pytest.fail(f"{reference.PAGE} is out of date; regenerate it with `{reference.REGENERATE}`\n{diff}")


def test_schema_markdown_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == reference.render()


def test_import_path_goes_with_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--import-path"]) == 2
    assert "--import-path goes with --template" in capsys.readouterr().err


def all_error_codes() -> set[str]:
    """The code of every OnceflowError class loaded (with the server's), and every storage kind's."""
    import onceflow.serve  # noqa: F401  (its error class registers as a subclass)

    seen: set[str] = set()
    stack = [errors.OnceflowError]
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        seen.add(cls.code)
    seen -= {"error", errors.OnceflowError.code}
    return seen | {f"storage_{kind}" for kind in typing.get_args(errors.StorageKind)} | {"internal"}


def test_reference_page_lists_commands_events_error_codes_and_limits() -> None:
    page = reference.render()
    for model in (*COMMAND_TYPES, *EVENT_TYPES):
        assert f"### `{model.model_fields['type'].default}`" in page, model.__name__
    rows = dict(re.findall(r"^\| `(\w+)` \| (yes|no) \|", page, flags=re.MULTILINE))
    assert set(rows) == all_error_codes()
    assert rows["storage_busy"] == rows["storage_full"] == rows["busy"] == "yes"
    assert rows["storage_corrupt"] == rows["storage_read_only"] == rows["not_found"] == "no"
    for name in (
        "MAX_ID_CHARS",
        "MAX_TEXT_CHARS",
        "MAX_MESSAGE_BYTES",
        "MAX_LIST_ITEMS",
        "MAX_TEMPLATE_BYTES",
    ):
        assert re.search(rf"^\| `{name}` \| {getattr(limits, name):,} \| \w", page, flags=re.MULTILINE), name
    assert "| `task_id` | string (1 to 256 characters, no control characters) | required |" in page


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_the_reference_page_has_its_section() -> None:
    page = reference.render()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", page, flags=re.MULTILINE)}
    links = set(re.findall(r"\]\(#([^)]+)\)", page))
    assert links and links <= anchors, sorted(links - anchors)


def test_onceflow_exports_what_a_host_needs() -> None:
    """Host, Coordinator, the outcome types, every command and event model, Reply, ErrorInfo and the
    errors come from `onceflow` itself, as the very objects the protocol uses."""
    wanted = [
        *COMMAND_TYPES,
        *EVENT_TYPES,
        onceflow.protocol.Reply,
        onceflow.protocol.ErrorInfo,
        onceflow.protocol.OutcomeEnvelope,
        onceflow.protocol.OutcomeDelivery,
        onceflow.protocol.OutcomeDeliveryRequest,
        onceflow.protocol.OutcomeAcknowledgement,
        onceflow.protocol.ChildRow,
        *(
            cls
            for cls in vars(errors).values()
            if isinstance(cls, type) and issubclass(cls, errors.OnceflowError)
        ),
    ]
    for obj in wanted:
        assert getattr(onceflow, obj.__name__) is obj, obj.__name__
        assert obj.__name__ in onceflow.__all__
    for name in ("Host", "Coordinator", "RecordingHost", "open_runtime", "Runtime", "Command", "Event"):
        assert name in onceflow.__all__
    assert sorted(onceflow.__all__) == sorted(set(onceflow.__all__))
    assert all(hasattr(onceflow, name) for name in onceflow.__all__)


def test_onceflow_protocol_exports_the_models() -> None:
    protocol = onceflow.protocol
    assert len(protocol.__all__) > 50 and all(hasattr(protocol, name) for name in protocol.__all__)
    for model in (*COMMAND_TYPES, *EVENT_TYPES):
        assert getattr(protocol, model.__name__) is model
    reply = protocol.Reply(command="get_task", ok=True, result={"task_id": "T-1"} | TASK_FIELDS)
    assert protocol.result_of(reply) == protocol.TaskInfo(task_id="T-1", **TASK_FIELDS)  # type: ignore[typeddict-item]


TASK_FIELDS = {
    "workflow_id": "w",
    "step_id": "s",
    "title": "",
    "session_id": None,
    "primary_agent_id": None,
    "ceo_agent_id": None,
    "priority": "medium",
    "wip_admitted": True,
    "queued_for_step_id": None,
    "workflow_version": 1,
}


SOURCE_CITATION = re.compile(
    r"(?<!docs/)(?<!\]\()\b[\w-]+\.md\b"  # a spec file name (docs/ and links are a user's pages)
    r"|\bAC-[A-Z]+(?:-[A-Z]+)?-?\d+\b"  # an acceptance-criterion id
    r"|\bissue\s*#?\d+|#\d+\b",  # an issue number
    flags=re.IGNORECASE,
)


def descriptions(node: Any) -> Iterator[str]:
    """Every `description` string anywhere in a JSON Schema."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                yield value
            else:
                yield from descriptions(value)
    elif isinstance(node, list):
        for item in node:
            yield from descriptions(item)


def test_schema_descriptions_say_what_a_field_does_not_where_its_rule_came_from() -> None:
    """What a user reads (`onceflow schema`, `schema --template` with and without the import path, and
    docs/protocol.md) names no spec file, acceptance-criterion id or issue number: they cite material a
    user does not have."""
    shown = [
        *descriptions(command_schema()),
        *descriptions(template_schema()),
        *descriptions(template_schema(import_path=True)),
        reference.render(),
    ]
    cited = sorted({match.group(0) for text in shown for match in SOURCE_CITATION.finditer(text)})
    assert cited == []
    assert SOURCE_CITATION.search("see kandev-engine-notes.md") and SOURCE_CITATION.search("(AC-CO-3)")
    assert SOURCE_CITATION.search("(AC-E3)") and not SOURCE_CITATION.search("docs/templates.md")
    assert not SOURCE_CITATION.search("[the guide](templates.md)")


def test_the_reference_page_describes_the_socket_framing_with_the_servers_own_bounds() -> None:
    """docs/protocol.md says how `onceflow serve` frames lines (request ids, replies, events with their
    seqs after `subscribe`, the gap line of a resume, connection errors) and states the id and line limits
    the server enforces, and the event window."""
    from onceflow.serve import MAX_ID_LENGTH, ServeOptions

    page = reference.render()
    section = page.split("## Over a socket: framing and ids", 1)[1].split("\n## ", 1)[0]
    for frame in (
        '{"id": <the request\'s id>, "reply": <Reply>}',
        '{"event_seq": <int>, "event": <Event>}',
        '{"gap": {"after": <int>, "next": <int>}}',
        '{"error": <ErrorInfo>}',
    ):
        assert frame in section
    assert '{"type": "subscribe"}' in section and '{"type": "subscribe", "after": N}' in section
    words = " ".join(section.split())
    assert "its last 10,000 events, `--event-window`" in words and '`field: "after"`' in words
    assert f"a string of at most {MAX_ID_LENGTH} characters or an integer in the signed" in section
    assert f"A request line is at most {ServeOptions().max_line:,} bytes" in section
    assert ServeOptions().max_line == limits.MAX_MESSAGE_BYTES
