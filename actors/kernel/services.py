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

from onceflow import tracing
from onceflow.actors.kernel.ledger import LedgerActor
from onceflow.actors.kernel.run_signals import RunSignals
from onceflow.actors.kernel.task_rows import TaskRows
from onceflow.protocol.host import Host
from onceflow.protocol.runs import RunPolicy
from onceflow.protocol.workflow import Workflow, find_workflow
from onceflow.store.executors import DEFAULT_EXECUTORS, Executor
from onceflow.store.wip import Promotion
from onceflow.store.writer import StoreActor
from onceflow.tracing import Tracing

Announced: TypeAlias = tuple[Promotion, Context | None]
"""A committed promotion, with the trace context current where it was made (None: not traced)."""


@attrs.define
class WorkflowRegistry:
    """The loaded workflows by id. Replacing one is a reconfiguration; tasks read it per command."""

    workflows: dict[str, Workflow] = attrs.field(factory=dict)

    def put(self, workflow: Workflow) -> None:
        self.workflows[workflow.id] = workflow

    def get(self, workflow_id: str) -> Workflow:
        """The workflow. Raises NotFoundError (field workflow_id) when none is registered under that id."""
        return find_workflow(self.workflows, workflow_id)


@attrs.define
class Services:
    """The shared facade. `clock` returns Unix seconds: the runtime's clock (actors/kernel/clock.py,
    anchored at open and monotonic since), which every persisted and compared time is read from.
    `task_rows` caches task rows for moves (actors/kernel/task_rows.py; off unless `open_runtime` sizes
    it). `run_policy` is how runs are leased and retried; `run_signals` wakes the claims waiting for work
    (actors/kernel/run_signals.py); `tracing` is where the runtime's spans go (onceflow/tracing.py).
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
