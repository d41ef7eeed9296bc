"""WIP promotion, Trio side: when to promote, and the promotion loop (entry path E3). Trio thread: each
claim is one store transaction (`store.wip.promote_one`, which states the rules); the promoted task's actor
dispatches the entry's on_enter. Sources: kandev-engine-notes.md "WIP limits"; on-enter-action-dispatch.md,
write-site inventory sites 4-7.
"""

from __future__ import annotations

from onceflow.actors.kernel.services import Services
from onceflow.protocol.workflow import Step, Workflow
from onceflow.store.entries import wip
from onceflow.store.records import TaskRecord


def may_promote(workflow: Workflow, step: Step, occupied: set[tuple[str, str, bool]]) -> bool:
    """Whether rules 1-3 of `store.wip` can find any candidate for `step`, given `occupied`
    (`wip.occupied_steps`: (workflow, step, admitted?) triples). False: promoting it would admit nobody."""

    def holds(step_id: str, admitted: bool) -> bool:
        return (workflow.id, step_id, admitted) in occupied

    return (
        holds(step.id, False)
        or (step.pull_from_step_id is not None and holds(step.pull_from_step_id, True))
        or any(holds(target.id, False) for target in workflow.fed_by(step.id))
    )


def takes_promotions(workflow: Workflow, step: Step) -> bool:
    """Whether a freed slot at `step` can admit anyone: it has a WIP limit, a feeder, or feeds a step.

    Without any of them no task can be waiting for the slot, so the promotion query is skipped (the start-up
    promotion still covers a task queued under a limit since removed).
    """
    return step.wip_limit > 0 or bool(step.pull_from_step_id) or bool(workflow.fed_by(step.id))


async def promote(services: Services, workflow: Workflow, step: Step) -> int:
    """Admit candidates into `step` while it has room, each claim its own transaction with its step-entry
    record, and hand each to the runtime (`Services.announce_promotion`), which routes it to the task's
    actor. Returns how many were promoted. A cancellation leaves the claims committed so far announced.

    Every loaded version of the workflow that has the step promotes its own tasks into it (newest first):
    a task is admitted to its pinned version's step, whose on_enter its actor then runs."""
    promoted = 0
    for version, pinned in services.workflows.loaded(workflow.id) or [(None, workflow)]:
        if pinned.has_step(step.id):
            promoted += await _promote(services, pinned, pinned.step(step.id), version)
    return promoted


async def _promote(services: Services, workflow: Workflow, step: Step, version: int | None) -> int:
    """`promote` for the tasks pinned to `version` (None: any)."""
    promoted = 0
    while True:
        promotion = await services.store.transact(wip.promote_one, workflow, step, services.now(), version)
        if promotion is None:
            return promoted
        promoted += 1
        services.task_rows.forget(promotion.task_id)  # its row changed outside its actor
        services.announce_promotion(promotion)


async def promote_after_move(
    services: Services, task: TaskRecord, workflow: Workflow, admitted_to: Step | None
) -> None:
    """After `task` moved from where it stood: a slot freed at its former step; a step its new step feeds
    got work (E3)."""
    source_workflow = services.workflows.pinned(task)
    if source_workflow is not None and source_workflow.has_step(task.step_id) and task.wip_admitted:
        source = source_workflow.step(task.step_id)
        if takes_promotions(source_workflow, source):
            await promote(services, source_workflow, source)
    if admitted_to is not None:
        for step in workflow.fed_by(admitted_to.id):
            await promote(services, workflow, step)


async def promote_all(services: Services) -> int:
    """Start-up promotion: every step admits while it has room (E3); returns how many were promoted. Steps
    without a WIP limit are included: a task queued at a step whose limit was since removed is admitted.

    Only a step with a candidate (`may_promote`, against one read of where tasks stand) costs a
    transaction: a 1,000-step template with few tasks restarts in one read, not 1,000.
    """
    occupied = await services.store.transact(wip.occupied_steps)
    promoted = 0
    registry = services.workflows
    for workflow_id in list(registry.workflows):
        for version, workflow in registry.loaded(workflow_id):
            for step in workflow.ordered_steps:
                if may_promote(workflow, step, occupied):
                    count = await _promote(services, workflow, step, version)
                    if count:  # a task admitted here may now be pulled by a step this one feeds
                        occupied.add((workflow.id, step.id, True))
                    promoted += count
    return promoted
