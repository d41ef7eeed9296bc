"""The engine contract (AC-EO-1 ... AC-EO-8): when `Engine.handle_trigger` marks an operation id applied.

Each test drives the real engine of a real runtime on a SQLite file; the workflow and the task are set up
through protocol messages and the ledger is observed through the ledger actor (and a pass-through spy when
the AC is about which ledger calls are made at all).
"""

from __future__ import annotations

import pytest
from eo_support import (
    OP,
    TASK,
    WF,
    ScriptedHost,
    applied,
    callbacks,
    create,
    evaluate,
    move_to,
    runs_for,
    setup,
    spy_ledger,
    step_of,
    workflow_yaml,
)
from helpers import ok, register

from onceflow.actors.engine.engine import HandleResult
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.errors import ActionError
from onceflow.protocol.workflow import HOST_ACTION_TYPES, SESSION_ACTION_TYPES, TRANSITION_TYPES, Trigger
from onceflow.store.entries.executors import DEFAULT_EXECUTORS

# boom: a transition to parked, then a queue_run for the task's primary agent, which fails (ActionError)
# while the task has no primary agent.
FAILING = workflow_yaml(
    {
        "boom": {
            "is_start_step": True,
            "events": {
                "on_agent_error": [
                    move_to("parked"),
                    {"type": "queue_run", "config": {"target": "primary", "reason": "agent_error"}},
                ]
            },
        },
        "parked": {},
    },
    workflow_id="eo-fail",
)


async def test_ac_eo_1_deferred_transition_is_not_marked(runtime: Runtime, monkeypatch) -> None:
    await setup(runtime)
    spy = spy_ledger(monkeypatch, runtime)
    result, out = await evaluate(runtime, evaluate_only=True)
    assert (result.transitioned, result.from_step, result.to_step) == (True, "work", "triage")
    assert result.applied is False
    assert OP not in spy.marked
    assert not await applied(runtime)
    # The transition was left to the caller (the task has not moved), the callback did run.
    assert await step_of(runtime) == "work"
    assert callbacks(out.events) == [("work", "queue_run", "done")]
    assert len(await runs_for(runtime, "fixer")) == 1


async def test_ac_eo_1_unmarked_deferred_operation_is_evaluated_again(runtime: Runtime) -> None:
    await setup(runtime)
    await evaluate(runtime, evaluate_only=True)
    again, _ = await evaluate(runtime, evaluate_only=True)
    assert again.idempotent is False
    assert again.transitioned is True
    assert again.operation_mark_deferred is True


@pytest.mark.parametrize(
    "step",
    [
        pytest.param("triage", id="callbacks-only"),
        pytest.param("loop", id="transition-to-the-current-step"),
    ],
)
async def test_ac_eo_2_evaluate_only_without_transition_marks(runtime: Runtime, step: str) -> None:
    await setup(runtime, step)
    result, out = await evaluate(runtime, evaluate_only=True)
    assert result.transitioned is False
    assert result.operation_mark_deferred is False
    assert await applied(runtime)
    # Callbacks ran on this call, and the mark makes the next delivery a no-op.
    assert [kind for _, kind, outcome in callbacks(out.events) if outcome == "done"] == ["queue_run"]
    again, again_out = await evaluate(runtime, evaluate_only=True)
    assert again == HandleResult(idempotent=True)
    assert again_out.events == []
    assert await step_of(runtime) == step


async def test_ac_eo_3_not_evaluate_only_commits_then_marks(runtime: Runtime) -> None:
    await setup(runtime)
    result, out = await evaluate(runtime, evaluate_only=False)
    assert (result.transitioned, result.applied, result.operation_mark_deferred) == (True, True, False)
    assert await step_of(runtime) == "triage"
    assert await applied(runtime)
    assert [(e.from_step, e.to_step) for e in out.events if e.type == "transition"] == [("work", "triage")]
    again, _ = await evaluate(runtime, evaluate_only=False)
    assert again.idempotent is True
    assert await step_of(runtime) == "triage"


