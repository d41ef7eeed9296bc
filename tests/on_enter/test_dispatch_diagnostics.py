"""Diagnostics, unwired adapters and defaults of on_enter dispatch.

on-enter-action-dispatch.md AC-A6 (both discard points and the negatives), AC-D2, AC-G1, AC-G2, AC-H6 and
AC-H7, with their Verification lines. Diagnostics are asserted on the structured log record
(structlog.testing.capture_logs) and on the diagnostic event the reply carries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dispatch_support import (
    CONFIGURE,
    PATHS,
    STEP,
    WF,
    clear_failing,
    create,
    diags,
    enter,
    entries,
    fan_out_failing_for,
    key_digest,
    key_position,
    markers,
    records,
    runs,
    seat,
    setup,
    spy_on,
    without,
)
from entry_support import markers_as_rows
from helpers import FakeClock, ok, send
from structlog.testing import capture_logs

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.entries.executors import DEFAULT_EXECUTORS
from onceflow.store.runs import runs as runs_store
from onceflow.testing import RecordingHost

# --- AC-A6 -------------------------------------------------------------------------------------------

OWNED_SESSION_TYPES = f"""
- type: configure_session
  config: {CONFIGURE}
- type: reset_agent_context
- type: queue_run
  config: {{target: primary, reason: kick}}
- type: reset_agent_context
"""


@pytest.mark.parametrize("path", PATHS)
async def test_ac_a6_configure_session_warns_only_on_e4_and_reset_agent_context_never_warns(
    runtime: Runtime, path: str
) -> None:
    """Discard point (a): a type no dispatcher translates on this path (configure_session on E4 only)."""
    await setup(runtime, OWNED_SESSION_TYPES, path=path)
    spy = spy_on(runtime)
    with capture_logs() as logs:
        events = await enter(runtime, path)

    warnings = records(logs, "action_not_executed", "warning")
    if path == "E4":
        [warning] = warnings
        assert {
            k: warning[k] for k in ("workflow_id", "step_id", "step_name", "action_type", "entry_path")
        } == {
            "workflow_id": WF,
            "step_id": STEP,
            "step_name": "Review",
            "action_type": "configure_session",
            "entry_path": "E4",
        }
        assert spy.kinds() == ["reset_agent_context", "queue_run"]  # and the rest still ran
    else:
        assert warnings == [] and diags(events, "action_not_executed") == []
        assert spy.kinds() == ["reset_agent_context", "configure_session", "queue_run"]
    assert [r for r in logs if r["log_level"] in ("warning", "error")] == warnings


@pytest.mark.parametrize("path", PATHS)
async def test_ac_a6_an_engine_action_with_no_registered_executor_warns_and_the_rest_continue(
    runtime: Runtime, path: str
) -> None:
    """Discard point (b): a translated action for which the running configuration registers no executor."""
    await setup(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: wake}
        - type: set_session_mode
          config: {mode: review}
        - type: queue_run
          config: {target: primary, reason: kick}
        """,
        path=path,
    )
    spy = spy_on(runtime, executors=without("queue_run_for_each_participant"))
    with capture_logs() as logs:
        events = await enter(runtime, path)

    [warning] = records(logs, "action_not_executed", "warning")
    assert (warning["workflow_id"], warning["step_id"], warning["step_name"], warning["action_type"]) == (
        WF,
        STEP,
        "Review",
        "queue_run_for_each_participant",
    )
    assert [d.fields["action_type"] for d in diags(events, "action_not_executed", "warning")] == [
        "queue_run_for_each_participant"
    ]
    assert spy.kinds() == ["set_session_mode", "queue_run"]
    assert [r["reason"] for r in await runs(runtime)] == ["kick"]
    assert [(p, kind, state, detail) for p, kind, state, detail in await markers(runtime)] == [
        (0, "queue_run_for_each_participant", "skipped", "no_executor"),
        (2, "queue_run", "done", ""),
    ]


async def test_ac_a6_an_unknown_action_type_is_refused_at_registration_not_silently_dropped(
    runtime: Runtime,
) -> None:
    reply = await send(
        runtime,
        {
            "type": "register_workflow",
            "import_path": True,
            "yaml": "id: x\nname: X\nsteps:\n  - id: s\n    name: S\n    position: 0\n"
            "    events: {on_enter: [{type: notify_slack}]}\n",
        },
    )
    assert not reply.ok and reply.error is not None
    assert (reply.error.code, reply.error.field) == ("workflow_invalid", "steps[0].events.on_enter[0].type")


# --- AC-D2 -------------------------------------------------------------------------------------------


