"""The commands about workflows: register a template, switch a task into another workflow, migrate a
workflow's live tasks to a version, list and read the registered ones. Pure: the wire, no thread.

The rules every command shares (unknown fields refused, bounded fields) are `commands.py`'s.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from onceflow.protocol.commands.fields import (
    BaseCommand,
    Id,
    Name,
)
from onceflow.protocol.limits import (
    ID_PATTERN,
    INT64_MAX,
    MAX_LIST_ITEMS,
    MAX_SOURCE_CHARS,
    MAX_TEMPLATE_BYTES,
)


class RegisterWorkflow(BaseCommand):
    """Register (or replace) a workflow from template YAML text; `source` names it in errors."""

    type: Literal["register_workflow"] = "register_workflow"
    """The command name."""
    yaml: Annotated[str, Field(max_length=MAX_TEMPLATE_BYTES)]
    """The template, as YAML text (the workflow template format; `onceflow schema --template` is its JSON
    Schema)."""
    source: Annotated[str, Field(min_length=1, max_length=MAX_SOURCE_CHARS, pattern=ID_PATTERN)] = (
        "<protocol>"
    )
    """A label for the template (usually its path); errors name it."""
    import_path: bool = False
    """Accept the import path's extra action types (run_code_review and configure_session under on_enter,
    transitions under the event triggers); templates otherwise get the strict allow-lists."""


class SwitchWorkflow(BaseCommand):
    """Move the task into another workflow at `step_id` (default: its start step): entry path E4."""

    type: Literal["switch_workflow"] = "switch_workflow"
    """The command name."""
    task_id: Id
    """The task to move."""
    workflow_id: Id
    """The registered workflow it moves into."""
    step_id: Name | None = None
    """The step it lands at; None: the workflow's start step."""
    operation_id: Name | None = None
    """The host's id of this switch: a redelivery with the same id does nothing (`idempotent`)."""


class MigrateTasks(BaseCommand):
    """Move the live tasks of a workflow onto version `to_version` of it. Validated first: every task's step
    must map to a step of that version (`step_map`, else the same id when the version still has it), or
    nothing is done and the error names the unmapped steps and tasks. `dry_run` answers the plan without
    committing. Else each task is migrated in its own transaction: its runs of the mapped step whose agent
    the new step still queues for are kept (moved with it), the others cancelled (`migrated`); its seats and
    the round's decisions move with their step; an open step entry is closed as `migrated` with no second
    fan-out, unless `enter` asks for the new step's on_enter (a new entry, path E4). A task already on
    `to_version` is left alone, so a replay (or a retry after a crash) changes nothing it did. Result
    `{workflow_id, to_version, dry_run, tasks: [{task_id, from_version, from_step, to_step, runs_kept,
    runs_cancelled, seats_moved, entry}], skipped}`."""

    type: Literal["migrate_tasks"] = "migrate_tasks"
    """The command name."""
    workflow_id: Id
    """The workflow whose tasks move."""
    to_version: Annotated[int, Field(ge=1, le=INT64_MAX)]
    """The registered version they move to (`register_workflow`'s `version`)."""
    step_map: Annotated[dict[Id, Id], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=dict)
    """Old step id -> step id of `to_version`; a step `to_version` still has maps to itself unless mapped."""
    task_ids: Annotated[list[Id], Field(max_length=MAX_LIST_ITEMS)] | None = None
    """Only these tasks (each must be a task of the workflow); None: every task not on `to_version`."""
    dry_run: bool = False
    """Answer the plan, commit nothing."""
    enter: bool = False
    """Run the new step's on_enter for each migrated task whose step entry was open (path E4)."""
    operation_id: Name | None = None
    """An operation id: once the whole migration applied, a replay answers `idempotent`."""


class ListWorkflows(BaseCommand):
    """Every registered workflow: `{workflows: [{workflow_id, versions, newest, live_tasks_by_version}]}`
    (`live_tasks_by_version`: version as text -> how many tasks are pinned to it)."""

    type: Literal["list_workflows"] = "list_workflows"
    """The command name."""


class GetWorkflow(BaseCommand):
    """One version of a workflow as registered: `{workflow_id, version, yaml, sha256}`."""

    type: Literal["get_workflow"] = "get_workflow"
    """The command name."""
    workflow_id: Id
    """A registered workflow."""
    version: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    """Its version; None: the newest."""