async def test_ac_eo_3_not_evaluate_only_without_transition_marks(runtime: Runtime) -> None:
    await setup(runtime, "triage")
    result, _ = await evaluate(runtime, evaluate_only=False)
    assert (result.transitioned, result.applied) == (False, False)
    assert await applied(runtime)


@pytest.mark.parametrize(
    ("step", "op", "evaluate_only", "premarked", "transitioned", "flag"),
    [
        pytest.param("work", OP, True, False, True, True, id="deferred-with-id"),
        pytest.param("work", OP, True, True, False, False, id="idempotent-short-circuit"),
        pytest.param("quiet", OP, True, False, False, False, id="no-actions"),
        pytest.param("triage", OP, True, False, False, False, id="evaluate-only-no-transition"),
        pytest.param("work", OP, False, False, True, False, id="not-evaluate-only"),
        pytest.param("work", "", True, False, True, False, id="deferred-with-empty-id"),
    ],
)
async def test_ac_eo_4_mark_deferred_flag_is_true_iff_deferred_with_an_id(
    runtime: Runtime, step: str, op: str, evaluate_only: bool, premarked: bool, transitioned: bool, flag: bool
) -> None:
    await setup(runtime, step)
    if premarked:
        await runtime.services.ledger.mark_applied(op)
    result, _ = await evaluate(runtime, op, evaluate_only=evaluate_only)
    assert result.transitioned is transitioned
    assert result.operation_mark_deferred is flag
    assert result.idempotent is premarked
    # The flag says exactly "the engine skipped the mark of a non-empty id".
    assert (bool(op) and not await applied(runtime, op)) is flag


def test_ac_eo_4_the_zero_result_claims_no_ownership() -> None:
    assert HandleResult().operation_mark_deferred is False


@pytest.mark.parametrize("evaluate_only", [True, False], ids=["evaluate-only", "commit"])
async def test_ac_eo_4_ac_eo_5_action_failure_returns_no_result_and_leaves_the_id_unmarked(
    runtime: Runtime, monkeypatch, evaluate_only: bool
) -> None:
    await register(runtime, FAILING, import_path=True)
    await create(runtime, "boom", workflow_id="eo-fail")  # no primary agent: queue_run target fails
    spy = spy_ledger(monkeypatch, runtime)
    for _ in range(2):  # a redelivery is not short-circuited: it runs (and fails) again
        with pytest.raises(ActionError, match="resolves to no agent profile"):
            await evaluate(runtime, evaluate_only=evaluate_only)
    assert spy.checked == [OP, OP]
    assert spy.marked == []
    assert not await applied(runtime)
    assert await step_of(runtime) == "boom"


async def test_ac_eo_5_failed_operation_succeeds_once_the_fault_is_gone(runtime: Runtime) -> None:
    await register(runtime, FAILING, import_path=True)
    await create(runtime, "boom", workflow_id="eo-fail")
    with pytest.raises(ActionError):
        await evaluate(runtime, evaluate_only=False)
    await ok(runtime, {"type": "update_task", "task_id": TASK, "primary_agent_id": "worker"})
    result, out = await evaluate(runtime, evaluate_only=False)
    assert (result.idempotent, result.applied) == (False, True)
    assert callbacks(out.events) == [("boom", "queue_run", "done")]
    assert await step_of(runtime) == "parked"
    assert await applied(runtime)


@pytest.mark.parametrize("evaluate_only", [True, False], ids=["evaluate-only", "commit"])
async def test_ac_eo_6_no_declared_actions_marks(runtime: Runtime, evaluate_only: bool) -> None:
    await setup(runtime, "quiet")
    result, out = await evaluate(runtime, evaluate_only=evaluate_only)
    assert result == HandleResult(from_step="quiet")
    assert out.events == []
    assert await applied(runtime)
    assert (await evaluate(runtime, evaluate_only=evaluate_only))[0].idempotent is True