async def _kanban_trace(db_path: Path, template: Path, executors: Any) -> list[Any]:
    host = RecordingHost()
    trace: list[Any] = []
    async with open_runtime(db_path, host=host, clock=FakeClock(), executors=executors) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": template.read_text(), "source": "kanban.yml"})
        await ok(
            rt,
            {
                "type": "create_task",
                "task_id": "K1",
                "workflow_id": "simple",
                "step_id": "backlog",
                "session_id": "s",
            },
        )
        for message in (
            {"type": "turn_start", "task_id": "K1"},  # backlog → in-progress (auto_start_agent)
            {"type": "turn_complete", "task_id": "K1"},  # → review
            {"type": "turn_start", "task_id": "K1"},  # → back to in-progress
            {"type": "move_task", "task_id": "K1", "step_id": "done"},
        ):
            reply = await ok(rt, message)
            step = (await ok(rt, {"type": "get_task", "task_id": "K1"})).result["step_id"]
            trace.append((step, [e.model_dump() for e in reply.events]))
    return [trace, [(r.action, r.step_id, r.entry_path) for r in host.session_actions]]


async def test_ac_d2_kanban_without_office_adapters_behaves_exactly_as_with_them(
    tmp_path: Path, kandev_templates: Path
) -> None:
    template = kandev_templates / "kanban.yml"
    wired = await _kanban_trace(tmp_path / "wired.db", template, DEFAULT_EXECUTORS)
    unwired = await _kanban_trace(tmp_path / "unwired.db", template, {})
    assert unwired == wired
    assert [step for step, _ in wired[0]] == ["in-progress", "review", "in-progress", "done"]
    assert [action for action, *_ in wired[1]] == ["auto_start_agent", "auto_start_agent"]


async def test_ac_d2_office_only_actions_without_adapters_warn_and_the_task_does_not_stall(
    db_path: Path, clock: FakeClock
) -> None:
    office_only = """
    - type: clear_decisions
    - type: queue_run_for_each_participant
      config: {role: reviewer, reason: wake}
    - type: set_session_mode
      config: {mode: review}
    - type: queue_run
      config: {target: primary, reason: kick}
    - type: ensure_participant_seat
      config: {role: reviewer}
    """
    host = RecordingHost()
    async with open_runtime(db_path, host=host, clock=clock, executors={}) as rt:
        await setup(rt, office_only)
        with capture_logs() as logs:
            events = await enter(rt, "E1")
        warned = [r["action_type"] for r in records(logs, "action_not_executed", "warning")]
        assert warned == [
            "clear_decisions",
            "queue_run_for_each_participant",
            "queue_run",
            "ensure_participant_seat",
        ]
        assert all(r["reason"] == "no_executor" for r in records(logs, "action_not_executed"))
        assert [r for r in logs if r["log_level"] == "error"] == []
        assert [e.type for e in events][:2] == ["transition", "step_entered"]
        assert [(p, state) for p, _, state, _ in await markers(rt)] == [
            (0, "skipped"),
            (1, "skipped"),
            (3, "skipped"),
            (4, "skipped"),
        ]
        assert [e["terminal"] for e in await entries(rt)] == [True]  # nothing left for recovery to stall on
        assert await runs(rt) == []
        assert [r.action for r in host.session_actions] == ["set_session_mode"]
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "done"})  # and the card moves on
        assert (await ok(rt, {"type": "get_task", "task_id": "T1"})).result["step_id"] == "done"


# --- AC-G1 -------------------------------------------------------------------------------------------

FAN_OUT = """
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
"""


def _finished(logs: list[dict[str, Any]]) -> tuple[Any, ...]:
    [record] = records(logs, "fan_out_finished", "info")
    return tuple(record[k] for k in ("task_id", "step_id", "role", "matching", "enqueued", "suppressed"))


async def test_ac_g1_fan_out_finished_is_logged_when_every_participant_succeeds(runtime: Runtime) -> None:
    await setup(runtime, FAN_OUT)
    with capture_logs() as logs:
        await enter(runtime, "E2")
    assert _finished(logs) == ("T1", STEP, "reviewer", 2, 2, 0)


async def test_ac_g1_fan_out_finished_is_logged_on_the_partial_failure_path(runtime: Runtime) -> None:
    await setup(runtime, FAN_OUT, reviewers=("rev-a", "rev-b", "rev-c"))
    runtime.reconfigure(
        executors={**DEFAULT_EXECUTORS, "queue_run_for_each_participant": fan_out_failing_for("rev-b")}
    )
    with capture_logs() as logs:
        await enter(runtime, "E2")
    assert _finished(logs) == ("T1", STEP, "reviewer", 3, 2, 0)


async def test_ac_g1_suppressed_runs_count_as_enqueued_and_are_counted_separately(
    db_path: Path, clock: FakeClock
) -> None:
    async with open_runtime(db_path, clock=clock) as rt:
        await setup(rt, FAN_OUT)
        await enter(rt, "E2")

        def marker_lost(conn: Any) -> None:  # the runs committed, the completion did not (AC-B6 permits it)
            markers_as_rows(conn, "T1")
            conn.execute(
                "UPDATE step_entry_markers SET state = 'in_progress', epoch = 'dead' WHERE task_id = 'T1'"
            )
            conn.execute("UPDATE step_entries SET terminal = 0 WHERE task_id = 'T1'")

        await rt.services.store.transact(marker_lost)
        await seat(rt, "reviewer", "rev-c", position=1)  # seated after the first attempt

    with capture_logs() as logs:
        async with open_runtime(db_path, clock=clock) as rt:  # the replay is the startup recovery scan
            assert [r["agent_profile_id"] for r in await runs(rt)] == ["rev-a", "rev-b", "rev-c"]
    assert _finished(logs) == ("T1", STEP, "reviewer", 3, 3, 2)


