"""The on_agent_error caller (AC-EO-10, 11, 12, 14, 17): commit the deferred transition, then mark iff it
committed. Driven through `agent_error` protocol messages; the four non-committing paths are real faults.
"""

from __future__ import annotations

import attrs
import pytest
from eo_support import (
    OP,
    STEPS,
    TASK,
    ScriptedHost,
    agent_error,
    applied,
    callbacks,
    commit_failures,
    evaluate,
    move_to,
    moves,
    queue,
    reload_during_evaluation,
    run_sql,
    runs_for,
    setup,
    step_of,
    workflow_yaml,
)
from helpers import of_type, ok, register

from onceflow.actors.runtime.supervisor import Runtime

# A reload that drops the target step (work keeps its callback but loses the transition to triage).
WITHOUT_TARGET = workflow_yaml(
    {"work": {"is_start_step": True, "events": {"on_agent_error": [queue("fixer")]}}}
)
# A reload that drops the source step the task occupies.
WITHOUT_SOURCE = workflow_yaml({"triage": {"is_start_step": True}, "quiet": {}})
# The step change itself fails to write.
WRITE_FAULT = (
    "CREATE TRIGGER eo_write_fault BEFORE UPDATE OF workflow_step_id ON tasks"
    " BEGIN SELECT RAISE(ABORT, 'disk on fire'); END"
)


@attrs.define
class Fault:
    """One non-committing path of the deferred commit (AC-EO-11): armed before the first delivery.

    The two reload faults must land between the evaluation and the commit of one command. A concurrent
    register_workflow cannot do that in onceflow (each command keeps the Services snapshot it started with),
    so they are injected through the executor registry: the evaluated queue_run callback swaps the template
    in the registry the in-flight command reads (ReloadDuringEvaluation).
    """

    name: str
    cause: tuple[str, ...]  # fragments of the deferred_commit_failed diagnostic's cause

    async def arm(self, rt: Runtime, host: ScriptedHost) -> None:
        if self.name == "target-missing":
            reload_during_evaluation(rt, WITHOUT_TARGET)
        elif self.name == "source-missing":
            reload_during_evaluation(rt, WITHOUT_SOURCE)
        elif self.name == "preflight-refused":
            host.refuse = True
        else:
            await run_sql(rt, WRITE_FAULT)

    async def clear(self, rt: Runtime, host: ScriptedHost) -> None:
        if self.name in ("target-missing", "source-missing"):
            await register(rt, workflow_yaml(), import_path=True)  # the full template is registered again
        elif self.name == "preflight-refused":
            host.refuse = False
        else:
            await run_sql(rt, "DROP TRIGGER eo_write_fault")


FAULTS = [
    Fault("target-missing", ("NotFoundError", "has no step", "triage")),
    Fault("preflight-refused", ("TransitionRefusedError", "credentials for", "expired")),
    Fault("source-missing", ("NotFoundError", "has no step", "work")),
    Fault("write-failed", ("IntegrityError", "disk on fire")),
]


async def test_ac_eo_10_committed_deferred_transition_is_marked(runtime: Runtime) -> None:
    await setup(runtime)
    reply = await agent_error(runtime)
    assert reply.ok, reply.error
    assert reply.result["operation_id"] == OP
    assert reply.result["operation_mark_deferred"] is True  # the engine handed the mark over ...
    assert (reply.result["idempotent"], reply.result["applied"]) == (False, True)
    assert moves(reply.events) == [("work", "triage")]
    assert await applied(runtime)  # ... and the caller marked after its commit
    again = await agent_error(runtime)
    assert again.result["idempotent"] is True
    assert again.events == []
    assert await step_of(runtime) == "triage"
    assert len(await runs_for(runtime, "fixer")) == 1
    assert await runs_for(runtime, "triager") == []


@pytest.mark.parametrize("fault", FAULTS, ids=lambda fault: fault.name)
async def test_ac_eo_10_ac_eo_11_failed_commit_leaves_the_operation_retryable(
    runtime: Runtime, host: ScriptedHost, fault: Fault
) -> None:
    await setup(runtime)
    await fault.arm(runtime, host)

    failed = await agent_error(runtime)
    assert failed.ok, failed.error
    assert (failed.result["operation_mark_deferred"], failed.result["applied"]) == (True, False)
    (diagnostic,) = commit_failures(failed.events)
    assert diagnostic["operation_id"] == OP
    assert all(fragment in diagnostic["cause"] for fragment in fault.cause), diagnostic["cause"]
    assert moves(failed.events) == []
    assert await step_of(runtime) == "work"
    assert not await applied(runtime)

    await fault.clear(runtime, host)
    retried = await agent_error(runtime)
    assert retried.result["idempotent"] is False  # re-evaluated, not short-circuited
    assert retried.result["applied"] is True
    assert moves(retried.events) == [("work", "triage")]
    assert await applied(runtime)

    third = await agent_error(runtime)
    assert third.result["idempotent"] is True
    assert third.events == []
    assert await step_of(runtime) == "triage"


async def test_ac_eo_11_fault_still_present_keeps_the_operation_retryable(
    runtime: Runtime, host: ScriptedHost
) -> None:
    await setup(runtime)
    host.refuse = True
    for _ in range(3):
        reply = await agent_error(runtime)
        assert reply.result["idempotent"] is False
        assert len(commit_failures(reply.events)) == 1
    assert host.preflights == [("work", "triage")] * 3
    assert not await applied(runtime)


