"""Dispatch completeness: every declared on_enter action runs, on every entry path, against the right rows.

on-enter-action-dispatch.md group A (AC-A1 … AC-A5, AC-A7, AC-A8, AC-A10) and AC-H3, with the Verification
lines for each. Every entry is an ordinary transition or protocol message (dispatch_support.enter).
"""

from __future__ import annotations

from collections import Counter

import pytest
from dispatch_support import (
    CONFIGURE,
    PATHS,
    STEP,
    ReviewDown,
    create,
    decide,
    decisions,
    diags,
    enter,
    key_seq,
    loud,
    markers,
    records,
    runs,
    seat,
    setup,
    spy_on,
)
from helpers import list_review_runs, of_type, ok, register
from structlog.testing import capture_logs

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect

# No type with a fixed position (AC-A9): the declared order is the execution order on every path.
UNHOISTED = """
- type: queue_run
  config: {target: primary, reason: first}
- type: set_session_mode
  config: {mode: review}
- type: clear_decisions
- type: run_code_review
- type: enable_plan_mode
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
- type: ensure_participant_seat
  config: {role: reviewer}
"""
UNHOISTED_ORDER = [
    ("queue_run", "first"),
    ("set_session_mode", "review"),
    ("clear_decisions", ""),
    ("run_code_review", ""),
    ("enable_plan_mode", ""),
    ("queue_run_for_each_participant", "wake"),
    ("ensure_participant_seat", ""),
]

ALL_TEN = f"""
- type: clear_decisions
- type: reset_agent_context
- type: queue_run_for_each_participant
  config: {{role: reviewer, reason: wake}}
- type: configure_session
  config: {CONFIGURE}
- type: enable_plan_mode
- type: queue_run
  config: {{target: primary, reason: kick}}
- type: set_session_mode
  config: {{mode: review}}
- type: run_code_review
- type: auto_start_agent
- type: ensure_participant_seat
  config: {{role: reviewer}}
"""


@pytest.mark.parametrize("path", PATHS)
async def test_ac_a1_every_declared_action_runs_once_in_declared_order(runtime: Runtime, path: str) -> None:
    await setup(runtime, UNHOISTED, path=path)
    spy = spy_on(runtime)
    events = await enter(runtime, path)

    assert spy.calls() == UNHOISTED_ORDER  # each exactly once, in the declared order
    assert [(r["agent_profile_id"], r["reason"]) for r in await runs(runtime, task_id="T1")] == [
        ("worker", "first"),
        ("rev-a", "wake"),
        ("rev-b", "wake"),
    ]
    assert [(p, state) for p, _, state, _ in await markers(runtime)] == [
        (0, "done"),
        (2, "done"),
        (3, "done"),
        (5, "done"),
        (6, "done"),
    ]  # engine-owned positions only; the session actions hold no marker (AC-B8)
    assert loud(events) == []


@pytest.mark.parametrize("path", PATHS)
async def test_ac_a2_every_entry_path_executes_the_same_action_coverage(runtime: Runtime, path: str) -> None:
    """Coverage only: ordering differs across paths by AC-A2(ii) and is asserted per path elsewhere."""
    await setup(runtime, ALL_TEN, path=path)
    spy = spy_on(runtime)
    events = await enter(runtime, path)

    expected = Counter(
        [
            "clear_decisions",
            "reset_agent_context",
            "queue_run_for_each_participant",
            "configure_session",
            "enable_plan_mode",
            "queue_run",
            "set_session_mode",
            "run_code_review",
            "auto_start_agent",
            "ensure_participant_seat",
        ]
    )
    if path == "E4":
        del expected["configure_session"]  # AC-A2(i): the one named exemption, and it warns
    assert Counter(spy.kinds()) == expected
    warned = [d.fields["action_type"] for d in diags(events, "action_not_executed")]
    assert warned == (["configure_session"] if path == "E4" else [])
    assert sorted(r["agent_profile_id"] for r in await runs(runtime, task_id="T1")) == [
        "rev-a",
        "rev-b",
        "worker",
    ]
    assert [(t, step, agent) for t, step, _, _, agent in spy.code_reviews] == [("T1", STEP, None)]