# --- AC-G2 -------------------------------------------------------------------------------------------

G2_CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    # case: (declaration, entry path, code, the criterion's named fields with their values; None = any)
    "AC-A6": (
        "- type: clear_decisions",
        "E2",
        "action_not_executed",
        {"workflow_id": WF, "step_id": STEP, "step_name": "Review", "action_type": "clear_decisions"},
    ),
    "AC-A6-E4": (
        f"- type: configure_session\n  config: {CONFIGURE}",
        "E4",
        "action_not_executed",
        {
            "workflow_id": WF,
            "step_id": STEP,
            "step_name": "Review",
            "action_type": "configure_session",
            "entry_path": "E4",
        },
    ),
    "AC-C1": (
        FAN_OUT,
        "E2",
        "fan_out_participant_failed",
        {"task_id": "T1", "step_id": STEP, "participant_id": None, "agent_profile_id": "", "cause": None},
    ),
    "AC-C2": (
        "- type: clear_decisions\n" + FAN_OUT,
        "E2",
        "on_enter_action_failed",
        {"workflow_id": WF, "step_id": STEP, "task_id": "T1", "cause": None},
    ),
    "AC-C3": (
        "- type: queue_run\n  config: {target: 'participant_role:approver'}",
        "E2",
        "on_enter_action_failed",
        {"workflow_id": WF, "step_id": STEP, "action_type": "queue_run", "cause": None},
    ),
    "AC-E1": (
        "- type: queue_run_for_each_participant\n  config: {role: approver}",
        "E2",
        "fan_out_matched_nobody",
        {"step_id": STEP, "step_name": "Review", "role": "approver"},
    ),
    "AC-E3": (
        "- type: queue_run_for_each_participant\n  config: {reason: anyone}",
        "E2",
        "fan_out_role_missing",
        {"workflow_id": WF, "step_id": STEP},
    ),
}
G2_LEVELS = {"fan_out_matched_nobody": "warning", "action_not_executed": "warning"}


@pytest.mark.parametrize("case", list(G2_CASES))
async def test_ac_g2_each_diagnostic_carries_its_named_fields_as_discrete_fields(
    runtime: Runtime, case: str
) -> None:
    declaration, path, code, fields = G2_CASES[case]
    await setup(runtime, declaration, path=path)
    if case == "AC-A6":
        runtime.reconfigure(executors=without("clear_decisions"))
    elif case == "AC-C1":
        await seat(runtime, "reviewer", "", position=5)
    elif case == "AC-C2":
        runtime.reconfigure(executors={**DEFAULT_EXECUTORS, "clear_decisions": clear_failing("raises")})
    with capture_logs() as logs:
        events = await enter(runtime, path)

    level = G2_LEVELS.get(code, "error")
    [record] = records(logs, code, level)
    [event] = diags(events, code, level)
    for name, value in fields.items():
        assert name in record and name in event.fields, name  # a discrete field, on the log and the event
        assert record[name] == event.fields[name]
        assert record[name] == value if value is not None else record[name] not in (None, "")
    assert record["event"] == code  # the message is the bare code: nothing is interpolated into it
    assert all(str(v) not in code for v in fields.values() if v)


# --- AC-H6, AC-H7 ------------------------------------------------------------------------------------


async def test_ac_h6_the_idempotency_window_stays_fixed_at_24_hours(runtime: Runtime) -> None:
    """AC-H6 needs no behavioural test (Verification: "a statement that a constant is not made
    configurable"); this pins the constant and that neither the runtime nor a run request can change it."""
    import inspect

    assert runs_store.IDEMPOTENCY_WINDOW_SECONDS == 86400
    windows = [p for p in inspect.signature(open_runtime).parameters if "idempot" in p or "window" in p]
    assert windows == ["event_window"]  # the event stream's replay window, not the idempotency window
    assert not [f for f in runs_store.RunRequest.__attrs_attrs__ if "window" in f.name]


async def test_ac_h7_the_config_digest_is_canonical_over_role_reason_and_payload(runtime: Runtime) -> None:
    await setup(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: on_enter, payload: null}
        - type: queue_run_for_each_participant
          config: {role: reviewer, payload: {b: 2, a: 1}}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: on_enter, payload: {a: 1, b: 2}}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: other}
        """,
        reviewers=("rev-a",),
    )
    await create(runtime, "T1")
    events = await enter(runtime, "E2", created=True)

    assert [e.type for e in events if e.type.startswith("run_")] == ["run_queued"] * 5  # nothing suppressed
    digests = {
        key_position(r["idempotency_key"]): key_digest(r["idempotency_key"]) for r in await runs(runtime)
    }
    assert digests[0] == digests[1]  # omitted reason == explicit on_enter; omitted payload == explicit null
    assert digests[2] == digests[3]  # map keys serialized in sorted order
    assert len({digests[0], digests[2], digests[4]}) == 3  # a real difference in reason or payload shows
