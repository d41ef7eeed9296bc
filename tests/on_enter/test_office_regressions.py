"""Regression tests named after the acceptance criteria of shared/specs/on-enter-action-dispatch.md.

Every entry here arrives through an ordinary transition (turn_complete → on_turn_complete, entry path E1),
never through a direct on_enter call, and is checked through protocol queries and reply events only.
"""

from __future__ import annotations

import textwrap

import pytest
from helpers import (
    FakeClock,
    add_participant,
    decide,
    diagnostics,
    events,
    list_entries,
    list_runs,
    ok,
    register,
    step_of,
    turn_complete,
)

from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Reply

WF = "custom"

# Work → Review. Each test supplies Review's on_enter list; a reviewer veto sends the task back to Work.
TEMPLATE = """\
id: custom
name: Custom review
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_blocker_resolved:
        - type: queue_run
          config: {{target: primary, reason: unblocked}}
      on_agent_error:
        - type: queue_run
          config: {{target: primary, reason: unblocked}}
      on_turn_complete:
        - type: move_to_step
          config: {{step_id: review}}
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
{on_enter}
      on_turn_complete:
        - type: move_to_step
          config:
            step_id: work
            wait_for_quorum: {{role: reviewer, threshold: any_reject}}
"""


async def custom_workflow(rt: Runtime, on_enter: str, reviewers: tuple[str, ...] = ("rev-a",)) -> None:
    """Register TEMPLATE with `on_enter` as Review's on_enter list and seat `reviewers` at Review."""
    actions = textwrap.indent(textwrap.dedent(on_enter).strip(), " " * 8)
    await register(rt, TEMPLATE.format(on_enter=actions))
    for reviewer in reviewers:
        await add_participant(rt, WF, "review", "reviewer", reviewer)


async def enter_review(rt: Runtime, task_id: str) -> Reply:
    """Create the task in Work and let its turn complete: an E1 entry into Review."""
    await ok(
        rt,
        {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": WF,
            "session_id": f"s-{task_id}",
            "primary_agent_id": "worker",
        },
    )
    reply = await turn_complete(rt, task_id)
    assert await step_of(rt, task_id) == "review"
    return reply


async def reject_and_reenter(rt: Runtime, task_id: str, reviewer: str = "rev-a") -> Reply:
    await decide(rt, task_id, "review", reviewer, "rejected")
    assert await step_of(rt, task_id) == "work"
    reply = await turn_complete(rt, task_id)
    assert await step_of(rt, task_id) == "review"
    return reply


def marker_states(entry: dict) -> list[tuple[int, str, str, str]]:
    return [(m["position"], m["kind"], m["state"], m["detail"]) for m in entry["markers"]]


async def test_ac_d3_turn_complete_entry_queues_one_run_for_the_single_reviewer(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_requested}
        """,
    )
    await add_participant(runtime, WF, "review", "watcher", "watcher-1")  # another role: no run
    reply = await enter_review(runtime, "T1")
    assert [e.entry_path for e in events(reply, "step_entered")] == ["E1"]
    runs = await list_runs(runtime)
    assert [(r["agent_profile_id"], r["reason"], r["task_id"], r["step_id"], r["status"]) for r in runs] == [
        ("rev-a", "review_requested", "T1", "review", "queued")
    ]


async def test_ac_d4_ac_b3_reentry_after_rejection_queues_a_fresh_run(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_requested}
        """,
    )
    await enter_review(runtime, "T1")
    again = await reject_and_reenter(runtime, "T1")

    assert [e.deleted for e in events(again, "decisions_cleared")] == [1]  # a fresh clear of the veto
    assert events(again, "run_suppressed") == [] and events(again, "run_coalesced") == []
    runs = await list_runs(runtime, agent_profile_id="rev-a")
    # the left entry's run was cancelled when the task left it; the re-entry's is a fresh, runnable run
    assert [(r["status"], r["outcome_reason"]) for r in runs] == [
        ("cancelled", "entry_left"),
        ("queued", None),
    ]
    assert runs[0]["idempotency_key"] != runs[1]["idempotency_key"]
    assert [e["entry_seq"] for e in await list_entries(runtime, "T1")] == [1, 2]


async def test_ac_h1_fan_out_reason_defaults_to_on_enter(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer}
        """,
    )
    await enter_review(runtime, "T1")
    assert [r["reason"] for r in await list_runs(runtime)] == ["on_enter"]


async def test_ac_h2_fan_out_without_payload_stores_null(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: bare}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: loaded, payload: {stage_type: review}}
        """,
    )
    await enter_review(runtime, "T1")
    runs = await list_runs(runtime)
    assert [(r["reason"], r["payload"]) for r in runs] == [
        ("bare", None),
        ("loaded", {"stage_type": "review"}),
    ]


async def test_ac_e4_clear_decisions_with_nothing_recorded_is_done(runtime: Runtime) -> None:
    await custom_workflow(runtime, "- type: clear_decisions")
    reply = await enter_review(runtime, "T1")
    assert [(e.step_id, e.deleted) for e in events(reply, "decisions_cleared")] == [("review", 0)]
    assert [(e.kind, e.outcome) for e in events(reply, "action_outcome")] == [("clear_decisions", "done")]
    [entry] = await list_entries(runtime, "T1")
    assert marker_states(entry) == [(0, "clear_decisions", "done", "")]
    assert entry["terminal"] is True


