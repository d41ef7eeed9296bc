"""Orchestrator parity: a failed context reset stops the agent start; session-action identity.

It resolves AC-D1 against AC-C3 (on-enter-action-dispatch.md): after a failed reset_agent_context the
later session actions of that entry are not requested, engine-owned ones still run (AC-A10), and a WARNING
says which were skipped. And every session-action request names its entry and declared position.
Entries are driven through the protocol (dispatch_support.enter), never through the dispatcher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dispatch_support import CONFIGURE, HOISTING_PATHS, PATHS, STEP, Spy, diags, enter, runs, setup, spy_on
from entry_support import CLEAR_AND_FAN_OUT, executors_with, new_task, raising, setup_entries
from helpers import of_type, ok

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Event
from onceflow.protocol.host import SessionActionRequest
from onceflow.testing import RecordingHost


class ResetFails(Spy):
    """A host whose context reset raises; `attempts` keeps every request, performed or not."""

    def __init__(self, failing: str = "reset_agent_context") -> None:
        super().__init__()
        self.failing = failing
        self.attempts: list[SessionActionRequest] = []

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        self.attempts.append(request)
        if request.action == self.failing:
            raise ConnectionError(f"{request.action} refused by the agent backend")
        await super().perform_session_action(request)


def skipped_warning(events: list[Event]) -> dict[str, Any]:
    [warning] = diags(events, "session_actions_skipped_after_failed_reset", "warning")
    return dict(warning.fields)


# Every session kind around the reset, engine-owned actions between them, auto_start not last (AC-A12).
AROUND_RESET = f"""
- type: enable_plan_mode
- type: clear_decisions
- type: auto_start_agent
- type: reset_agent_context
- type: queue_run_for_each_participant
  config: {{role: reviewer, reason: wake}}
- type: set_session_mode
  config: {{mode: plan}}
- type: configure_session
  config: {CONFIGURE}