async def test_ac_a3_clear_deletes_the_destination_steps_decisions_before_later_actions(
    runtime: Runtime,
) -> None:
    seen_at_fan_out: list[int] = []
    real = DEFAULT_EXECUTORS["queue_run_for_each_participant"]

    def fan_out(conn, ctx: ActionContext, action: ActionDecl) -> Effect:  # type: ignore[no-untyped-def]
        (left,) = conn.execute(
            "SELECT COUNT(*) FROM decisions WHERE task_id = ? AND step_id = ?", (ctx.task.id, ctx.step_id)
        ).fetchone()
        seen_at_fan_out.append(left)
        return real(conn, ctx, action)

    await setup(
        runtime,
        """
        - type: queue_run
          config: {target: primary, reason: before_clear}
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: wake}
        """,
    )
    runtime.reconfigure(executors={**DEFAULT_EXECUTORS, "queue_run_for_each_participant": fan_out})
    for task_id in ("T1", "T2"):
        await create(runtime, task_id)
    await decide(runtime, "T1", "work")  # a decision on the step being left
    await decide(runtime, "T1", STEP, "rev-a")
    await decide(runtime, "T1", STEP, "rev-b")
    await decide(runtime, "T2", STEP)  # another task's decision at the destination step
    kept = await decisions(runtime, "T1", "work") + await decisions(runtime, "T2", STEP)

    events = await enter(runtime, "E1", created=True)

    assert seen_at_fan_out == [0]  # the delete committed before the action declared after it ran
    assert [(e.task_id, e.step_id, e.deleted) for e in of_type(events, "decisions_cleared")] == [
        ("T1", STEP, 2)
    ]
    assert await decisions(runtime, "T1", STEP) == []
    assert await decisions(runtime, "T1", "work") + await decisions(runtime, "T2", STEP) == kept


async def test_ac_a4_ac_a5_fan_out_one_run_per_distinct_participant_of_the_role_in_merged_order(
    runtime: Runtime,
) -> None:
    await setup(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: wake}
        """,
        reviewers=(),
    )
    await create(runtime, "T1")
    await seat(runtime, "reviewer", "rev-b", position=1)
    await seat(runtime, "reviewer", "rev-a", position=0)
    await seat(runtime, "reviewer", "rev-c", position=2)  # loses to the per-task rev-c row below
    await seat(runtime, "reviewer", "rev-a", position=3)  # a duplicate in the same tier: the first is kept
    await seat(runtime, "reviewer", "rev-e", position=4)
    await seat(runtime, "reviewer", "rev-c", position=5, task_id="T1")
    await seat(runtime, "approver", "boss")  # another role
    await seat(runtime, "reviewer", "rev-w", step_id="work")  # another step
    await create(runtime, "T2")
    await seat(runtime, "reviewer", "rev-t2", task_id="T2")  # another task's per-task row

    events = await enter(runtime, "E2", created=True)

    expected = ["rev-a", "rev-b", "rev-e", "rev-c"]  # role, position, id — the per-task rev-c at position 5
    assert [r["agent_profile_id"] for r in await runs(runtime)] == expected
    assert [e.agent_profile_id for e in of_type(events, "run_queued")] == expected
    [finished] = diags(events, "fan_out_finished")
    assert (finished.fields["matching"], finished.fields["enqueued"]) == (4, 4)


async def test_ac_h3_fan_out_selects_by_role_alone_not_decision_required(runtime: Runtime) -> None:
    await setup(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: wake}
        """,
        reviewers=(),
    )
    await seat(runtime, "reviewer", "rev-required", decision_required=True)
    await seat(runtime, "reviewer", "rev-optional", decision_required=False, position=1)
    await enter(runtime, "E2")
    assert [r["agent_profile_id"] for r in await runs(runtime)] == ["rev-required", "rev-optional"]


