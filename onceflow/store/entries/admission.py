"""A step admission: the task's compare-and-set step change, its step-entry record, and the first effects of
its on_enter, in one transaction. Writer thread: runs inside the writer's transaction on a request the Trio
side planned (actors/engine/entry.py), and returns plain data for it to publish.

The step change is a compare-and-set on the task's current step (and, for a cached row, its workflow,
admitted flag and admission counter), so a task that moved meanwhile is not moved again. A step at its WIP
limit queues the task instead (not an entry: nothing allocated). The step-entry record is allocated in the
same transaction (AC-B7, AC-E5). When no host action must come first, the dispatch's leading segment runs
here too, in a savepoint: one commit for the move and its first effects, and a failure there leaves the
move standing (AC-C4). The transition (or queued placement) joins the task's history in the same
transaction (store/tasks/history.py). An entry of built-in clears and fan-outs only is first tried whole in
one savepoint (store/entries/common_entry.py); any anomaly rolls that back and the per-action path above
decides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

from onceflow.observability.logs import get_logger
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import Step
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.epochs import EpochSource
from onceflow.store.backends.savepoint import savepoint
from onceflow.store.entries import step_entries, wip
from onceflow.store.entries.common_entry import Admitted, Plan, admit_common, admit_group
from onceflow.store.entries.executors import Executor
from onceflow.store.entries.segment import Order, Segment, SegmentResult, run_segment
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.records import TaskRecord
from onceflow.store.runs import runs
from onceflow.store.runs.flow import Cause
from onceflow.store.runs.runs import Change
from onceflow.store.tasks import history, tasks

log = get_logger("onceflow.engine")

Outcome = Literal["admitted", "queued", "stale", "abandoned"]
"""admitted: an entry (or one with no record, when the step allocates none); queued: the step is full, the
task waits there; stale: a cached row failed the compare-and-set (nothing written: read it afresh);
abandoned: the task moved meanwhile (nothing written)."""


@attrs.frozen(slots=False)
class EntryRequest:
    """One admission of `task` (the row the move starts from) to `target` of `workflow_id` on `path`, at
    `now` (Unix seconds). `entered` is the row as the admission leaves it (the leading segment's task);
    `version` a cached row's (workflow id, admitted flag, admission count) to verify, None for a fresh read;
    `common` the step's common-entry plan when the whole entry may run in one savepoint; `lead` the
    dispatch's leading segment (its actions, and whether it is the entry's last engine chunk) when no host
    action comes first; `trigger` and `operation_id` what moved it (the history's transition item,
    store/tasks/history.py; "" when it carries no operation id); `cause` the moving command's causation
    (store/runs/flow.py).

    Built once per entry and frozen without slots: a frozen slotted class sets each of its ten fields
    through `object.__setattr__`, a dict class writes its `__dict__` directly (about 40 % fewer
    instructions per entry request)."""

    task: TaskRecord
    entered: TaskRecord
    workflow_id: str
    target: Step
    path: EntryPath
    now: float
    version: tuple[str, bool, int] | None
    common: Plan | None
    lead: tuple[Order, bool] | None
    executors: Mapping[str, Executor]
    trigger: str = ""
    operation_id: str = ""
    cause: Cause | None = None

    @property
    def plan(self) -> Plan:
        """The common-entry plan (`common_entry.Admitting`): only a common entry's request is grouped."""
        assert self.common is not None
        return self.common


@attrs.frozen
class Entered:
    """What an admission did: its outcome, the entry's key (None: no record), what ran in the admitting
    transaction (the leading segment's result, the whole common entry, or nothing), and the runs of the
    entry the task left (`runs.leave_entries`: cancelled, or superseded when claimed)."""

    outcome: Outcome
    key: EntryKey | None = None
    first: SegmentResult | Admitted | None = None
    left: tuple[Change, ...] = ()


def admit(conn: Connection, request: EntryRequest, source: EpochSource) -> Entered:
    """Admit the task (module docstring); the epoch the leading segment claims with is read from `source`.

    Raises:
        sqlite3.Error: the step change or the allocation failed (nothing of the request is kept), or an
            error ended the transaction.
    """
    task, target = request.task, request.target
    if request.common is not None:  # the whole entry in one savepoint, or nothing of it
        fast = admit_common(
            conn,
            task=task,
            workflow_id=request.workflow_id,
            plan=request.common,
            path=request.path,
            now=request.now,
            version=request.version,
            trigger=request.trigger,
            operation_id=request.operation_id,
        )
        if fast is not None:
            return Entered("admitted", fast.key, fast, fast.left)
    placement = wip.place(conn, request.workflow_id, target, task_id=task.id)
    moved = tasks.move_task_step(
        conn,
        task_id=task.id,
        expected_step_id=task.step_id,
        workflow_id=request.workflow_id,
        step_id=target.id,
        now=request.now,
        admitted=placement.admitted,
        version=request.version,
    )
    if not moved:
        return Entered("stale" if request.version is not None else "abandoned")
    leaving = runs.leave_entries(conn, [task.id], request.now)
    if not placement.admitted:  # a queued placement: not an entry, nothing allocated
        _record(conn, request, None, queued=True)
        return Entered("queued", left=leaving.changes())
    # The landing step's declaration was resolved by the caller and is read once (Allocation inputs).
    key = step_entries.allocate_for(
        conn,
        task_id=task.id,
        workflow_id=request.workflow_id,
        step=target,
        path=request.path,
        now=request.now,
    )
    _record(conn, request, key, queued=False)
    if key is None or request.lead is None:
        return Entered("admitted", key, left=leaving.changes())
    actions, finish = request.lead
    segment = Segment(
        request.entered,
        target,
        key,
        actions,
        request.executors,
        check_digest=False,
        finish=finish,
        cause=request.cause,
    )
    try:
        with savepoint(conn, "dispatch"):
            first = run_segment(conn, segment, source, request.now)
            return Entered("admitted", key, first, leaving.changes())
    except Exception as exc:  # the move stands; the dispatch runs on its own after the commit
        if faults.fails_request(conn, exc):  # unless the database itself failed
            raise
        log.error("leading_segment_failed", task_id=task.id, step_id=target.id, cause=repr(exc))
    return Entered("admitted", key, left=leaving.changes())


def _record(conn: Connection, request: EntryRequest, key: EntryKey | None, *, queued: bool) -> None:
    """The admission's transition in the task's history (store/tasks/history.py)."""
    detail = history.transition_detail(
        from_step=request.task.step_id,
        to_step=request.target.id,
        workflow_id=request.workflow_id,
        trigger=request.trigger,
        operation_id=request.operation_id,
        path=None if queued else request.path,
        entry_seq=key.entry_seq if key else None,
        queued=queued,
    )
    history.record_transition(conn, request.task.id, request.now, detail)


def group_key(request: EntryRequest) -> tuple[int, str, str] | None:
    """The writer's group key (store/writer.py `Grouped`) of a common entry into a step without a WIP
    limit: entries of one plan (step object, order), one workflow and one path run together. None: the
    request runs alone (not common, or a WIP-limited step, admitted one at a time)."""
    if request.common is None or request.target.wip_limit:
        return None
    return (id(request.common), request.workflow_id, request.path)


def admit_together(conn: Connection, requests: list[EntryRequest]) -> list[Entered] | None:
    """The writer's run for a group of common entries (`group_key`): each request's result as `admit` would
    give it, or None for each to be decided alone (`common_entry.admit_group`)."""
    admitted = admit_group(conn, requests)
    return None if admitted is None else [Entered("admitted", e.key, e, e.left) for e in admitted]