"""


@pytest.mark.parametrize("path", HOISTING_PATHS)
async def test_ac_d1_failed_reset_stops_later_session_actions_on_every_hoisting_path(
    runtime: Runtime, path: str
) -> None:
    """AC-D1 vs AC-C3, decided: a failed reset_agent_context is not followed by the
    agent start, nor by any other session action of that entry.

    AC-D1 freezes processOnEnter's reset-before-auto_start ordering, and Kandev stops the session actions at
    a failed reset: an agent resumed on a context that was never cleared would take the next step's prompt
    into the old conversation. AC-C3's "attempt the remaining declared actions" keeps governing everything
    else: engine-owned actions still run (AC-A10), and a failure of any other session action stops nothing
    (see the next test). The skip is reported as one WARNING naming each skipped action and its position.
    E1 is turn_complete, E2 move_task, E3 a WIP promotion, E5 update_task / start_task.
    """
    await setup(runtime, AROUND_RESET, path=path)
    spy = spy_on(runtime, ResetFails())
    events = await enter(runtime, path)

    assert [r.action for r in spy.attempts] == ["reset_agent_context"]  # nothing asked after it
    assert of_type(events, "session_action") == []
    [failure] = diags(events, "session_action_failed", "error")
    assert (failure.fields["action"], failure.fields["position"]) == ("reset_agent_context", 3)
    warning = skipped_warning(events)
    assert warning["skipped"] == [  # in the order they would have been requested (AC-A9)
        {"position": 6, "action": "configure_session"},
        {"position": 0, "action": "enable_plan_mode"},
        {"position": 5, "action": "set_session_mode"},
        {"position": 2, "action": "auto_start_agent"},
    ]
    assert (warning["reset_position"], warning["entry_seq"], warning["entry_path"]) == (3, 1, path[:2])
    assert (warning["task_id"], warning["step_id"], warning["workflow_id"]) == ("T1", STEP, "disp")
    # The engine-owned actions ran, in declared order, and the entry stands (AC-A10, AC-C4).
    assert spy.kinds() == ["clear_decisions", "queue_run_for_each_participant"]
    assert sorted(r["agent_profile_id"] for r in await runs(runtime, task_id="T1")) == ["rev-a", "rev-b"]


async def test_ac_d1_failed_reset_stops_later_session_actions_on_switch_workflow(runtime: Runtime) -> None:
    """On E4 the list runs in declared order (AC-A13), so a session action declared before the reset is
    performed; those after it are skipped, and configure_session still only warns (AC-A6)."""
    await setup(
        runtime,
        f"""
        - type: enable_plan_mode
        - type: reset_agent_context
        - type: clear_decisions
        - type: auto_start_agent
        - type: configure_session
          config: {CONFIGURE}
        - type: set_session_mode
          config: {{mode: plan}}
        """,
    )
    spy = spy_on(runtime, ResetFails())
    events = await enter(runtime, "E4")

    assert [r.action for r in spy.attempts] == ["enable_plan_mode", "reset_agent_context"]
    assert [e.action for e in of_type(events, "session_action")] == ["enable_plan_mode"]
    assert skipped_warning(events)["skipped"] == [
        {"position": 3, "action": "auto_start_agent"},
        {"position": 5, "action": "set_session_mode"},
    ]
    [unowned] = diags(events, "action_not_executed", "warning")
    assert unowned.fields["action_type"] == "configure_session"
    assert spy.kinds() == ["enable_plan_mode", "clear_decisions"]


async def test_ac_c3_a_failed_session_action_other_than_reset_stops_nothing(runtime: Runtime) -> None:
    """The exception is the reset alone: a failed enable_plan_mode is reported and the rest is asked."""
    await setup(
        runtime,
        """
        - type: reset_agent_context
        - type: enable_plan_mode
        - type: set_session_mode
          config: {mode: plan}
        - type: auto_start_agent
        """,
    )
    spy = spy_on(runtime, ResetFails(failing="enable_plan_mode"))
    events = await enter(runtime, "E2")

    assert [r.action for r in spy.attempts] == [
        "reset_agent_context",
        "enable_plan_mode",
        "set_session_mode",
        "auto_start_agent",
    ]
    assert diags(events, "session_actions_skipped_after_failed_reset") == []


async def test_ac_a10_a_reset_skipped_for_want_of_a_session_is_not_a_failed_reset(runtime: Runtime) -> None:
    await setup(runtime, "- type: reset_agent_context\n- type: clear_decisions\n- type: auto_start_agent\n")
    spy = spy_on(runtime)
    events = await enter(runtime, "E2", session=False)

    assert spy.session_actions == []
    skipped = [d.fields["action"] for d in diags(events, "session_action_skipped_no_session", "info")]
    assert skipped == ["reset_agent_context", "auto_start_agent"]
    assert diags(events, "session_actions_skipped_after_failed_reset") == []
    assert spy.kinds() == ["clear_decisions"]


async def test_ac_b8_recovery_never_requests_a_session_action_skipped_after_a_failed_reset(
    db_path: Path,
) -> None:
    """The skip holds across a restart: session actions hold no marker and recovery requests none (AC-B8),
    so the auto_start skipped after the failed reset is never asked for, while the open entry's engine
    actions are finished by the recovery scan."""
    declaration = "- type: reset_agent_context\n" + CLEAR_AND_FAN_OUT + "- type: auto_start_agent\n"
    first_host = ResetFails()
    flaky = executors_with(queue_run_for_each_participant=raising("queue_run_for_each_participant"))
    async with open_runtime(db_path, host=first_host, executors=flaky) as rt:
        await setup_entries(rt, declaration)
        await new_task(rt, "T1")
        moved = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        skipped = skipped_warning(list(moved.events))["skipped"]
        assert skipped == [{"position": 3, "action": "auto_start_agent"}]
        assert (await ok(rt, {"type": "list_runs", "task_id": "T1"})).result[
            "runs"
        ] == []  # the entry is left open
    assert [r.action for r in first_host.attempts] == ["reset_agent_context"]

    second_host = RecordingHost()
    async with open_runtime(db_path, host=second_host) as rt:
        recovered = (await ok(rt, {"type": "list_runs", "task_id": "T1"})).result["runs"]
        assert sorted(r["agent_profile_id"] for r in recovered) == ["rev-a", "rev-b"]
    assert second_host.session_actions == []


# --- the identity a host deduplicates on -----------------------------------------------------

TWICE = """
- type: auto_start_agent
- type: clear_decisions
- type: auto_start_agent
"""


class StartsOncePerEntry(RecordingHost):
    """The README's recipe: start the agent at most once per (task_id, step_id, entry_seq)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: set[tuple[str, str, int | None]] = set()
        self.starts = 0

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        await super().perform_session_action(request)
        key = (request.task_id, request.step_id, request.entry_seq)
        if request.action == "auto_start_agent" and key not in self.started:
            self.started.add(key)
            self.starts += 1


async def test_session_action_request_carries_entry_identity_and_position(runtime: Runtime) -> None:
    """On E4 a step declaring auto_start_agent twice asks twice (AC-A13, AC-H4); each
    request and its session_action event carry (task, step, entry_seq), the trigger and the declared
    position, so a host keyed on the entry starts the agent once — and again on the next entry."""
    await setup(runtime, TWICE)
    host = StartsOncePerEntry()
    runtime.reconfigure(host=host)
    events = await enter(runtime, "E4")

    identity = [
        (r.task_id, r.step_id, r.entry_seq, r.trigger, r.position, r.entry_path) for r in host.session_actions
    ]
    assert identity == [("T1", STEP, 1, "on_enter", 0, "E4"), ("T1", STEP, 1, "on_enter", 2, "E4")]
    shown = [
        (e.task_id, e.step_id, e.entry_seq, e.trigger, e.position, e.entry_path)
        for e in of_type(events, "session_action")
    ]
    assert shown == identity
    assert host.starts == 1

    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    again = await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": STEP})
    [request] = host.session_actions[2:]  # E2 defers auto_start_agent and asks once (AC-A9)
    assert (request.entry_seq, request.position, request.entry_path) == (2, 0, "E2")
    assert [(e.entry_seq, e.position) for e in of_type(list(again.events), "session_action")] == [(2, 0)]
    assert host.starts == 2


