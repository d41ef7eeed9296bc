"""One task's migration onto another version of its workflow, in its actor (serialized with its commands).
Trio thread: the store migrates it in one transaction (store/tasks/task_migration.py); this publishes what
that did and, when asked to enter, dispatches the new step's on_enter.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from onceflow.actors.engine.publish import publish_run_changes
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.task.context import TaskContext
from onceflow.protocol.workflow import Workflow
from onceflow.store.tasks import task_migration
from onceflow.store.tasks.task_migration import TaskPlan


@attrs.frozen
class MigrateTask:
    """Migrate task `task_id` from version `from_version` of its workflow (`source`) onto `to_version`
    (`target`), its steps mapped by `step_map`; `enter`: dispatch the new step's on_enter."""

    task_id: str
    from_version: int
    to_version: int
    source: Workflow | None
    target: Workflow
    step_map: Mapping[str, str]
    enter: bool


async def migrate(ctx: TaskContext, message: MigrateTask, out: Outbox) -> TaskPlan | None:
    """Apply `message` (store/tasks/task_migration.py `migrate_task` states the rules); the plan it applied,
    or None when the task was already elsewhere (gone, or not on `from_version` any more: nothing done). Its
    run changes are published (`run_cancelled`, reason `migrated`). A cancellation after the commit leaves
    the task migrated and a new entry (with `enter`) open for the next recovery scan."""
    services = ctx.services
    services.task_rows.forget(ctx.task_id)  # the row changes outside an admission's compare-and-set
    source_steps = {step.id: step for step in message.source.steps} if message.source else {}
    target_steps = {step.id: step for step in message.target.steps}
    done = await ctx.store.transact(
        task_migration.migrate_task,
        ctx.task_id,
        message.from_version,
        message.to_version,
        (source_steps, target_steps),
        message.step_map,
        message.enter,
        services.now(),
    )
    publish_run_changes(out, list(done.changes))
    if done.plan is None or done.task is None:
        return None
    if message.enter and done.task.wip_admitted:
        step = message.target.step(done.task.step_id)
        await ctx.engine.dispatch_entry(done.task, message.target, step, done.entered, "E4", out)
    return done.plan