async def test_ac_eo_14_source_callbacks_run_again_after_a_failed_commit(
    runtime: Runtime, host: ScriptedHost
) -> None:
    await setup(runtime)
    host.refuse = True
    first = await agent_error(runtime)
    (queued,) = of_type(first.events, "run_queued")
    host.refuse = False
    retried = await agent_error(runtime)
    # The source step's callback runs again alongside the re-evaluation (at-least-once) ...
    assert callbacks(retried.events) == [("work", "queue_run", "done")]
    # ... but its effect is deduplicated downstream: the run's idempotency key is built from the operation
    # id (plus step, task, agent and config digest), so the replayed enqueue is reported as suppressed
    # against the first run instead of inserting a second fixer run.
    (suppressed,) = of_type(retried.events, "run_suppressed")
    assert suppressed.existing_run_id == queued.run_id
    assert suppressed.idempotency_key == queued.idempotency_key
    assert queued.idempotency_key.startswith(f"{OP}:work:")
    assert len(await runs_for(runtime, "fixer")) == 1
    assert moves(retried.events) == [("work", "triage")]


async def test_ac_eo_17_committed_but_unmarked_redelivery_evaluates_the_target_step(
    runtime: Runtime,
) -> None:
    await setup(runtime)
    result, _ = await evaluate(runtime, evaluate_only=True)  # the engine defers, nothing marks ...
    assert result.operation_mark_deferred is True
    await ok(runtime, {"type": "move_task", "task_id": TASK, "step_id": "triage"})  # ... the commit lands
    assert not await applied(runtime)

    reply = await agent_error(runtime)
    assert reply.result["idempotent"] is False
    assert reply.result["from_step"] == "triage"
    assert callbacks(reply.events) == [("triage", "queue_run", "done")]  # not the source's callbacks
    assert len(await runs_for(runtime, "triager")) == 1
    assert len(await runs_for(runtime, "fixer")) == 1  # only the first evaluation's
    assert moves(reply.events) == []
    assert await applied(runtime)  # no transition at triage: marked (AC-EO-2)
    assert (await agent_error(runtime)).result["idempotent"] is True


async def test_ac_eo_17_lost_mark_after_commit_then_a_further_transition(
    runtime: Runtime, monkeypatch
) -> None:
    """The reachable window: the actor dies between the commit and the mark (AC-EO-12's consequence)."""
    steps = {**STEPS, "triage": {"events": {"on_agent_error": [queue("triager"), move_to("quiet")]}}}
    await setup(runtime, text=workflow_yaml(steps))
    ledger = runtime.services.ledger
    real_mark = ledger.mark_applied

    async def crash_once(operation_id: str) -> None:
        monkeypatch.setattr(ledger, "mark_applied", real_mark)
        raise RuntimeError("actor died before the mark")

    monkeypatch.setattr(ledger, "mark_applied", crash_once)
    crashed = await agent_error(runtime)
    assert not crashed.ok and crashed.error.code == "internal"
    assert moves(crashed.events) == [("work", "triage")]  # committed ...
    assert not await applied(runtime)  # ... unmarked

    again = await agent_error(runtime)  # the restarted actor evaluates the step the task occupies
    assert callbacks(again.events) == [("triage", "queue_run", "done")]
    assert moves(again.events) == [("triage", "quiet")]  # a further transition is permitted
    assert again.result["applied"] is True
    assert await applied(runtime)
    assert (await agent_error(runtime)).result["idempotent"] is True
    assert await step_of(runtime) == "quiet"


async def test_ac_eo_10_ac_c4_a_failing_on_enter_after_the_commit_still_marks(runtime: Runtime) -> None:
    """The step change committed; its on_enter bookkeeping then fails (a fault on the entry's terminal
    flag). The transition stands (on-enter spec AC-C4), so the commit succeeded and the caller marks
    (AC-EO-10); the entry stays open for the next start's recovery scan."""
    triage = {"events": {"on_enter": [queue("greeter")], "on_agent_error": [queue("triager")]}}
    await setup(runtime, text=workflow_yaml({**STEPS, "triage": triage}))
    await run_sql(
        runtime,
        "CREATE TRIGGER eo_post_commit_fault BEFORE UPDATE OF terminal ON step_entries"
        " BEGIN SELECT RAISE(ABORT, 'disk on fire'); END",
    )
    first = await agent_error(runtime)
    assert moves(first.events) == [("work", "triage")]
    assert commit_failures(first.events) == [] and first.result["applied"] is True
    assert await step_of(runtime) == "triage"
    assert await applied(runtime)
    assert (await agent_error(runtime)).result["idempotent"] is True
    assert len(await runs_for(runtime, "fixer")) == 1


@pytest.mark.parametrize(
    "operation_id", ["", OP, "agent_error:ü" * 500, "x" * 10_000], ids=["empty", "op", "unicode", "long"]
)
async def test_ac_eo_12_ledger_mark_never_fails(runtime: Runtime, operation_id: str) -> None:
    """AC-EO-12: the caller's own mark cannot fail — the ledger's mark_applied never raises — so the
    warn-and-continue branch is unreachable and is not driven at runtime; this pins why."""
    for _ in range(2):  # marking twice is a no-op, not an error
        await runtime.services.ledger.mark_applied(operation_id)
    assert await applied(runtime, operation_id) is bool(operation_id)