async def test_session_action_request_outside_on_enter_names_its_trigger_and_has_no_entry_seq(
    runtime: Runtime,
) -> None:
    """An on_exit request names its trigger and its position in that list; it belongs to no entry record,
    and neither does an on_enter request of a step that allocates none (only host-owned actions, AC-E5)."""
    await setup(
        runtime,
        "- type: auto_start_agent\n",
        work_extra="      on_exit:\n        - type: disable_plan_mode\n        - type: disable_plan_mode\n",
    )
    host = spy_on(runtime)
    events = await enter(runtime, "E1")

    assert [(r.action, r.step_id, r.trigger, r.position, r.entry_seq) for r in host.session_actions] == [
        ("disable_plan_mode", "work", "on_exit", 0, None),
        ("disable_plan_mode", "work", "on_exit", 1, None),
        ("auto_start_agent", STEP, "on_enter", 0, None),
    ]
    assert [(e.trigger, e.position, e.entry_seq) for e in of_type(events, "session_action")] == [
        ("on_exit", 0, None),
        ("on_exit", 1, None),
        ("on_enter", 0, None),
    ]


HOST_ONLY_TWICE = """
- type: auto_start_agent
- type: auto_start_agent
"""


class StartsOncePerAdmission(RecordingHost):
    """The README's recipe for every step: start the agent at most once per (task_id, admission_seq)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: set[tuple[str, int]] = set()

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        await super().perform_session_action(request)
        if request.action == "auto_start_agent":
            self.started.add((request.task_id, request.admission_seq))


@pytest.mark.parametrize("path", PATHS)
async def test_session_action_admission_seq_names_the_entry_of_a_step_without_a_record(
    runtime: Runtime, path: str
) -> None:
    """On a step whose on_enter declares only host-owned actions: AC-E5 allocates no
    step-entry record there (`entry_seq` is None), yet every request carries the task's admission counter,
    +1 at every step entry on every path, so a host keyed on (task_id, admission_seq) starts the agent once
    per entry — including on E4, which asks for both declared starts (AC-A13, AC-H4) — and again on the
    next entry."""
    await setup(runtime, HOST_ONLY_TWICE, path=path)
    host = StartsOncePerAdmission()
    runtime.reconfigure(host=host)
    first = await enter(runtime, path)
    asked = [(r.entry_seq, r.position, r.admission_seq) for r in host.session_actions]
    admission = asked[0][2]
    assert admission >= 1
    positions = [0, 1] if path == "E4" else [0]  # the fixed path asks for auto_start once (AC-A9)
    assert asked == [(None, position, admission) for position in positions]
    shown = [(e.entry_seq, e.position, e.admission_seq) for e in of_type(first, "session_action")]
    assert shown == asked
    assert host.started == {("T1", admission)}

    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": STEP})
    assert host.session_actions[-1].admission_seq == admission + 2  # left (+1), entered again (+1)
    assert host.started == {("T1", admission), ("T1", admission + 2)}


async def test_session_action_admission_seq_survives_a_restart_and_on_exit_names_the_entry_left(
    db_path: Path,
) -> None:
    """The counter is durable: after a restart the next entry gets the next number, never one a host
    has seen; an on_exit request carries the admission of the entry it leaves (0 where the task was created,
    which is not an entry)."""
    host = StartsOncePerAdmission()
    work_exit = "      on_exit:\n        - type: disable_plan_mode\n"
    async with open_runtime(db_path, host=host) as rt:
        await setup(rt, HOST_ONLY_TWICE, work_extra=work_exit)
        await enter(rt, "E2")  # created in work (no entry), then moved: admission 1
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})  # admission 2
    async with open_runtime(db_path, host=host) as rt:
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": STEP})  # leaves 2, enters 3
    assert [(r.trigger, r.step_id, r.admission_seq) for r in host.session_actions] == [
        ("on_exit", "work", 0),  # created there: creating a task is not an entry
        ("on_enter", STEP, 1),
        ("on_exit", "work", 2),
        ("on_enter", STEP, 3),
    ]
    assert host.started == {("T1", 1), ("T1", 3)}
