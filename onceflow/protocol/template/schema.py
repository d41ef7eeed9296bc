"""The JSON Schema of the workflow template format, for an editor's YAML language server. Pure.

Generated from the loader's models (`workflow_model.py`), then sharpened where the loader checks more than the
models' types say: each action is one variant per action type (`type` a constant, `config` that type's model,
required when the model has required keys; move_to_step needs a non-empty `step_id`, the other moves take
none), each trigger's list admits only its allowed types, and a move gives its guard one way, not both.
What JSON Schema cannot express is left to the loader (`onceflow validate`): step ids and positions unique,
exactly one start step, move_to_step targets and pull_from_step_id naming steps of the workflow, no feeder
cycles, a payload's 64 KiB, repeated YAML keys and aliases. Every template the loader accepts validates
against it.

It is written in JSON Schema draft-07, the dialect the YAML language server (redhat-developer's, used by VS
Code and other editors) ships with; it warns on 2020-12 schemas. So the models' `$defs` become
`definitions`, and a `$ref` with sibling keywords (ignored beside `$ref` in draft-07) is wrapped in an
`allOf`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onceflow.protocol.template.actions import (
    ALLOWED_ACTIONS,
    CONFIG_MODELS,
    IMPORT_ALLOWED_ACTIONS,
    TRANSITION_TYPES,
    Trigger,
)
from onceflow.protocol.template.model import Workflow

DIALECT = "http://json-schema.org/draft-07/schema#"
_REFS = "#/definitions/"


def template_schema(*, import_path: bool = False) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) a template must satisfy; with `import_path`, the import path's
    allow-lists (`register_workflow.import_path`) instead of the templates' own."""
    allowed = IMPORT_ALLOWED_ACTIONS if import_path else ALLOWED_ACTIONS
    schema = Workflow.model_json_schema(mode="validation", ref_template=_REFS + "{model}")
    defs: dict[str, Any] = schema.pop("$defs")
    generic = defs.pop("ActionDecl")
    for kind, model in sorted(CONFIG_MODELS.items()):
        defs[_action_name(kind)] = _action(kind, defs[model.__name__], generic)
    events = defs["StepEvents"]["properties"]
    for trigger in Trigger:
        kinds = sorted(allowed.get(trigger, frozenset()))
        events[trigger.value]["items"] = {"anyOf": [{"$ref": _REFS + _action_name(k)} for k in kinds]}
    defs["MoveConfig"]["not"] = {  # a guard given both ways (null counts as absent, as in the loader)
        "required": ["wait_for_quorum", "if"],
        "properties": {"wait_for_quorum": {"type": "object"}, "if": {"type": "object"}},
    }
    flavour = "the import path's" if import_path else "templates'"
    return {
        "$schema": DIALECT,
        **_draft7(schema),
        "title": "onceflow workflow template",
        "description": f"{schema['description']}\n\nAction types follow {flavour} per-trigger allow-lists.",
        "definitions": _draft7(defs),
    }


def _draft7(node: Any) -> Any:
    """`node` with every `$ref` that has sibling keywords wrapped in an `allOf` (draft-07 ignores them)."""
    if isinstance(node, list):
        return [_draft7(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _draft7(value) for key, value in node.items()}
    if "$ref" in converted and len(converted) > 1:
        return {"allOf": [{"$ref": converted.pop("$ref")}], **converted}
    return converted


def _action_name(kind: str) -> str:
    return "Action_" + kind


def _action(kind: str, config_model: Mapping[str, Any], generic: Mapping[str, Any]) -> dict[str, Any]:
    """One action type's variant: `{type: <kind>, config: <its model>}`."""
    ref: dict[str, Any] = {"$ref": _REFS + config_model["title"]}
    needs_config = bool(config_model.get("required"))
    if kind == "move_to_step":
        config = {
            "allOf": [
                ref,
                {"required": ["step_id"], "properties": {"step_id": {"type": "string", "minLength": 1}}},
            ]
        }
        needs_config = True
    elif kind in TRANSITION_TYPES:
        config = {"allOf": [ref, {"properties": {"step_id": {"type": "null"}}}]}
    else:
        config = ref
    if not needs_config:
        config = {"anyOf": [config, {"type": "null"}]}
    properties = generic["properties"]
    return {
        "title": kind,
        "description": f"Action `{kind}`; its config: {config_model['title']}.",
        "type": "object",
        "properties": {
            "type": {"const": kind, "description": properties["type"]["description"]},
            "config": {**config, "description": properties["config"]["description"]},
        },
        "required": ["type", "config"] if needs_config else ["type"],
        "additionalProperties": False,
    }
