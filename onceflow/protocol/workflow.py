"""Workflow templates: the strict loader of a Kandev template, and the one import path of the template
format's public names. Pure (CPU-bound: the runtime parses on a worker thread).

Source: kandev-engine-notes.md, "Template format" (the files in shared/kandev-workflows/). The loader accepts
that format strictly: an unknown key anywhere is an error, every action type must be allowed for its trigger,
and the template checks (one start step, unique step ids and positions, existing `move_to_step` targets)
hold. onceflow adds two optional step keys, `wip_limit` and `pull_from_step_id`, so WIP promotion (entry path
E3, kandev-engine-notes.md, "WIP limits") can be declared.

Every problem is reported as a `WorkflowError` naming the source, the step id (when inside a step) and the
dotted field path; the error is the first problem found and its `others` hold the rest of what the same pass
found (`onceflow validate` prints them all), except that a template over a count limit (steps, actions
per trigger) is refused with the first count problem alone, found as the text is read: before the rest of it
is read, and before any step is validated. An unknown key or action type names the closest known one.
Scalars are not coerced (`position: "1"` and `mode: 5` are errors).

The parts live by concept, and this module re-exports their public names: `workflow_actions` (triggers,
allow-lists, action configs), `workflow_model` (steps, the workflow, its template checks),
`workflow_parse` (the strict YAML reader), `workflow_counts` (the count limits) and `workflow_validate`
(`WorkflowError`, a parsed template into a `Workflow`).
"""

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from onceflow.protocol.limits import MAX_TEMPLATE_BYTES
from onceflow.protocol.template.actions import (
    ALLOWED_ACTIONS,
    CONFIG_MODELS,
    ENGINE_ACTION_TYPES,
    HOST_ACTION_TYPES,
    IMPORT_ALLOWED_ACTIONS,
    QUEUE_TARGET_PATTERN,
    SESSION_ACTION_TYPES,
    THRESHOLD_PATTERN,
    TRANSITION_TYPES,
    ActionConfig,
    ActionDecl,
    ConfigureSessionConfig,
    ConfigureSessionRule,
    EmptyConfig,
    EnsureParticipantSeatConfig,
    MoveConfig,
    QueueRunConfig,
    QueueRunForEachParticipantConfig,
    QuorumCondition,
    QuorumGuard,
    RunCodeReviewConfig,
    RunPriority,
    SetSessionModeConfig,
    Trigger,
)
from onceflow.protocol.template.model import Step, StepEvents, Workflow, find_step, find_workflow
from onceflow.protocol.template.parse import OverCount, parse_yaml, yaml_problem
from onceflow.protocol.template.validate import WorkflowError, workflow_error, workflow_from_dict

__all__ = [
    "ALLOWED_ACTIONS",
    "CONFIG_MODELS",
    "ENGINE_ACTION_TYPES",
    "HOST_ACTION_TYPES",
    "IMPORT_ALLOWED_ACTIONS",
    "QUEUE_TARGET_PATTERN",
    "SESSION_ACTION_TYPES",
    "THRESHOLD_PATTERN",
    "TRANSITION_TYPES",
    "ActionConfig",
    "ActionDecl",
    "ConfigureSessionConfig",
    "ConfigureSessionRule",
    "EmptyConfig",
    "EnsureParticipantSeatConfig",
    "MoveConfig",
    "QueueRunConfig",
    "QueueRunForEachParticipantConfig",
    "QuorumCondition",
    "QuorumGuard",
    "RunCodeReviewConfig",
    "RunPriority",
    "SetSessionModeConfig",
    "Step",
    "StepEvents",
    "Trigger",
    "Workflow",
    "WorkflowError",
    "find_step",
    "find_workflow",
    "load_workflow_file",
    "load_workflow_text",
    "workflow_from_dict",
]


def load_workflow_text(
    text: str,
    source: str = "<string>",
    *,
    allowed_actions: Mapping[Trigger, frozenset[str]] = ALLOWED_ACTIONS,
) -> Workflow:
    """Parse YAML `text` (safe loader, repeated keys rejected) into a Workflow.

    Bounded: at most MAX_TEMPLATE_BYTES of UTF-8, no aliases, nesting at most MAX_YAML_DEPTH,
    payloads at most MAX_PAYLOAD_BYTES, at most MAX_TEMPLATE_STEPS steps; the cost is linear in the text
    (libyaml parses it when PyYAML has it, see `parse_yaml`). The count limits are checked first: with
    libyaml, each counted list as it ends while the text is read, so the first one broken is the refusal
    before the rest of the text is read; otherwise before any step is validated. CPU-bound: an async
    caller runs it in a worker thread.
    Raises WorkflowError (field '') when the text is too large, not valid YAML or not a mapping, and as
    workflow_from_dict does otherwise. Source: kandev-engine-notes.md, Template format.
    """
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_TEMPLATE_BYTES:
        raise WorkflowError(
            source, None, "", f"a template is at most {MAX_TEMPLATE_BYTES} bytes, not {len(encoded)}"
        )
    try:
        data = parse_yaml(text, encoded)
    except yaml.YAMLError as exc:
        raise WorkflowError(source, None, "", f"not valid YAML: {yaml_problem(exc)}") from exc
    except OverCount as over:
        raise workflow_error(over.data, source, [(over.loc, over.message)]) from None
    if not isinstance(data, Mapping):
        raise WorkflowError(source, None, "", f"the document must be a mapping, not {type(data).__name__}")
    return workflow_from_dict(data, source, allowed_actions=allowed_actions)


def load_workflow_file(
    path: str | os.PathLike[str],
    *,
    allowed_actions: Mapping[Trigger, frozenset[str]] = ALLOWED_ACTIONS,
) -> Workflow:
    """Read and load the template at `path` (UTF-8); the error source is the path as given.

    Raises WorkflowError as load_workflow_text does; OSError when the file cannot be read.
    """
    return load_workflow_text(
        Path(path).read_text(encoding="utf-8"), os.fspath(path), allowed_actions=allowed_actions
    )
