"""Workflow versions, runtime side: registering a version, loading them at start-up, reading them
(`list_workflows`, `get_workflow`, `list_participants`) and migrating tasks between them (`migrate_tasks`).
Trio thread: every database effect is a store request (store/tasks/workflows.py,
store/tasks/task_migration.py).
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio

from onceflow.actors.kernel.services import Services, WorkflowRegistry
from onceflow.actors.task.migrate import MigrateTask
from onceflow.observability.logs import get_logger
from onceflow.protocol import commands as c
from onceflow.protocol.errors import ConflictError, NotFoundError, WorkflowInvalidError
from onceflow.protocol.results import (
    AlreadyApplied,
    LintWarningInfo,
    MigrationResult,
    ParticipantInfo,
    ParticipantList,
    TaskMigration,
    WorkflowList,
    WorkflowRegistered,
    WorkflowSummary,
    WorkflowText,
)
from onceflow.protocol.template.lint import changes, lint
from onceflow.protocol.workflow import (
    ALLOWED_ACTIONS,
    IMPORT_ALLOWED_ACTIONS,
    Workflow,
    WorkflowError,
    load_workflow_text,
)
from onceflow.store.entries import participants
from onceflow.store.records import TaskRecord
from onceflow.store.tasks import task_migration, workflows
from onceflow.store.tasks.task_migration import TaskPlan
from onceflow.store.tasks.workflows import StoredWorkflow

log = get_logger("onceflow.versions")

MAX_UNMAPPED_SHOWN = 20
"""A refused migration names at most this many unmapped tasks per step (and says how many more)."""


class Versioned(Protocol):
    """What registering and migrating need of the runtime: its services, a reconfiguration with new
    workflows, and a message to a task's actor."""

    @property
    def services(self) -> Services: ...

    def reconfigure(self, *, workflows: WorkflowRegistry | None = None) -> None: ...

    async def ask_task(self, task_id: str, message: MigrateTask) -> object: ...


def parse(stored: StoredWorkflow) -> Workflow:
    """The template `stored` holds (with the import path's wider allow-list when it was registered so).
    Raises WorkflowInvalidError (field: the offending field)."""
    allowed = IMPORT_ALLOWED_ACTIONS if stored.import_path else ALLOWED_ACTIONS
    try:
        return load_workflow_text(stored.definition, stored.source, allowed_actions=allowed)
    except WorkflowError as exc:
        raise WorkflowInvalidError(str(exc), field=exc.field or None) from None


async def register_workflow(
    runtime: Versioned, text: str, source: str, *, import_path: bool = False
) -> WorkflowRegistered:
    """Validate and persist a template as the next version of its workflow (the newest's text again: the
    same version, nothing stored) and load it: a reconfiguration (the ledger is kept:
    operation-ledger-lifetime.md AC-L1). Tasks stay on their versions; new tasks get this one. The reply
    carries the lint's warnings and one per step of the previous newest version this one lacks that
    holds live tasks. The text is parsed on a worker thread. Raises WorkflowInvalidError (`field` names the
    offending field); a cancellation during the parse leaves nothing stored."""
    stored = StoredWorkflow("", source, text, import_path)
    workflow = await trio.to_thread.run_sync(parse, stored)
    services = runtime.services
    stored = attrs.evolve(stored, workflow_id=workflow.id)
    previous = services.workflows.workflows.get(workflow.id)
    saved = await services.store.transact(
        workflows.save_workflow,
        workflow_id=workflow.id,
        name=workflow.name,
        stored=stored,
        now=services.now(),
    )
    counts, steps = await services.store.transact(workflows.live_counts, workflow.id)
    registry = services.workflows.copy()
    registry.put(workflow, saved.version)
    runtime.reconfigure(workflows=registry)
    found = lint(workflow)
    if previous is not None and saved.changed:
        found += changes(previous, workflow, steps)
    for warning in found:
        if warning.code in ("step_removed", "step_renamed"):
            log.warning(
                "workflow_step_dropped", workflow_id=workflow.id, step_id=warning.step_id, code=warning.code
            )
    return WorkflowRegistered(
        workflow_id=workflow.id,
        steps=[step.id for step in workflow.ordered_steps],
        version=saved.version,
        changed=saved.changed,
        live_tasks_by_version=counts,
        warnings=[LintWarningInfo(code=w.code, step_id=w.step_id, message=w.message) for w in found],
    )


