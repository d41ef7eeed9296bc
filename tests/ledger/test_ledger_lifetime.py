"""The ledger outlives every reconfiguration of a runtime, and every reader reaches the same one.

Source: operation-ledger-lifetime.md, groups L, S, R, B and T. "A Set* call" is a reconfiguration here
(`Runtime.reconfigure`, or `register_workflow`, which rebuilds the facade); "a bare Service literal" is a
runtime built by any supported constructor path.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import attrs
import pytest
from flows import agent_error, children_completed, parent_task
from helpers import list_entries, list_runs, ok, step_of

from onceflow import RecordingHost, open_runtime
from onceflow.actors.engine.engine import HandleInput
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import Services, WorkflowRegistry
from onceflow.actors.runtime import supervisor
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol import commands as c
from onceflow.protocol import operation_ids
from onceflow.protocol.workflow import Trigger

REPO = Path(__file__).resolve().parents[2]


async def reconfigure_many(rt: Runtime, times: int = 3) -> None:
    for _ in range(times):
        rt.reconfigure(host=RecordingHost())


async def test_ac_t1_ac_l1_a_marked_id_stays_applied_through_the_rebuilt_facade(runtime: Runtime) -> None:
    old = runtime.services
    await old.ledger.mark_applied("agent_error:run-1")
    await reconfigure_many(runtime)
    assert runtime.services is not old  # the facade really was rebuilt
    assert await runtime.services.ledger.is_applied("agent_error:run-1")  # read through the NEW facade


async def test_ac_l2_ac_b3_every_rebuilt_facade_resolves_to_the_one_ledger(runtime: Runtime) -> None:
    before, engine_before = runtime.services, runtime.engine
    runtime.reconfigure(host=RecordingHost())
    after = runtime.services
    assert after.ledger is before.ledger
    assert runtime.engine is not engine_before and after.workflows is not before.workflows  # rest is rebuilt
    await before.ledger.mark_applied("old-writes")
    await after.ledger.mark_applied("new-writes")
    assert await after.ledger.is_applied("old-writes") and await before.ledger.is_applied("new-writes")


def test_ac_s3a_ac_l3_the_facade_cannot_be_built_without_a_ledger() -> None:
    ledger_field = attrs.fields(Services).ledger
    assert ledger_field.default is attrs.NOTHING  # required, never defaulted or optional
    with pytest.raises(TypeError, match="ledger"):
        Services(store=None, host=RecordingHost(), workflows=WorkflowRegistry())  # type: ignore[call-arg, arg-type]


def test_ac_t4_ac_b2_only_open_runtime_creates_a_ledger_and_reconfigure_passes_it_on() -> None:
    """Structural pin: one LedgerActor() in the package, in open_runtime; every Services(...) gets `ledger=`
    from an existing ledger (a name or attribute), so no rebuild path can own a ledger of its own."""
    creations: list[str] = []
    facades: list[tuple[str, str]] = []
    for path in REPO.joinpath("onceflow").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]:
            for call in [n for n in ast.walk(func) if isinstance(n, ast.Call)]:
                name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
                if name == "LedgerActor":
                    creations.append(f"{path.name}:{func.name}")
                if name == "Services":
                    ledger = next((k.value for k in call.keywords if k.arg == "ledger"), None)
                    facades.append(
                        (f"{path.name}:{func.name}", ast.unparse(ledger) if ledger else "<missing>")
                    )
    assert creations == ["startup.py:open_runtime"]
    assert sorted(facades) == [
        ("startup.py:open_runtime", "ledger"),
        ("supervisor.py:reconfigure", "old.ledger"),
    ]


async def test_ac_t3_a_ac_l4_a_runtime_with_nothing_registered_has_a_working_ledger(runtime: Runtime) -> None:
    assert runtime.services.workflows.workflows == {}
    await runtime.services.ledger.mark_applied("blockers_resolved:T9")
    assert await runtime.services.ledger.is_applied("blockers_resolved:T9")


async def test_ac_t3_b_every_constructor_path_reaches_its_own_runtime_ledger(db_path: Path) -> None:
    async with open_runtime(db_path, host=RecordingHost()) as rt:
        await rt.register_workflow(
            "id: w\nname: W\nsteps:\n  - {id: s, name: S, position: 0, is_start_step: true}\n", "w.yml"
        )  # a reconfiguration through another path
        engine_ledger = rt.engine.services.ledger
        await engine_ledger.mark_applied("x")
        assert await rt.services.ledger.is_applied("x")
        await rt.services.ledger.mark_applied("y")
        assert await engine_ledger.is_applied("y")


async def test_ac_l5_a_restart_starts_empty_and_nothing_is_persisted(db_path: Path) -> None:
    async with open_runtime(db_path) as rt:
        await parent_task(rt)
        first = await ok(rt, agent_error())
        assert await rt.services.ledger.is_applied(first.result["operation_id"])
        tables = await rt.services.store.transact(
            lambda conn: [r[0] for r in conn.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL")]
        )
    assert not any("operation" in sql.lower() for sql in tables)  # no table, no column for the ledger
    async with open_runtime(db_path) as rt:
        assert not await rt.services.ledger.is_applied(first.result["operation_id"])


async def test_ac_t2_ac_b1_ac_r3_agent_error_is_deduplicated_across_reconfigurations(
    runtime: Runtime,
) -> None:
    await parent_task(runtime)
    first = await ok(runtime, agent_error())
    assert first.result["applied"] and await step_of(runtime, "P1") == "triage"
    await reconfigure_many(runtime, 5)
    again = await ok(runtime, agent_error())
    assert again.result["idempotent"] is True and again.events == []  # nothing ran
    assert [r["agent_profile_id"] for r in await list_runs(runtime, task_id="P1")] == ["fixer"]


async def test_ac_t2_ac_r2_children_completed_double_delivery_transitions_once(runtime: Runtime) -> None:
    """The structurally double delivery (a state change plus a direct call, same rows) with a
    reconfiguration landing between the two."""
    await parent_task(runtime)
    first = await ok(runtime, children_completed())
    runtime.reconfigure(host=RecordingHost())
    second = await ok(runtime, children_completed())
    assert first.result["applied"] is True and second.result["idempotent"] is True
    assert [e["step_id"] for e in await list_entries(runtime, "P1")] == ["review"]  # one entry, one fan-out
    assert len(await list_runs(runtime, task_id="P1", agent_profile_id="rev-a")) == 1


class ReconfiguringHost(RecordingHost):
    """Reconfigures the runtime while a dispatch is in flight (from inside its transition preflight)."""

    runtime: Runtime | None = None

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        assert self.runtime is not None
        self.runtime.reconfigure(host=RecordingHost())


async def test_ac_r3_a_dispatch_holding_the_old_facade_marks_the_ledger_later_dispatches_read(
    db_path: Path,
) -> None:
    host = ReconfiguringHost()
    async with open_runtime(db_path, host=host) as rt:
        host.runtime = rt
        await parent_task(rt)
        engine_at_start = rt.engine
        first = await ok(rt, agent_error())  # reconfigures mid-dispatch; marks through the captured facade
        assert rt.engine is not engine_at_start and first.result["applied"]
        again = await ok(rt, agent_error())
        assert again.result["idempotent"] is True


async def test_ac_r1_ac_r4_a_mark_by_one_reader_class_is_seen_by_another(runtime: Runtime) -> None:
    await parent_task(runtime)
    marked = await ok(runtime, children_completed())  # the caller-owned bracket marks
    op = marked.result["operation_id"]
    runtime.reconfigure()
    result = await runtime.engine.handle_trigger(  # the engine's own check reads it
        HandleInput("P1", Trigger.on_children_completed, op), Outbox(EventHub())
    )
    assert result.idempotent is True


async def test_ac_r2_switch_workflow_pre_check_survives_a_reconfiguration(runtime: Runtime) -> None:
    await parent_task(runtime)
    move = {
        "type": "switch_workflow",
        "task_id": "P1",
        "workflow_id": "parent-flow",
        "step_id": "elsewhere",
        "operation_id": "op-42",
    }
    assert (await ok(runtime, move)).result["moved"] is True
    await ok(runtime, {"type": "move_task", "task_id": "P1", "step_id": "waiting"})
    runtime.reconfigure()
    again = await ok(runtime, move)
    assert again.result["idempotent"] is True and await step_of(runtime, "P1") == "waiting"
    assert await runtime.services.ledger.is_applied("op-42:switch_workflow:on_exit")


async def test_ac_s5_marks_only_after_success_and_when_nothing_is_declared(runtime: Runtime) -> None:
    await parent_task(runtime)  # on_comment queues a run for the CEO agent, which the task lacks
    comment = {"type": "task_comment", "task_id": "P1", "comment_id": "c1"}
    failed = await runtime.send(comment)
    assert not failed.ok and failed.error is not None and failed.error.code == "action_failed"
    assert not await runtime.services.ledger.is_applied("task_comment:c1")  # retryable
    await ok(runtime, {"type": "update_task", "task_id": "P1", "step_id": "elsewhere"})
    quiet = {"type": "task_comment", "task_id": "P1", "comment_id": "c2"}  # elsewhere declares nothing
    assert (await ok(runtime, quiet)).result["idempotent"] is False
    assert (await ok(runtime, quiet)).result["idempotent"] is True


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (c.TaskComment(task_id="T", comment_id="cm-9"), "task_comment:cm-9"),
        (c.BlockersResolved(task_id="T"), "blockers_resolved:T"),
        (c.ApprovalResolved(task_id="T", approval_id="ap-3"), "approval_resolved:ap-3"),
        (c.AgentError(task_id="T", run_id="r-1"), "agent_error:r-1"),
        (c.AgentError(task_id="T", session_id="s-1", execution_id="x-2"), "agent_error:s-1:x-2"),
        (c.Heartbeat(task_id="T", step_id="work", unix=1700000000), "heartbeat:T:work:1700000000"),
        (
            c.BudgetAlert(
                task_id="T", workspace_id="ws", scope="agent", scope_id="a1", pct=80, period_start=17
            ),
            "budget:ws:agent:a1:80:17",
        ),
    ],
)
def test_ac_s4_operation_id_shapes_are_exact(command: Any, expected: str) -> None:
    assert operation_ids.operation_id(command) == expected


def test_ac_s4_children_completed_key_hashes_the_rows_independent_of_order() -> None:
    rows = [c.ChildRow(task_id="a", state="done"), c.ChildRow(task_id="b", state="done")]
    one = operation_ids.operation_id(c.ChildrenCompleted(task_id="P", children=rows))
    other = operation_ids.operation_id(c.ChildrenCompleted(task_id="P", children=rows[::-1]))
    changed = operation_ids.operation_id(
        c.ChildrenCompleted(task_id="P", children=[rows[0], c.ChildRow(task_id="b", state="failed")])
    )
    assert one == other != changed
    prefix, parent, digest = one.split(":")
    assert (prefix, parent, len(digest)) == ("on_children_completed", "P", 64)
    assert operation_ids.decision_operation_id("T", "review", "d1") == "decision:T:review:d1"
    assert operation_ids.switch_workflow_operation_id("op", "on_exit") == "op:switch_workflow:on_exit"


def test_ac_b2_reconfigure_signature_offers_no_way_to_pass_a_ledger() -> None:
    assert "ledger" not in inspect.signature(supervisor.Runtime.reconfigure).parameters
