"""Failure isolation: a failing on_enter action never rolls back the entry and only clear_decisions stops it.

on-enter-action-dispatch.md group C (AC-C1 … AC-C5) and AC-E2's all-empty case, with their Verification
lines ("AC-C1 vs AC-C3 precedence", "AC-C4", "AC-C5", "AC-E2 accounting").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dispatch_support import (
    PATHS,
    STEP,
    WF,
    clear_failing,
    create,
    decide,
    decisions,
    diags,
    enter,
    entries,
    fan_out_failing_for,
    loud,
    markers,
    records,
    runs,
    seat,
    setup,
    spy_on,
)
from helpers import FakeClock, ok, send
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect

FAN_OUT_THEN_KICK = """
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
- type: queue_run
  config: {target: primary, reason: kick}
"""


async def test_ac_c1_ac_c3_precedence_two_participants_fail_differently_and_only_c1_records_appear(
    runtime: Runtime,
) -> None:
    await setup(runtime, FAN_OUT_THEN_KICK, reviewers=())
    # AC-A5 order is position, then id: rev-broken is enumerated first although it was seated last.
    empty = await seat(runtime, "reviewer", "", position=1)
    await seat(runtime, "reviewer", "rev-ok", position=2)
    broken = await seat(runtime, "reviewer", "rev-broken", position=0)
    runtime.reconfigure(
        executors={**DEFAULT_EXECUTORS, "queue_run_for_each_participant": fan_out_failing_for("rev-broken")}
    )
    with capture_logs() as logs:
        events = await enter(runtime, "E2")

    c1 = records(logs, "fan_out_participant_failed", "error")
    assert [(r["participant_id"], r["agent_profile_id"]) for r in c1] == [(broken, "rev-broken"), (empty, "")]
    assert "rev-broken" in c1[0]["cause"] and "agent_profile_id" in c1[1]["cause"]
    assert all((r["task_id"], r["step_id"]) == ("T1", STEP) for r in c1)
    assert records(logs, "on_enter_action_failed") == []  # no AC-C3 action-level record for a fan-out
    assert [r["event"] for r in logs if r["log_level"] == "error"] == ["fan_out_participant_failed"] * 2
    [finished] = records(logs, "fan_out_finished", "info")
    assert (finished["matching"], finished["enqueued"], finished["suppressed"]) == (3, 1, 0)

    [fan_out, kick] = await markers(runtime)
    assert fan_out[:3] == (0, "queue_run_for_each_participant", "failed")
    attempted, failed, first_cause = fan_out[3].split(" ", 2)
    assert (attempted, failed) == ("attempted=3", "failed=2")
    assert first_cause.startswith("first_cause=") and "rev-broken" in first_cause  # the first in AC-A5 order
    assert kick[2] == "done"  # a failed fan-out does not stop the actions after it
    assert [r["agent_profile_id"] for r in await runs(runtime)] == ["rev-ok", "worker"]
    assert (
        diags(events, "fan_out_participant_failed", "error") and diags(events, "on_enter_action_failed") == []
    )


@pytest.mark.parametrize("how", ["raises", "reports_failure"])
async def test_ac_c2_a_failed_clear_stops_every_later_action_with_one_error(
    runtime: Runtime, how: str
) -> None:
    await setup(
        runtime,
        """
        - type: queue_run
          config: {target: primary, reason: before}
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: wake}
        - type: run_code_review
        - type: set_session_mode
          config: {mode: review}
        """,
    )
    spy = spy_on(runtime, executors={**DEFAULT_EXECUTORS, "clear_decisions": clear_failing(how)})
    await create(runtime, "T1")
    await decide(runtime, "T1", STEP)
    with capture_logs() as logs:
        await enter(runtime, "E2", created=True)

    assert spy.kinds() == ["queue_run", "clear_decisions"]  # nothing declared after the failed clear
    assert [r["reason"] for r in await runs(runtime)] == ["before"]
    assert spy.code_reviews == [] and spy.session_actions == []
    assert len(await decisions(runtime, "T1", STEP)) == 1
    [error] = [r for r in logs if r["log_level"] == "error"]  # one record: AC-C3 does not apply after it
    assert error["event"] == "on_enter_action_failed"
    assert (error["workflow_id"], error["step_id"], error["task_id"]) == (WF, STEP, "T1")
    assert error["cause"]
    marks = await markers(runtime)
    assert [p for p, *_ in marks if p > 1] == []  # the later positions never reached their dispatcher
    expected_clear = [] if how == "raises" else [(1, "clear_decisions", "failed")]
    assert [(p, k, s) for p, k, s, _ in marks if p == 1] == expected_clear


C3_FIRST = {
    "queue_run": "- type: queue_run\n  config: {target: 'participant_role:approver', reason: nobody}",
    "ensure_participant_seat": "- type: ensure_participant_seat\n  config: {role: reviewer}",
}


def _seat_check_raises(conn: Any, ctx: ActionContext, action: ActionDecl) -> Effect:
    raise RuntimeError("seat service unavailable")


@pytest.mark.parametrize("failing", list(C3_FIRST))
async def test_ac_c3_a_failed_action_is_reported_and_the_remaining_actions_still_run(
    runtime: Runtime, failing: str
) -> None:
    """queue_run fails by resolving to nobody; ensure_participant_seat by its executor raising."""
    await setup(
        runtime,
        C3_FIRST[failing] + "\n" + FAN_OUT_THEN_KICK + "- type: set_session_mode\n  config: {mode: x}",
    )
    spy = spy_on(runtime, executors={**DEFAULT_EXECUTORS, "ensure_participant_seat": _seat_check_raises})
    with capture_logs() as logs:
        events = await enter(runtime, "E1")

    assert spy.kinds() == [failing, "queue_run_for_each_participant", "queue_run", "set_session_mode"]
    assert [r["agent_profile_id"] for r in await runs(runtime)] == ["rev-a", "rev-b", "worker"]
    [error] = [r for r in logs if r["log_level"] == "error"]
    assert (error["event"], error["workflow_id"], error["step_id"], error["action_type"]) == (
        "on_enter_action_failed",
        WF,
        STEP,
        failing,
    )
    assert error["cause"]
    assert loud(events) == [("error", "on_enter_action_failed")]


@pytest.mark.parametrize(
    "failure", ["clear_raises", "clear_reports_failure", "fan_out_all_fail", "queue_run_unresolvable"]
)
@pytest.mark.parametrize("path", PATHS)
async def test_ac_c4_a_failing_on_enter_action_never_rolls_the_task_back(
    runtime: Runtime, failure: str, path: str
) -> None:
    declaration = {
        "fan_out_all_fail": "- type: queue_run_for_each_participant\n  config: {role: reviewer}",
        "queue_run_unresolvable": "- type: queue_run\n  config: {target: 'participant_role:approver'}",
    }.get(failure, "- type: clear_decisions")
    await setup(runtime, declaration, path=path, reviewers=("", ""))
    if failure.startswith("clear"):
        how = failure.removeprefix("clear_")
        runtime.reconfigure(executors={**DEFAULT_EXECUTORS, "clear_decisions": clear_failing(how)})

    events = await enter(runtime, path)  # asserts the reply was ok and the task stands at disp/review

    assert any(level == "error" for level, _ in loud(events))  # the action did fail
    assert [e["step_id"] for e in await entries(runtime)] == [STEP]
    task = (await ok(runtime, {"type": "get_task", "task_id": "T1"})).result
    assert (task["workflow_id"], task["step_id"], task["wip_admitted"]) == (WF, STEP, True)


ON_BLOCKER = """\
      on_blocker_resolved:
        - type: queue_run
          config: {target: "participant_role:approver", reason: nobody}
        - type: queue_run
          config: {target: primary, reason: after}
        - type: move_to_step
          config: {step_id: done}
