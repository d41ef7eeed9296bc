"""Ordering and ownership: fixed positions, declared order across owners, one executor per action per entry.

on-enter-action-dispatch.md: "The ownership partition", AC-A9, AC-A2(ii), AC-A11, AC-A12, AC-A13, AC-D1,
AC-H4 and AC-H8, with their Verification lines. Order is observed on one timeline (dispatch_support.Spy)
that records host session actions, engine executor calls and code-review starts as they happen.
"""

from __future__ import annotations

import pytest
from dispatch_support import (
    CONFIGURE,
    HOISTING_PATHS,
    PATHS,
    STEP,
    diags,
    enter,
    entries,
    loud,
    runs,
    setup,
    spy_on,
)
from helpers import of_type

from onceflow.actors.runtime.supervisor import Runtime

# AC-A9's Verification line: clear_decisions before reset_agent_context, auto_start_agent before
# clear_decisions; configure_session in the middle so its second place is pinned too.
FIXED = f"""
- type: auto_start_agent
- type: set_session_mode
  config: {{mode: review}}
- type: clear_decisions
- type: configure_session
  config: {CONFIGURE}
- type: reset_agent_context
- type: queue_run_for_each_participant
  config: {{role: reviewer, reason: wake}}
"""


@pytest.mark.parametrize("path", HOISTING_PATHS)
async def test_ac_a9_reset_first_configure_second_and_the_agent_starts_last(
    runtime: Runtime, path: str
) -> None:
    await setup(runtime, FIXED, path=path)
    spy = spy_on(runtime)
    await enter(runtime, path)
    assert spy.kinds() == [
        "reset_agent_context",
        "configure_session",
        "set_session_mode",
        "clear_decisions",
        "queue_run_for_each_participant",
        "auto_start_agent",
    ]


SAME_LIST = """
- type: auto_start_agent
- type: clear_decisions
- type: set_session_mode
  config: {mode: review}
- type: reset_agent_context
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
"""


async def test_ac_a2_ac_a13_the_same_list_has_the_same_coverage_on_e1_and_e4_but_a_different_order(
    runtime: Runtime,
) -> None:
    """AC-A2(ii): hoisting on E1 only; E4 keeps declared order. Fails if compileOnEnter-style hoisting is
    added to E4, or if E1 loses its fixed positions."""
    await setup(runtime, SAME_LIST, path="E1")
    spy = spy_on(runtime)
    await enter(runtime, "E1", "T1")
    await enter(runtime, "E4", "T4")

    assert sorted(spy.kinds("T1")) == sorted(spy.kinds("T4"))  # the same action coverage
    assert spy.kinds("T1") == [
        "reset_agent_context",
        "clear_decisions",
        "set_session_mode",
        "queue_run_for_each_participant",
        "auto_start_agent",
    ]
    assert spy.kinds("T4") == [
        "auto_start_agent",
        "clear_decisions",
        "set_session_mode",
        "reset_agent_context",
        "queue_run_for_each_participant",
    ]
    assert spy.kinds("T1") != spy.kinds("T4")


SESSION_AROUND_ENGINE = """
- type: reset_agent_context
- type: enable_plan_mode
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
- type: set_session_mode
  config: {mode: review}
- type: auto_start_agent
"""


@pytest.mark.parametrize("path", PATHS)
async def test_ac_a11_each_session_action_takes_effect_exactly_once_through_one_owner(
    runtime: Runtime, path: str
) -> None:
    await setup(runtime, SESSION_AROUND_ENGINE, path=path)
    spy = spy_on(runtime)  # the shared registry also carries executors for the session kinds
    events = await enter(runtime, path)

    performed = [request.action for request in spy.session_actions if request.task_id == "T1"]
    assert sorted(performed) == [
        "auto_start_agent",
        "enable_plan_mode",
        "reset_agent_context",
        "set_session_mode",
    ]
    assert spy.registry_calls == []  # never delegated to the engine's callback registry as well
    assert [e.action for e in of_type(events, "session_action")] == performed
    assert spy.kinds().count("queue_run_for_each_participant") == 1
    assert len(await runs(runtime, task_id="T1")) == 2


# Interleaved owners, and auto_start_agent deliberately NOT last in the declared list (AC-A12).
INTERLEAVED = """
- type: set_session_mode
  config: {mode: review}
- type: clear_decisions
- type: auto_start_agent
- type: enable_plan_mode
- type: queue_run
  config: {target: primary, reason: kick}
- type: set_session_mode
  config: {mode: strict}
"""


