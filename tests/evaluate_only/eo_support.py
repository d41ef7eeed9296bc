"""Helpers for the evaluate-only operation-marking acceptance tests (evaluate-only-operation-marking.md).

Workflows are written inline and registered through the import path (transitions under event triggers).
Everything observable goes through protocol messages, the engine entry point, or the ledger actor.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import attrs
import pytest
import trio
import yaml
from helpers import list_runs, of_type, ok, register

from onceflow.actors.engine.engine import HandleInput, HandleResult
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import WorkflowRegistry
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply
from onceflow.protocol.workflow import (
    IMPORT_ALLOWED_ACTIONS,
    ActionDecl,
    Trigger,
    Workflow,
    load_workflow_text,
)
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect
from onceflow.testing import RecordingHost

WF = "eo"
TASK = "T1"
RUN = "r1"
OP = f"agent_error:{RUN}"  # the operation id of AgentError(run_id=RUN)


def queue(agent: str) -> dict[str, Any]:
    return {"type": "queue_run", "config": {"target": f"agent_profile_id:{agent}", "reason": "agent_error"}}


def move_to(step_id: str) -> dict[str, Any]:
    return {"type": "move_to_step", "config": {"step_id": step_id}}


# The main on_agent_error workflow. work: a callback and a transition to triage (a deferred transition under
# evaluate_only); triage: its own callback, no transition; quiet: no actions; loop: a transition to itself.
STEPS: dict[str, dict[str, Any]] = {
    "work": {"is_start_step": True, "events": {"on_agent_error": [queue("fixer"), move_to("triage")]}},
    "triage": {"events": {"on_agent_error": [queue("triager")]}},
    "quiet": {},
    "loop": {"events": {"on_agent_error": [queue("looper"), move_to("loop")]}},
}


def workflow_yaml(steps: dict[str, dict[str, Any]] = STEPS, workflow_id: str = WF) -> str:
    """Template YAML for `steps` (id -> extra step keys); positions follow the dict order."""
    body = [
        {"id": step_id, "name": step_id.title(), "position": position, **extra}
        for position, (step_id, extra) in enumerate(steps.items())
    ]
    return yaml.safe_dump({"id": workflow_id, "name": workflow_id, "steps": body}, sort_keys=False)


def parse(text: str) -> Workflow:
    return load_workflow_text(text, "reload.yml", allowed_actions=IMPORT_ALLOWED_ACTIONS)


async def create(
    rt: Runtime, step_id: str, *, workflow_id: str = WF, task_id: str = TASK, **fields: Any
) -> None:
    message = {"type": "create_task", "task_id": task_id, "workflow_id": workflow_id, "step_id": step_id}
    await ok(rt, {**message, "session_id": f"session-{task_id}", **fields})


async def setup(rt: Runtime, step_id: str = "work", text: str | None = None) -> None:
    """Register the workflow (default: STEPS) and create TASK at `step_id`."""
    await register(rt, text or workflow_yaml(), import_path=True)
    await create(rt, step_id)


async def agent_error(rt: Runtime, run_id: str = RUN, task_id: str = TASK) -> Reply:
    return await rt.send({"type": "agent_error", "task_id": task_id, "run_id": run_id})


async def step_of(rt: Runtime, task_id: str = TASK) -> str:
    return str((await ok(rt, {"type": "get_task", "task_id": task_id})).result["step_id"])


async def runs_for(rt: Runtime, agent: str) -> list[dict[str, Any]]:
    return await list_runs(rt, agent_profile_id=agent)


def callbacks(events: list[Any]) -> list[tuple[str, str, str]]:
    """(step_id, action kind, outcome) of every action the events report as run."""
    return [(e.step_id, e.kind, e.outcome) for e in of_type(events, "action_outcome")]


def moves(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.from_step, e.to_step) for e in of_type(events, "transition")]


def commit_failures(events: list[Any]) -> list[dict[str, Any]]:
    return [e.fields for e in of_type(events, "diagnostic") if e.code == "deferred_commit_failed"]


async def evaluate(
    rt: Runtime,
    op: str = OP,
    *,
    evaluate_only: bool = True,
    trigger: Trigger = Trigger.on_agent_error,
    defer_operation_mark: bool = False,
    task_id: str = TASK,
) -> tuple[HandleResult, Outbox]:
    """One call of the engine entry point (`Engine.handle_trigger`) on the real runtime."""
    out = Outbox(EventHub())
    inp = HandleInput(task_id, trigger, op, evaluate_only, defer_operation_mark)
    return await rt.engine.handle_trigger(inp, out), out


async def run_sql(rt: Runtime, statement: str) -> None:
    """Execute one statement in the runtime's own database, in one store transaction."""

    def apply(conn: sqlite3.Connection) -> None:
        conn.execute(statement)

    await rt.services.store.transact(apply)


async def applied(rt: Runtime, op: str = OP) -> bool:
    return await rt.services.ledger.is_applied(op)


@attrs.define
class LedgerSpy:
    """Every id passed to the runtime's ledger since `spy_ledger` (the ledger still does its work)."""

    checked: list[str] = attrs.field(factory=list)
    marked: list[str] = attrs.field(factory=list)


def spy_ledger(monkeypatch: pytest.MonkeyPatch, rt: Runtime) -> LedgerSpy:
    ledger = rt.services.ledger  # one ledger per runtime, kept across reconfiguration
    spy = LedgerSpy()
    real_is_applied, real_mark_applied = ledger.is_applied, ledger.mark_applied

    async def is_applied(operation_id: str) -> bool:
        spy.checked.append(operation_id)
        return await real_is_applied(operation_id)

    async def mark_applied(operation_id: str) -> None:
        spy.marked.append(operation_id)
        await real_mark_applied(operation_id)

    monkeypatch.setattr(ledger, "is_applied", is_applied)
    monkeypatch.setattr(ledger, "mark_applied", mark_applied)
    return spy


@attrs.define
class ScriptedHost(RecordingHost):
    """A host whose transition preflight can refuse (`refuse`) or wait for `gate` (when set)."""

    refuse: bool = False
    gate: trio.Event | None = None
    waiting: trio.Event = attrs.field(factory=trio.Event)
    preflights: list[tuple[str, str]] = attrs.field(factory=list)

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        self.preflights.append((from_step, to_step))
        if self.gate is not None:
            self.waiting.set()
            await self.gate.wait()
        if self.refuse:
            raise PermissionError(f"credentials for {to_step!r} expired")


@attrs.define
class ReloadDuringEvaluation:
    """A queue_run executor that, on its first call, replaces the workflow in `registry` with `replacement`.

    It models a template reload landing between a deferred transition's evaluation (whose callbacks run
    this executor) and its commit, on the very registry the in-flight command reads.
    """

    registry: WorkflowRegistry
    replacement: Workflow | None

    def __call__(self, conn: sqlite3.Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        effect = DEFAULT_EXECUTORS["queue_run"](conn, ctx, action)
        if self.replacement is not None:
            self.registry.put(self.replacement)
            self.replacement = None
        return effect


def reload_during_evaluation(rt: Runtime, replacement_yaml: str) -> None:
    """Reconfigure the runtime with a ReloadDuringEvaluation queue_run executor (armed once)."""
    registry = WorkflowRegistry(dict(rt.services.workflows.workflows))
    hook = ReloadDuringEvaluation(registry, parse(replacement_yaml))
    rt.reconfigure(executors={**DEFAULT_EXECUTORS, "queue_run": hook}, workflows=registry)
