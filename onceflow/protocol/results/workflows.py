"""What the workflow commands return: a registered version (with its lint warnings), the registered
workflows and one's text, a switch, a migration's plan or work. Pure: no thread.

Each is a result typed dict (`result_base.py`); `results.py` maps each command type to its result.
"""

from __future__ import annotations

from typing import Literal

from typing_extensions import TypedDict

from onceflow.protocol.results.base import as_result


@as_result
class WorkflowRegistered(TypedDict):
    """`register_workflow`: the workflow's id, its steps, the version this text is, and what it means for
    the live tasks (they stay on their version until `migrate_tasks`)."""

    workflow_id: str
    """The registered workflow."""
    steps: list[str]
    """Its step ids, in position order."""
    version: int
    """The version this text is (1, 2, ...); the newest's text again is the same version."""
    changed: bool
    """False when the text was the newest version's already: nothing was stored."""
    live_tasks_by_version: dict[str, int]
    """Version (as text) -> how many tasks are pinned to it."""
    warnings: list[LintWarningInfo]
    """The template lint's warnings (`onceflow validate`), then one per step of the previous version that
    this one lacks and that holds live tasks (`step_removed`, `step_renamed`), naming it."""


@as_result
class LintWarningInfo(TypedDict):
    """One warning about a template (protocol/template/lint.py)."""

    code: str
    """unreachable_step, no_way_out, start_on_enter, quorum_role_unseated, fan_out_without_participants,
    step_removed or step_renamed."""
    step_id: str | None
    """The step it is about."""
    message: str
    """What is wrong, naming the step."""


@as_result
class WorkflowSummary(TypedDict):
    """A registered workflow in `list_workflows`."""

    workflow_id: str
    """The workflow."""
    versions: list[int]
    """Its versions, oldest first."""
    newest: int
    """Its newest version: what new tasks get."""
    live_tasks_by_version: dict[str, int]
    """Version (as text) -> how many tasks are pinned to it."""


@as_result
class WorkflowList(TypedDict):
    """`list_workflows`."""

    workflows: list[WorkflowSummary]
    """Every registered workflow, by id."""


@as_result
class WorkflowText(TypedDict):
    """`get_workflow`: one version as registered."""

    workflow_id: str
    """The workflow."""
    version: int
    """The version."""
    yaml: str
    """Its template text, as registered."""
    sha256: str
    """The hex SHA-256 of that text (UTF-8)."""


@as_result
class TaskMigration(TypedDict):
    """One task of a `migrate_tasks` plan (or of what it did)."""

    task_id: str
    """The task."""
    from_version: int
    """The version it was on."""
    from_step: str
    """Its step there."""
    to_step: str
    """Its step in the target version."""
    runs_kept: list[int]
    """Its queued and claimed runs that move with it (their agent is still queued for by the new step)."""
    runs_cancelled: list[int]
    """Its queued and claimed runs cancelled with reason `migrated`."""
    seats_moved: int
    """Its seats (own ones, and template-level ones copied to it) moved to the new step."""
    entry: Literal["none", "closed", "entered"]
    """Its open step entry: none, closed as `migrated`, or closed and the new step entered (`enter`)."""


@as_result
class MigrationResult(TypedDict):
    """`migrate_tasks`: the plan (`dry_run`) or what was done, per task."""

    workflow_id: str
    """The workflow."""
    to_version: int
    """The target version."""
    dry_run: bool
    """True: nothing was committed."""
    tasks: list[TaskMigration]
    """One per task migrated (or to migrate), in task-id order."""
    skipped: list[str]
    """Tasks named in `task_ids` already on `to_version`, or ones migrated meanwhile: left alone."""


@as_result
class WorkflowSwitched(TypedDict):
    """`switch_workflow` that entered a step."""

    moved: bool
    """Whether the task changed step (false: the move was abandoned)."""
    workflow_id: str
    """The workflow switched to."""
    step_id: str
    """The step entered."""
    operation_id: str | None
    """The switch's operation id, or None without one."""
