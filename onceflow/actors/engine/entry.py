"""A step entry, Trio side: plan the admission, then publish what it committed. Trio thread: the admission
itself is one store request (store/entries/admission.py).

Planning reads only memory: the source step's on_exit actions, and, without any, the target's common-entry
plan on the entry's path (store/entries/common_entry.py) or else the dispatch's leading segment, memoized per
(source, target, path) step objects (`EntryPlans`). Publishing emits the transition, asks the host for the
source step's on_exit actions (it left the step), emits step_entered or task_queued, and publishes what the
admitting transaction already did. Source: on-enter-action-dispatch.md AC-B7, AC-C4, AC-E5.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from onceflow.actors.engine.common import common_order
from onceflow.actors.engine.order import leading_segment
from onceflow.actors.kernel import causation
from onceflow.actors.kernel.services import Services
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ActionDecl, Step, Trigger, Workflow
from onceflow.store.entries.admission import EntryRequest
from onceflow.store.entries.common_entry import Plan, common_plan
from onceflow.store.entries.executors import Executor
from onceflow.store.entries.segment import Order
from onceflow.store.records import TaskRecord


class StaleRow(Exception):
    """A cached task row failed the admission's compare-and-set: nothing was written; read it afresh."""


EntryPlan = tuple[Sequence[ActionDecl], Plan | None, tuple[Order, bool] | None]
"""A move's source on_exit actions and, when it has none, the target's common-entry plan (or None) and the
dispatch's leading segment (`order.leading_segment`, or None)."""

_PLAN_MEMO = 4096
"""Entry plans remembered before the memo starts over (a plan is a few references)."""


@attrs.define
class EntryPlans:
    """The memo of `EntryPlan`s of one engine (its executors fixed: an engine is rebuilt on
    reconfiguration), keyed by the (immutable) step objects themselves."""

    executors: Mapping[str, Executor]
    _plans: dict[tuple[int, int, str], tuple[Step | None, Step, EntryPlan]] = attrs.field(
        init=False, factory=dict
    )

    def get(self, source: Step | None, target: Step, path: EntryPath) -> EntryPlan:
        """The source step's on_exit actions and, without any, the target's common-entry plan on `path`
        (`common_order`, `common_plan`) and leading segment."""
        key = (id(source), id(target), path)
        memo = self._plans.get(key)
        if memo is not None and memo[0] is source and memo[1] is target:
            return memo[2]
        on_exit = source.events.actions(Trigger.on_exit) if source is not None else ()
        order = None if on_exit else common_order(self.executors, target, path)
        common = None if order is None else common_plan(target, order)
        lead = None if on_exit else leading_segment(target, path, self.executors)
        plan: EntryPlan = (on_exit, common, lead)
        if len(self._plans) >= _PLAN_MEMO:
            self._plans.clear()
        self._plans[key] = (source, target, plan)  # the references keep the ids from being reused
        return plan


def source_step(services: Services, task: TaskRecord) -> Step | None:
    """The step the task stands at, when its workflow still declares it."""
    workflow = services.workflows.pinned(task)
    if workflow is None or not workflow.has_step(task.step_id):
        return None
    return workflow.step(task.step_id)


def plan_entry(
    services: Services,
    plans: EntryPlans,
    task: TaskRecord,
    workflow: Workflow,
    target: Step,
    path: EntryPath,
    *,
    cached: bool,
    trigger: str = "",
    operation_id: str = "",
) -> tuple[EntryRequest, Sequence[ActionDecl]]:
    """The admission request of `task` to `target` (store/entries/admission.py) and the source step's on_exit
    actions to ask the host for once it commits. `cached`: `task` came from the task-row cache, so the
    compare-and-set also verifies its version. `trigger` and `operation_id` ("" for none) say what moved it
    (the task history's transition item, store/tasks/history.py)."""
    now = services.now()
    # As an admission leaves the row (the task actor serializes the task's commands); used only if admitted.
    pinned = task.workflow_version
    if workflow.id != task.workflow_id:  # a switch pins it to the newest version (`tasks.move_task_step`)
        pinned = services.workflows.newest.get(workflow.id, 1)
    entered = TaskRecord(  # `attrs.evolve` of every field, built directly (evolve's generic copy is slower)
        task.id,
        workflow.id,
        target.id,
        task.title,
        task.session_id,
        task.primary_agent_id,
        task.ceo_agent_id,
        task.priority,
        True,  # wip_admitted
        None,  # queued_for_step_id
        task.created_at,
        now,
        task.admissions + 1,
        pinned,  # workflow_version
    )
    on_exit, common, lead = plans.get(source_step(services, task), target, path)
    cause = causation.current()
    if cause is not None and (cause.parent_run_id is not None or cause.human):
        common = None  # its runs have a lineage to record and check: the per-action path (store/runs/flow.py)
    version = (task.workflow_id, task.wip_admitted, task.admissions) if cached else None
    request = EntryRequest(
        task,
        entered,
        workflow.id,
        target,
        path,
        now,
        version,
        common,
        lead,
        services.executors,
        trigger,
        operation_id,
        cause,
    )
    return request, on_exit