@pytest.mark.parametrize("path", HOISTING_PATHS)
async def test_ac_a12_declared_order_holds_across_the_ownership_partition(
    runtime: Runtime, path: str
) -> None:
    await setup(runtime, INTERLEAVED, path=path)
    spy = spy_on(runtime)
    await enter(runtime, path)
    assert spy.calls() == [
        ("set_session_mode", "review"),
        ("clear_decisions", ""),
        ("enable_plan_mode", ""),
        ("queue_run", "kick"),
        ("set_session_mode", "strict"),
        ("auto_start_agent", ""),  # AC-A9's deferral, the only departure from the declared order
    ]


async def test_ac_a13_switch_workflow_still_runs_the_four_session_types_in_declared_order(
    runtime: Runtime,
) -> None:
    await setup(
        runtime,
        """
        - type: enable_plan_mode
        - type: auto_start_agent
        - type: set_session_mode
          config: {mode: review}
        - type: reset_agent_context
        - type: clear_decisions
        """,
    )
    spy = spy_on(runtime)
    events = await enter(runtime, "E4")

    assert spy.kinds() == [
        "enable_plan_mode",
        "auto_start_agent",
        "set_session_mode",
        "reset_agent_context",
        "clear_decisions",
    ]
    assert {(r.action, r.session_id, r.entry_path) for r in spy.session_actions} == {
        (kind, "s-T1", "E4")
        for kind in ("enable_plan_mode", "auto_start_agent", "set_session_mode", "reset_agent_context")
    }
    assert spy.registry_calls == []
    assert loud(events) == []


REPEATED = f"""
- type: set_session_mode
  config: {{mode: first}}
- type: reset_agent_context
- type: configure_session
  config: {CONFIGURE}
- type: queue_run
  config: {{target: primary, reason: one}}
- type: reset_agent_context
- type: set_session_mode
  config: {{mode: second}}
- type: configure_session
  config: {CONFIGURE}
- type: queue_run
  config: {{target: primary, reason: two}}
- type: enable_plan_mode
- type: enable_plan_mode
"""


@pytest.mark.parametrize("path", PATHS)
async def test_ac_h4_ac_h8_repeats_run_each_in_order_but_reset_and_configure_only_once(
    runtime: Runtime, path: str
) -> None:
    await setup(runtime, REPEATED, path=path)
    spy = spy_on(runtime)
    events = await enter(runtime, path)

    repeated = [
        ("set_session_mode", "first"),
        ("queue_run", "one"),
        ("set_session_mode", "second"),
        ("queue_run", "two"),
        ("enable_plan_mode", ""),
        ("enable_plan_mode", ""),
    ]
    if path == "E4":  # declared order; configure_session has no owner on E4 and warns, once
        assert spy.calls() == [repeated[0], ("reset_agent_context", ""), *repeated[1:]]
        assert [d.fields["action_type"] for d in diags(events, "action_not_executed")] == [
            "configure_session"
        ]
    else:
        assert spy.calls() == [("reset_agent_context", ""), ("configure_session", ""), *repeated]
        assert diags(events, "action_not_executed") == []
    assert [r["reason"] for r in await runs(runtime, task_id="T1")] == ["one", "two"]


SESSION_ONLY = f"""
- type: auto_start_agent
- type: set_session_mode
  config: {{mode: plan}}
- type: configure_session
  config: {CONFIGURE}
- type: enable_plan_mode
- type: reset_agent_context
"""


@pytest.mark.parametrize("path", HOISTING_PATHS)
async def test_ac_d1_a_session_only_declaration_behaves_as_processonenter_does_today(
    runtime: Runtime, path: str
) -> None:
    await setup(runtime, SESSION_ONLY, path=path)
    spy = spy_on(runtime)
    events = await enter(runtime, path)

    requests = [r for r in spy.session_actions if r.task_id == "T1"]
    assert [(r.action, r.session_id, r.step_id) for r in requests] == [
        (kind, "s-T1", STEP)
        for kind in (
            "reset_agent_context",
            "configure_session",
            "set_session_mode",
            "enable_plan_mode",
            "auto_start_agent",
        )
    ]  # reset before auto_start, each once
    assert requests[2].config == {"mode": "plan"}
    assert requests[1].config["rules"][0]["agent_name"] == "coder"
    assert spy.registry_calls == []
    assert await entries(runtime) == []  # no step-entry record: the marker system is not involved
    assert of_type(events, "action_outcome") == [] and loud(events) == []