async def load_workflows(services: Services) -> None:
    """Load every stored version a start needs (store/tasks/workflows.py `all_workflows`): the newest of each
    workflow and those tasks are pinned to. One that no longer validates is logged at ERROR and left out
    (its tasks answer not_found until migrated)."""
    for stored in await services.store.transact(workflows.all_workflows):
        try:
            services.workflows.put(await trio.to_thread.run_sync(parse, stored), stored.version)
        except WorkflowInvalidError as exc:
            log.error(
                "stored_workflow_invalid",
                workflow_id=stored.workflow_id,
                version=stored.version,
                cause=exc.message,
            )


async def _version(runtime: Versioned, workflow_id: str, version: int) -> Workflow:
    """Version `version` of the workflow, loaded into the registry when it was not (a reconfiguration).
    Raises NotFoundError (field to_version) when it was never registered."""
    services = runtime.services
    loaded = services.workflows.versions.get((workflow_id, version))
    if loaded is not None:
        return loaded
    stored = await services.store.transact(workflows.get_version, workflow_id, version)
    if stored is None:
        raise NotFoundError(f"workflow {workflow_id!r} has no version {version}", field="to_version")
    workflow = await trio.to_thread.run_sync(parse, stored)
    registry = runtime.services.workflows.copy()
    registry.put(workflow, version)
    runtime.reconfigure(workflows=registry)
    return workflow


async def migrate_tasks(runtime: Versioned, command: c.MigrateTasks) -> MigrationResult | AlreadyApplied:
    """`migrate_tasks` (protocol/commands.py states the rules). Validated before anything is written: the
    target version exists (NotFoundError, field to_version), every `step_map` value is one of its steps
    (NotFoundError, field step_map), every task's step (and queued-for step) maps (ConflictError, field
    step_map, naming the unmapped steps and their tasks). Then each task is migrated by its own actor, in
    its own transaction, in task-id order; the operation id is marked once all are. A cancellation leaves
    the tasks migrated so far migrated (each wholly) and the operation unmarked: a replay migrates the
    rest."""
    services = runtime.services
    op = command.operation_id or ""
    if op and await services.ledger.is_applied(op):
        return AlreadyApplied(idempotent=True, operation_id=op)
    if command.workflow_id not in services.workflows.workflows:
        raise NotFoundError(f"workflow {command.workflow_id!r} is not registered", field="workflow_id")
    target = await _version(runtime, command.workflow_id, command.to_version)
    step_ids = [step.id for step in target.ordered_steps]
    wrong = sorted(new for new in command.step_map.values() if new not in step_ids)
    if wrong:
        raise NotFoundError(
            f"step_map maps to {wrong}, not steps of {command.workflow_id!r} version {command.to_version}"
            f" (its steps: {step_ids})",
            field="step_map",
        )
    todo, skipped = await services.store.transact(
        task_migration.tasks_to_migrate, command.workflow_id, command.to_version, command.task_ids
    )
    _check_mapped(command, todo, step_ids)
    if command.dry_run:
        plans = await services.store.transact(
            task_migration.plan_all,
            todo,
            {step.id: step for step in target.steps},
            command.step_map,
            command.enter,
        )
        return _result(command, plans, skipped)
    done: list[TaskPlan] = []
    registry = services.workflows
    for task in todo:
        message = MigrateTask(
            task.id,
            task.workflow_version,
            command.to_version,
            registry.at(task.workflow_id, task.workflow_version),
            target,
            command.step_map,
            command.enter,
        )
        plan = await runtime.ask_task(task.id, message)
        if isinstance(plan, TaskPlan):
            done.append(plan)
        else:
            skipped.append(task.id)
    if op:
        await services.ledger.mark_applied(op)
    return _result(command, done, sorted(skipped))