TARGETS = {
    "primary": ("primary", ("worker",)),
    "ceo": ("workspace.ceo_agent", ("ceo",)),
    "participant_role": ("participant_role:reviewer", ("rev-a", "rev-b")),  # every match
    "agent_profile_id": ("agent_profile_id:pinned", ("pinned",)),
}


@pytest.mark.parametrize("target", list(TARGETS))
async def test_ac_a7_on_enter_queue_run_enqueues_for_the_resolved_target_with_an_entry_scoped_key(
    runtime: Runtime, target: str
) -> None:
    config, agents = TARGETS[target]
    await setup(
        runtime,
        f"""
        - type: queue_run
          config: {{target: "{config}", reason: kick}}
        """,
    )
    await enter(runtime, "E2")
    await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    again = await ok(runtime, {"type": "move_task", "task_id": "T1", "step_id": STEP})  # same clock second

    rows = await runs(runtime, task_id="T1")
    assert [(r["agent_profile_id"], r["step_id"], r["reason"]) for r in rows] == [
        (agent, STEP, "kick") for agent in agents
    ] * 2
    # the first entry's runs were cancelled when the task left it; the second entry's are queued
    assert [(r["status"], r["outcome_reason"]) for r in rows] == [("cancelled", "entry_left")] * len(
        agents
    ) + [("queued", None)] * len(agents)
    # differs across the two entries
    assert [key_seq(r["idempotency_key"]) for r in rows] == [1] * len(agents) + [2] * len(agents)
    assert all(r["exclude_from_coalescing"] for r in rows)  # AC-H9's field, on a bare queue_run too
    assert of_type(again.events, "run_coalesced") == [] and of_type(again.events, "run_suppressed") == []


async def test_ac_a7_a_target_resolving_to_nobody_is_an_ordinary_action_failure(runtime: Runtime) -> None:
    await setup(
        runtime,
        """
        - type: queue_run
          config: {target: "participant_role:approver", reason: kick}
        - type: queue_run
          config: {target: primary, reason: after}
        """,
    )
    with capture_logs() as logs:
        events = await enter(runtime, "E2")
    [error] = records(logs, "on_enter_action_failed", "error")
    assert (error["action_type"], error["step_id"]) == ("queue_run", STEP)
    assert [(p, state) for p, _, state, _ in await markers(runtime)] == [(0, "failed"), (1, "done")]
    assert [r["reason"] for r in await runs(runtime)] == ["after"]  # AC-C3: the next action still ran
    assert loud(events) == [("error", "on_enter_action_failed")]


async def test_ac_a8_run_code_review_records_a_review_run_and_starts_the_pass(runtime: Runtime) -> None:
    await setup(
        runtime,
        """
        - type: run_code_review
          config: {agent_profile_id: reviewer-bot}
        """,
    )
    spy = spy_on(runtime)
    events = await enter(runtime, "E1")

    rows = await runtime.services.store.transact(
        lambda conn: conn.execute(
            "SELECT task_id, workflow_step_id, trigger, status FROM task_review_runs"
        ).fetchall()
    )
    assert [tuple(r) for r in rows] == [("T1", STEP, "workflow_step", "started")]
    [(task, step, entry_seq, review_run_id, agent)] = spy.code_reviews
    assert (task, step, agent) == ("T1", STEP, "reviewer-bot")
    assert [(r["id"], r["entry_seq"]) for r in await list_review_runs(runtime)] == [
        (review_run_id, entry_seq)
    ]
    assert await markers(runtime) == [(0, "run_code_review", "done", "")]
    assert loud(events) == []


