"""What every actor of one runtime shares: the store, the ledger, the workflow registry and the host. Trio
thread.

The ledger is a required constructor argument, so a rebuilt facade can never be missing it or hold a
different one (operation-ledger-lifetime.md: reconfiguration never replaces the ledger).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import TypeAlias

import attrs
import trio
from opentelemetry.context import Context

from onceflow.actors.kernel.ledger import LedgerActor
from onceflow.actors.kernel.run_signals import RunSignals
from onceflow.actors.kernel.task_rows import TaskRows
from onceflow.observability import tracing
from onceflow.observability.tracing import Tracing
from onceflow.protocol.errors import NotFoundError
from onceflow.protocol.host import Host
from onceflow.protocol.runs import RunPolicy
from onceflow.protocol.workflow import Workflow, find_workflow
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, Executor
from onceflow.store.entries.wip import Promotion
from onceflow.store.records import TaskRecord
from onceflow.store.writer import StoreActor

Announced: TypeAlias = tuple[Promotion, Context | None]
"""A committed promotion, with the trace context current where it was made (None: not traced)."""


@attrs.define
class WorkflowRegistry:
    """The loaded workflows: `workflows` the newest version of each by id (what a new task, a switch to the
    workflow and a template-level seat use), `versions` every loaded version by (id, version) and `newest`
    each id's newest version number. A task runs on the version it is pinned to (`for_task`). Replacing
    one is a reconfiguration; tasks read it per command."""

    workflows: dict[str, Workflow] = attrs.field(factory=dict)
    versions: dict[tuple[str, int], Workflow] = attrs.field(factory=dict)
    newest: dict[str, int] = attrs.field(factory=dict)

    def put(self, workflow: Workflow, version: int = 1) -> None:
        """Load `workflow` as version `version` of its id (the newest when no later one is loaded)."""
        self.versions[(workflow.id, version)] = workflow
        if version >= self.newest.get(workflow.id, 0):
            self.workflows[workflow.id] = workflow
            self.newest[workflow.id] = version

    def copy(self) -> WorkflowRegistry:
        """A registry with the same entries (a reconfiguration builds the next one from it)."""
        return WorkflowRegistry(dict(self.workflows), dict(self.versions), dict(self.newest))

    def get(self, workflow_id: str) -> Workflow:
        """The workflow's newest version. Raises NotFoundError (field workflow_id) when none is registered
        under that id."""
        return find_workflow(self.workflows, workflow_id)

    def loaded(self, workflow_id: str) -> list[tuple[int | None, Workflow]]:
        """Every loaded version of the workflow as (version, workflow), newest first; [(None, workflow)]
        for one given through `workflows` alone; empty when it is not registered."""
        found = sorted(
            ((version, wf) for (wid, version), wf in self.versions.items() if wid == workflow_id),
            key=lambda pair: -pair[0],
        )
        if found:
            return list(found)
        newest = self.workflows.get(workflow_id)
        return [] if newest is None else [(None, newest)]

    def at(self, workflow_id: str, version: int) -> Workflow | None:
        """Version `version` of the workflow, or None when it is not loaded."""
        found = self.versions.get((workflow_id, version))
        if found is None and workflow_id not in self.newest:  # given through `workflows` alone
            return self.workflows.get(workflow_id)
        return found

    def pinned(self, task: TaskRecord) -> Workflow | None:
        """The version of its workflow `task` is pinned to, or None when it is not loaded."""
        return self.at(task.workflow_id, task.workflow_version)

    def for_task(self, task: TaskRecord) -> Workflow:
        """The version of its workflow `task` is pinned to. Raises NotFoundError (field workflow_id) when
        it is not loaded."""
        found = self.pinned(task)
        if found is None:
            raise NotFoundError(
                f"workflow {task.workflow_id!r} version {task.workflow_version} is not registered",
                field="workflow_id",
            )
        return found


@attrs.define
class Services:
    """The shared facade. `clock` returns Unix seconds: the runtime's clock (actors/kernel/clock.py,
    anchored at open and monotonic since), which every persisted and compared time is read from.
    `task_rows` caches task rows for moves (actors/kernel/task_rows.py; off unless `open_runtime` sizes
    it). `run_policy` is how runs are leased and retried; `run_signals` wakes the claims waiting for work
    (actors/kernel/run_signals.py); `tracing` is where the runtime's spans go
    (onceflow/observability/tracing.py).
    """

    store: StoreActor
    ledger: LedgerActor
    host: Host
    workflows: WorkflowRegistry
    promotions: trio.MemorySendChannel[Announced]
    executors: Mapping[str, Executor] = DEFAULT_EXECUTORS
    clock: Callable[[], float] = time.time
    task_rows: TaskRows = attrs.field(factory=TaskRows)
    run_policy: RunPolicy = attrs.field(factory=RunPolicy)
    run_signals: RunSignals = attrs.field(factory=RunSignals)
    tracing: Tracing = attrs.field(factory=Tracing)

    def now(self) -> float:
        return self.clock()

    def announce_promotion(self, promotion: Promotion) -> None:
        """Hand a committed promotion to the runtime, which routes it to the promoted task's actor.

        During shutdown the channel is closed; the entry is committed, so the next start's recovery scan
        finishes it.
        """
        context = tracing.current() if self.tracing.tracer() is not None else None
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self.promotions.send_nowait((promotion, context))