def _check_mapped(command: c.MigrateTasks, todo: list[TaskRecord], step_ids: list[str]) -> None:
    """Raise ConflictError (field step_map) naming every step (and its tasks) that maps to no step."""
    unmapped: dict[str, list[str]] = {}
    for task in todo:
        for step_id in (task.step_id, task.queued_for_step_id):
            if step_id is not None and task_migration.map_step(step_id, command.step_map, step_ids) is None:
                unmapped.setdefault(step_id, []).append(task.id)
    if unmapped:
        named = "; ".join(
            f"{step!r} (tasks {ids[:MAX_UNMAPPED_SHOWN]}"
            + (f" and {len(ids) - MAX_UNMAPPED_SHOWN} more" if len(ids) > MAX_UNMAPPED_SHOWN else "")
            + ")"
            for step, ids in sorted(unmapped.items())
        )
        raise ConflictError(
            f"version {command.to_version} of {command.workflow_id!r} has no step for {named}: map them in"
            " step_map; nothing was migrated",
            field="step_map",
        )


def _result(command: c.MigrateTasks, plans: list[TaskPlan], skipped: list[str]) -> MigrationResult:
    return MigrationResult(
        workflow_id=command.workflow_id,
        to_version=command.to_version,
        dry_run=command.dry_run,
        tasks=[
            TaskMigration(
                task_id=plan.task_id,
                from_version=plan.from_version,
                from_step=plan.from_step,
                to_step=plan.to_step,
                runs_kept=list(plan.runs_kept),
                runs_cancelled=list(plan.runs_cancelled),
                seats_moved=plan.seats_moved,
                entry=plan.entry,  # type: ignore[typeddict-item]
            )
            for plan in plans
        ],
        skipped=skipped,
    )


async def list_workflows(services: Services) -> WorkflowList:
    """`list_workflows`: every registered workflow, its versions and where its tasks are pinned."""
    summary, counts = await services.store.transact(workflows.summary)
    return WorkflowList(
        workflows=[
            WorkflowSummary(
                workflow_id=wf,
                versions=versions,
                newest=versions[-1],
                live_tasks_by_version=counts.get(wf, {}),
            )
            for wf, versions in summary
        ]
    )


async def get_workflow(services: Services, command: c.GetWorkflow) -> WorkflowText:
    """`get_workflow`: one version's text. Raises NotFoundError (field workflow_id or version)."""
    stored = await services.store.transact(workflows.get_version, command.workflow_id, command.version)
    if stored is None:
        field = "workflow_id" if command.version is None else "version"
        raise NotFoundError(
            f"workflow {command.workflow_id!r} has no version {command.version or '(none registered)'}",
            field=field,
        )
    return WorkflowText(
        workflow_id=stored.workflow_id, version=stored.version, yaml=stored.definition, sha256=stored.sha256
    )


async def list_participants(services: Services, command: c.ListParticipants) -> ParticipantList:
    """`list_participants`: the task's seats and its workflow's template-level ones. Raises NotFoundError
    (field task_id)."""
    rows = await services.store.transact(participants.task_participants, command.task_id)
    return ParticipantList(
        participants=[
            ParticipantInfo(
                participant_id=row.id,
                task_id=row.task_id,
                workflow_id=row.workflow_id,
                step_id=row.step_id,
                role=row.role,
                agent_profile_id=row.agent_profile_id,
                decision_required=row.decision_required,
            )
            for row in sorted(rows, key=lambda row: (row.step_id, row.position, row.id))
        ]
    )