@pytest.mark.parametrize(
    ("step", "evaluate_only"),
    [("work", True), ("work", False), ("triage", True), ("quiet", False)],
    ids=["deferred", "committed", "callbacks-only", "no-actions"],
)
async def test_ac_eo_7_empty_operation_id_never_touches_the_ledger(
    runtime: Runtime, monkeypatch, step: str, evaluate_only: bool
) -> None:
    await setup(runtime, step)
    spy = spy_ledger(monkeypatch, runtime)
    first, _ = await evaluate(runtime, "", evaluate_only=evaluate_only)
    second, _ = await evaluate(runtime, "", evaluate_only=evaluate_only)
    assert (spy.checked, spy.marked) == ([], [])
    assert not second.idempotent  # nothing short-circuits without an id
    assert first.operation_mark_deferred is second.operation_mark_deferred is False
    assert not await applied(runtime, "")


async def test_ac_eo_7_empty_operation_id_enqueues_runs_without_an_idempotency_key(runtime: Runtime) -> None:
    await setup(runtime, "triage")
    _, first = await evaluate(runtime, "", evaluate_only=True)
    _, second = await evaluate(runtime, "", evaluate_only=True)
    (run,) = await runs_for(runtime, "triager")
    assert run["idempotency_key"] is None
    assert [e.type for e in first.events if e.type.startswith("run_")] == ["run_queued"]
    # Without a key the second enqueue is not suppressed: it coalesces into the queued run.
    assert [e.type for e in second.events if e.type.startswith("run_")] == ["run_coalesced"]


# --- AC-EO-8: the host-owned (session-shaped) action kinds --------------------------------------------

HOST_ONLY = workflow_yaml(
    {"chat": {"is_start_step": True, "events": {"on_turn_complete": [{"type": "disable_plan_mode"}]}}},
    workflow_id=WF,
)


def test_ac_eo_8_host_owned_action_kinds_admit_no_transition_kind() -> None:
    """If this fails, a host-owned trigger can defer a transition and AC-EO-1 becomes reachable there."""
    assert HOST_ACTION_TYPES.isdisjoint(TRANSITION_TYPES)
    assert SESSION_ACTION_TYPES.isdisjoint(TRANSITION_TYPES)
    assert set(DEFAULT_EXECUTORS).isdisjoint(TRANSITION_TYPES)


async def test_ac_eo_8_host_owned_actions_only_mark_like_any_non_transition(
    runtime: Runtime, host: ScriptedHost
) -> None:
    await setup(runtime, "chat", HOST_ONLY)
    result, out = await evaluate(runtime, "turn:1", trigger=Trigger.on_turn_complete, evaluate_only=True)
    assert (result.transitioned, result.operation_mark_deferred) == (False, False)  # AC-EO-4
    assert [request.action for request in host.session_actions] == ["disable_plan_mode"]
    assert [e.type for e in out.events] == ["session_action"]
    assert await applied(runtime, "turn:1")  # AC-EO-2
    again, _ = await evaluate(runtime, "turn:1", trigger=Trigger.on_turn_complete, evaluate_only=True)
    assert again.idempotent is True
    assert len(host.session_actions) == 1


async def test_ac_eo_8_host_owned_actions_with_empty_id_leave_the_ledger_alone(
    runtime: Runtime, host: ScriptedHost, monkeypatch
) -> None:
    await setup(runtime, "chat", HOST_ONLY)
    spy = spy_ledger(monkeypatch, runtime)
    for _ in range(2):
        result, _ = await evaluate(runtime, "", trigger=Trigger.on_turn_complete, evaluate_only=True)
        assert (result.idempotent, result.operation_mark_deferred) == (False, False)
    assert (spy.checked, spy.marked) == ([], [])  # AC-EO-7
    assert len(host.session_actions) == 2
