"""`onceflow schema --template`: the template format's JSON Schema, for an editor.

Checked with the `jsonschema` package, as a YAML language server would use it: every fixture template
validates, and for a table of edits the schema and the loader agree (both accept, or both refuse).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helpers import REPO

from onceflow.cli.main import main
from onceflow.protocol.template.schema import template_schema
from onceflow.protocol.workflow import (
    ALLOWED_ACTIONS,
    CONFIG_MODELS,
    IMPORT_ALLOWED_ACTIONS,
    Trigger,
    WorkflowError,
    load_workflow_text,
)

BASE: dict[str, Any] = {
    "id": "board",
    "name": "Board",
    "steps": [
        {
            "id": "work",
            "name": "Work",
            "position": 0,
            "is_start_step": True,
            "events": {
                "on_enter": [{"type": "auto_start_agent"}],
                "on_turn_complete": [{"type": "move_to_next"}],
            },
        },
        {
            "id": "review",
            "name": "Review",
            "position": 1,
            "events": {
                "on_turn_complete": [
                    {
                        "type": "move_to_step",
                        "config": {
                            "step_id": "work",
                            "wait_for_quorum": {"role": "reviewer", "threshold": "any_reject"},
                        },
                    }
                ]
            },
        },
    ],
}


def validator(*, import_path: bool = False) -> jsonschema.Draft7Validator:
    schema = template_schema(import_path=import_path)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def edited(path: str, value: Any) -> dict[str, Any]:
    """BASE with the value at a dotted path (`steps.1.events.on_enter`) set; `...` deletes the key."""
    data = copy.deepcopy(BASE)
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    node: Any = data
    for part in parents:
        node = node[part]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


def loads(data: dict[str, Any], *, import_path: bool = False) -> bool:
    allowed = {"allowed_actions": IMPORT_ALLOWED_ACTIONS} if import_path else {}
    try:
        load_workflow_text(yaml.safe_dump(data), "edited.yml", **allowed)
    except WorkflowError:
        return False
    return True


def test_every_fixture_template_validates_against_the_template_schema(kandev_templates: Path) -> None:
    files = [
        *sorted(kandev_templates.glob("*.yml")),
        *sorted((REPO / "tests" / "fixtures" / "workflows").glob("*.yml")),
        *sorted((REPO / "onceflow" / "examples").glob("*.yml")),
    ]
    assert len(files) >= 8
    check = validator()
    for path in files:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert [error.message for error in check.iter_errors(data)] == [], path.name


MOVE = "steps.1.events.on_turn_complete.0"
GUARD = {"role": "reviewer", "threshold": "all_approve"}


@pytest.mark.parametrize(
    ("path", "value", "valid"),
    [
        ("description", "fine", True),
        ("steps.0.stage_type", "", True),  # empty means custom
        ("steps.0.stage_type", None, True),
        ("steps.0.stage_type", "qa", False),
        ("steps.0.position", "0", False),  # scalars are not coerced
        ("steps.0.postion", 0, False),  # an unknown key (a typo)
        ("owner", "me", False),  # an unknown top-level key
        ("name", ..., False),
        ("steps.0.events.on_enter.0", {"type": "auto_start_agent", "config": None}, True),
        ("steps.0.events.on_enter.0", {"type": "auto_start_agent", "config": {"x": 1}}, False),
        ("steps.0.events.on_enter.0", {"type": "move_to_next"}, False),  # not allowed on_enter
        ("steps.0.events.on_enter.0", {"type": "run_code_review"}, False),  # import path only
        ("steps.0.events.on_enter.0", {"type": "launch_rockets"}, False),
        ("steps.0.events.on_enter.0", {"config": {}}, False),  # no type
        ("steps.0.events.on_enter.0", {"type": "set_session_mode"}, False),  # mode is required
        ("steps.0.events.on_enter.0", {"type": "set_session_mode", "config": {"mode": ""}}, False),
        ("steps.0.events.on_enter.0", {"type": "set_session_mode", "config": {"mode": "plan"}}, True),
        ("steps.0.events.on_enter.0", {"type": "queue_run", "config": {"target": "everyone"}}, False),
        (
            "steps.0.events.on_enter.0",
            {"type": "queue_run", "config": {"target": "participant_role:qa"}},
            True,
        ),
        ("steps.0.events.on_enter.0", {"type": "queue_run", "config": {"payload": {"k": [1]}}}, True),
        (
            "steps.0.events.on_turn_complete.0",
            {"type": "move_to_next", "config": {"step_id": "review"}},
            False,
        ),
        (MOVE, {"type": "move_to_step"}, False),  # step_id is required
        (MOVE, {"type": "move_to_step", "config": {"step_id": ""}}, False),
        (
            MOVE,
            {"type": "move_to_step", "config": {"step_id": "work", "if": {"wait_for_quorum": GUARD}}},
            True,
        ),
        (
            MOVE,
            {"type": "move_to_step", "config": {"step_id": "work", "wait_for_quorum": GUARD} | {"if": None}},
            True,
        ),
        (
            MOVE,
            {
                "type": "move_to_step",
                "config": {"step_id": "work", "wait_for_quorum": GUARD, "if": {"wait_for_quorum": GUARD}},
            },
            False,
        ),
        (f"{MOVE}.config.wait_for_quorum.threshold", "n_approve:2", True),
        (f"{MOVE}.config.wait_for_quorum.threshold", "n_approve:0", False),
        (f"{MOVE}.config.wait_for_quorum.threshold", "most", False),
        (f"{MOVE}.config.wait_for_quorum.role", ..., False),  # a guard needs both keys
        ("steps.0.wip_limit", 2, True),
        ("steps.0.wip_limit", 2**63, False),  # beyond int64
        ("steps.0.id", "a\nb", False),  # control characters
        ("steps.0.id", "x" * 257, False),
    ],
)
def test_template_schema_and_loader_agree(path: str, value: Any, valid: bool) -> None:
    """An edit the loader refuses is flagged by the schema (what an editor underlines), and one it accepts
    is not."""
    data = edited(path, value)
    assert loads(data) is valid
    assert validator().is_valid(data) is valid


def test_template_schema_for_the_import_path_admits_its_extra_actions() -> None:
    data = edited(
        "steps.0.events.on_enter.0", {"type": "run_code_review", "config": {"agent_profile_id": "bot"}}
    )
    assert loads(data, import_path=True) and validator(import_path=True).is_valid(data)
    assert not loads(data) and not validator().is_valid(data)


def test_schema_template_prints_the_template_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--template"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(template_schema()))
    assert printed["$schema"] == "http://json-schema.org/draft-07/schema#"  # what YAML language servers speak
    assert "$defs" not in json.dumps(printed)
    assert printed["properties"]["steps"]["maxItems"] == 1000
    assert main(["schema", "--template", "--import-path"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(template_schema(import_path=True)))


MINIMAL_CONFIG: dict[str, dict[str, Any]] = {
    "move_to_step": {"step_id": "work"},
    "set_session_mode": {"mode": "plan"},
    "ensure_participant_seat": {"role": "reviewer"},
    "configure_session": {"rules": [{"agent_name": "a", "operation": "keep"}]},
}


@pytest.mark.parametrize("import_path", [False, True])
def test_template_schema_allows_each_action_type_exactly_where_the_loader_does(
    import_path: bool,
) -> None:
    """Every action type under every trigger: the schema's per-trigger allow-lists are the loader's."""
    check = validator(import_path=import_path)
    for trigger in Trigger:
        for kind in sorted(CONFIG_MODELS):
            action = {"type": kind, **({"config": MINIMAL_CONFIG[kind]} if kind in MINIMAL_CONFIG else {})}
            data = edited("steps.1.events", {trigger.value: [action]})
            verdict = loads(data, import_path=import_path)
            assert verdict == (kind in (IMPORT_ALLOWED_ACTIONS if import_path else ALLOWED_ACTIONS)[trigger])
            assert check.is_valid(data) is verdict, (trigger.value, kind)