async def test_ac_e1_fan_out_matching_nobody_warns_and_does_not_fail(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: approver, reason: nobody_home}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_requested}
        """,
    )
    reply = await enter_review(runtime, "T1")
    [warning] = diagnostics(reply, "fan_out_matched_nobody")
    assert warning.level == "warning"
    assert (warning.fields["step_id"], warning.fields["role"]) == ("review", "approver")
    assert diagnostics(reply, "on_enter_action_failed") == []
    assert [r["reason"] for r in await list_runs(runtime)] == [
        "review_requested"
    ]  # the next action still ran
    [entry] = await list_entries(runtime, "T1")
    assert [(p, state) for p, _, state, _ in marker_states(entry)] == [(0, "done"), (1, "done")]
    assert entry["terminal"] is True


async def test_ac_e1_fan_out_matching_nobody_warning_names_the_step_name(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: approver}
        """,
    )
    [warning] = diagnostics(await enter_review(runtime, "T1"), "fan_out_matched_nobody")
    assert "Review" in warning.fields.values()


@pytest.mark.parametrize(
    "config", ["{reason: anyone}", "{role: '', reason: anyone}"], ids=["absent", "empty"]
)
async def test_ac_e3_fan_out_without_role_enqueues_nothing_and_errors(runtime: Runtime, config: str) -> None:
    await custom_workflow(
        runtime,
        f"""
        - type: queue_run_for_each_participant
          config: {config}
        """,
        reviewers=("rev-a", "rev-b"),
    )
    await add_participant(runtime, WF, "review", "approver", "boss")
    reply = await enter_review(runtime, "T1")
    assert await list_runs(runtime) == []  # an empty role is not "all roles"
    [error] = diagnostics(reply, "fan_out_role_missing")
    assert error.level == "error"
    assert (error.fields["workflow_id"], error.fields["step_id"]) == (WF, "review")
    [entry] = await list_entries(runtime, "T1")  # a record is allocated even though every action is skipped
    assert marker_states(entry) == [(0, "queue_run_for_each_participant", "skipped", "malformed")]


@pytest.mark.parametrize("on_enter", ["[]", "- type: auto_start_agent"], ids=["empty", "orchestrator_only"])
async def test_ac_e5_step_without_engine_actions_allocates_no_entry(runtime: Runtime, on_enter: str) -> None:
    await custom_workflow(runtime, on_enter)
    reply = await enter_review(runtime, "T1")
    assert [e.entry_seq for e in events(reply, "step_entered")] == [None]
    assert await list_entries(runtime, "T1") == []
    assert events(reply, "action_outcome") == []
    expected = [] if on_enter == "[]" else [("auto_start_agent", "s-T1")]
    assert [(a.action, a.session_id) for a in events(reply, "session_action")] == expected


async def test_ac_h9_on_enter_runs_are_not_coalesced(runtime: Runtime, clock: FakeClock) -> None:
    await custom_workflow(
        runtime,
        """
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_requested}
        """,
    )
    # Control: a non-on_enter queue_run of the same task for the same agent and reason within 5 s is
    # coalesced (coalescing never crosses tasks).
    await ok(
        runtime, {"type": "create_task", "task_id": "C1", "workflow_id": WF, "primary_agent_id": "worker"}
    )
    await ok(runtime, {"type": "blockers_resolved", "task_id": "C1"})
    last = await ok(runtime, {"type": "agent_error", "task_id": "C1", "run_id": "r-1"})
    assert [e.coalesced_count for e in events(last, "run_coalesced")] == [1]

    await enter_review(runtime, "T1")
    clock.advance(2)
    second_task = await enter_review(runtime, "T2")
    clock.advance(2)
    reentry = await reject_and_reenter(runtime, "T1")  # T1's first run was queued until T1 left Review
    assert events(second_task, "run_coalesced") == [] and events(reentry, "run_coalesced") == []
    runs = await list_runs(runtime, agent_profile_id="rev-a")
    assert [(r["task_id"], r["status"], r["coalesced_count"]) for r in runs] == [
        ("T1", "cancelled", 0),
        ("T2", "queued", 0),
        ("T1", "queued", 0),
    ]


async def test_ac_b1_run_key_carries_entry_seq_position_and_agent(runtime: Runtime) -> None:
    await custom_workflow(
        runtime,
        """
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_requested}
        - type: queue_run_for_each_participant
          config: {role: reviewer, reason: review_requested}
        """,
        reviewers=("rev-a", "rev-b"),
    )
    first = await enter_review(runtime, "T1")
    second = await reject_and_reenter(runtime, "T1")

    # (entry, position, agent) for every run, from the action_outcome that follows each fan-out's runs
    keyed: dict[tuple[int, int, str], str] = {}
    for entry_seq, reply in ((1, first), (2, second)):
        pending: list = []
        for event in reply.events:
            if event.type == "run_queued":
                pending.append(event)
            elif event.type == "action_outcome" and event.kind == "queue_run_for_each_participant":
                keyed.update(
                    {
                        (entry_seq, event.position, run.agent_profile_id): run.idempotency_key
                        for run in pending
                    }
                )
                pending = []
        assert events(reply, "run_suppressed") == []

    assert sorted(keyed) == [(e, p, a) for e in (1, 2) for p in (1, 2) for a in ("rev-a", "rev-b")]
    assert None not in keyed.values()
    assert len(set(keyed.values())) == 8  # differs by entry_seq, by position and by agent
    runs = await list_runs(runtime, task_id="T1")
    assert sorted(r["idempotency_key"] for r in runs) == sorted(keyed.values())