"""


async def test_ac_c5_other_triggers_still_abort_on_the_first_failing_action(runtime: Runtime) -> None:
    # The same two queue_runs: aborting under on_blocker_resolved, continuing under on_enter.
    await setup(
        runtime,
        """
        - type: queue_run
          config: {target: "participant_role:approver", reason: nobody}
        - type: queue_run
          config: {target: primary, reason: after}
        """,
        work_extra=ON_BLOCKER,
    )
    await create(runtime, "T1")
    aborted = await send(runtime, {"type": "blockers_resolved", "task_id": "T1"})

    assert not aborted.ok and aborted.error is not None and aborted.error.code == "action_failed"
    assert await runs(runtime) == []  # the action after the failing one never ran
    task = (await ok(runtime, {"type": "get_task", "task_id": "T1"})).result
    assert task["step_id"] == "work"  # nor did the transition declared after it

    await enter(runtime, "E2", created=True)
    assert [r["reason"] for r in await runs(runtime)] == ["after"]  # on_enter continues past the failure


async def test_ac_e2_every_participant_without_a_profile_fails_the_fan_out_terminally(
    db_path: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup(rt, FAN_OUT_THEN_KICK, reviewers=())
        first = await seat(rt, "reviewer", "")
        second = await seat(rt, "reviewer", "", position=1)
        with capture_logs() as logs:
            await enter(rt, "E2")

        errors = records(logs, "fan_out_participant_failed", "error")
        assert [(r["participant_id"], r["agent_profile_id"]) for r in errors] == [(first, ""), (second, "")]
        [finished] = records(logs, "fan_out_finished", "info")
        assert (finished["matching"], finished["enqueued"], finished["suppressed"]) == (2, 0, 0)
        [fan_out, kick] = await markers(rt)
        assert fan_out[2:] == (
            "failed",
            "attempted=2 failed=2 first_cause=participant has no agent_profile_id",
        )
        assert kick[2] == "done"
        assert [e["terminal"] for e in await entries(rt)] == [True]

    with capture_logs() as logs:
        async with open_runtime(db_path, clock=clock) as rt:  # the failed marker is terminal: not resumed
            assert [r["reason"] for r in await runs(rt)] == ["kick"]
            assert (await markers(rt))[0][2] == "failed"
    assert records(logs, "fan_out_participant_failed") == [] and records(logs, "fan_out_finished") == []