async def test_ac_a8_a_failed_review_start_neither_blocks_the_entry_nor_fails_the_action(
    runtime: Runtime,
) -> None:
    await setup(
        runtime,
        """
        - type: clear_decisions
        - type: run_code_review
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: wake}
        - type: auto_start_agent
        """,
    )
    spy = spy_on(runtime, ReviewDown())
    with capture_logs() as logs:
        events = await enter(runtime, "E1")

    assert spy.kinds() == [
        "clear_decisions",
        "run_code_review",
        "queue_run_for_each_participant",
        "auto_start_agent",
    ]
    assert [r["agent_profile_id"] for r in await runs(runtime)] == ["rev-a", "rev-b"]
    [entry] = [
        e for e in (await ok(runtime, {"type": "list_step_entries", "task_id": "T1"})).result["entries"]
    ]
    assert entry["terminal"] is True
    assert [(p, kind, state) for p, kind, state, _ in await markers(runtime)] == [
        (0, "clear_decisions", "done"),
        (1, "run_code_review", "done"),
        (2, "queue_run_for_each_participant", "done"),
    ]
    rows = await runtime.services.store.transact(
        lambda conn: conn.execute(
            "SELECT task_id, workflow_step_id, status, detail FROM task_review_runs"
        ).fetchall()
    )
    assert [tuple(r)[:3] for r in rows] == [("T1", STEP, "start_failed")]
    assert "review backend down" in rows[0][3]
    assert records(logs, "on_enter_action_failed") == []
    assert [(level, code) for level, code in loud(events)] == [("warning", "code_review_start_failed")]


async def test_ac_a10_a_task_without_a_session_still_gets_its_engine_owned_actions_on_a_manual_move(
    runtime: Runtime,
) -> None:
    await setup(
        runtime,
        f"""
        - type: reset_agent_context
        - type: clear_decisions
        - type: set_session_mode
          config: {{mode: review}}
        - type: queue_run_for_each_participant
          config: {{role: reviewer, reason: wake}}
        - type: configure_session
          config: {CONFIGURE}
        - type: queue_run
          config: {{target: primary, reason: kick}}
        - type: run_code_review
        - type: ensure_participant_seat
          config: {{role: reviewer}}
        - type: enable_plan_mode
        - type: auto_start_agent
        """,
    )
    spy = spy_on(runtime)
    await create(runtime, "T1", session=False)
    await decide(runtime, "T1", STEP)
    events = await enter(runtime, "E2", created=True)

    assert spy.kinds() == [
        "clear_decisions",
        "queue_run_for_each_participant",
        "queue_run",
        "run_code_review",
        "ensure_participant_seat",
    ]
    assert spy.session_actions == [] and of_type(events, "session_action") == []  # skipped, as today
    skipped = [d.fields["action"] for d in diags(events, "session_action_skipped_no_session", "info")]
    assert sorted(skipped) == sorted(
        [
            "reset_agent_context",
            "configure_session",
            "set_session_mode",
            "enable_plan_mode",
            "auto_start_agent",
        ]
    )
    assert await decisions(runtime, "T1", STEP) == []
    assert sorted(r["agent_profile_id"] for r in await runs(runtime)) == ["rev-a", "rev-b", "worker"]
    assert loud(events) == []


ALT = """\
id: alt
name: Alt
steps:
  - {id: intake, name: Intake, position: 0, is_start_step: true}
  - id: review
    name: Alt review
    position: 1
    events:
      on_enter:
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: alt}
"""


async def test_ac_a4_a_per_task_seat_at_a_same_named_step_of_another_workflow_gets_no_run(
    runtime: Runtime,
) -> None:
    await setup(runtime, "- type: clear_decisions", reviewers=())
    await register(runtime, ALT, import_path=True)
    await ok(
        runtime,
        {
            "type": "add_participant",
            "workflow_id": "alt",
            "step_id": STEP,
            "role": "reviewer",
            "agent_profile_id": "rev-alt",
        },
    )
    await create(runtime, "T1")
    await seat(runtime, "reviewer", "rev-old", task_id="T1")  # a per-task seat at disp/review
    await ok(runtime, {"type": "switch_workflow", "task_id": "T1", "workflow_id": "alt", "step_id": STEP})

    assert [(r["agent_profile_id"], r["reason"]) for r in await runs(runtime)] == [("rev-alt", "alt")]
