"""A run's life after its enqueue, pinned rule by rule against Kandev's runs queue
(apps/backend/internal/runs, office/service/retry.go, scheduler_staleness.go), through protocol messages.
Each test is named after the Kandev rule it pins; where onceflow is stricter the name says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
from hand_clock import HandClock
from helpers import (
    ONE_STEP_COMMENT_QUEUES_RUN,
    events,
    list_runs,
    move,
    ok,
    send,
    to_review,
)

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.runs import RunPolicy
from onceflow.protocol.times import rfc3339, unix_seconds
from onceflow.testing import RecordingHost

MINUTE, HOUR = 60.0, 3600.0


@pytest.fixture
def clock(hand_clock: HandClock) -> Callable[[], float]:
    """The wall clock the `runtime` and `office` fixtures open with: the hand-moved clock's
    (tests/hand_clock.py), so `hand_clock.advance` moves every time they stamp and judge, on both backends."""
    return hand_clock.wall


async def claim(rt: Runtime, agent: str, **extra: Any) -> dict[str, Any] | None:
    reply = await ok(rt, {"type": "claim_run", "agent_profile_id": agent, **extra})
    return reply.result  # type: ignore[no-any-return]


async def claimed(rt: Runtime, agent: str, **extra: Any) -> dict[str, Any]:
    run = await claim(rt, agent, **extra)
    assert run is not None, f"no run for {agent}"
    return run


async def fail(rt: Runtime, run: dict[str, Any], **extra: Any) -> Any:
    message = {
        "type": "finish_run",
        "run_id": run["id"],
        "claim_token": run["claim_token"],
        "status": "failed",
    }
    return await ok(rt, {**message, "error": "boom", **extra})


async def finish(rt: Runtime, run: dict[str, Any], **extra: Any) -> Any:
    message = {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]}
    return await send(rt, {**message, **extra})


async def comment(rt: Runtime, task_id: str, comment_id: str) -> Any:
    return await ok(rt, {"type": "task_comment", "task_id": task_id, "comment_id": comment_id})


async def worker_run(rt: Runtime, task_id: str = "T1", **task: Any) -> dict[str, Any]:
    """`MINIMAL` registered, a task in its work step with one run for its primary agent `worker` (a
    comment's), claimed."""
    if "m" not in rt.services.workflows.workflows:
        await ok(rt, {"type": "register_workflow", "yaml": MINIMAL, "source": "m.yml"})
    message = {"type": "create_task", "task_id": task_id, "workflow_id": "m", "primary_agent_id": "worker"}
    await ok(rt, {**message, **task})
    await comment(rt, task_id, "c-1")
    return await claimed(rt, "worker")


async def test_kandev_claim_takes_the_oldest_eligible_queued_run_of_the_agent(
    office: Runtime, hand_clock: HandClock
) -> None:
    await to_review(office, "T1")
    hand_clock.advance(60)
    await to_review(office, "T2")
    first = await claimed(office, "rev-a")
    assert (first["task_id"], first["status"], first["attempt"]) == ("T1", "claimed", 1)
    assert unix_seconds(first["lease_expires_at"]) == pytest.approx(
        hand_clock.now + RunPolicy().lease, abs=1e-6
    )
    assert first["trigger"] == "on_enter" and first["entry_seq"] == 1 and first["admission_seq"] == 2
    second = await claimed(office, "rev-a")
    assert second["task_id"] == "T2" and second["claim_token"] != first["claim_token"]
    assert await claim(office, "rev-a") is None
    # a run waiting for its retry time is not eligible before it
    await fail(office, first, retry_at=hand_clock.now + 600)
    assert await claim(office, "rev-a") is None
    hand_clock.advance(600)
    again = await claimed(office, "rev-a")
    assert (again["id"], again["attempt"], again["retries"]) == (first["id"], 2, 1)


async def test_kandev_backoff_is_2m_10m_30m_2h_plus_up_to_25_percent_jitter_at_most_4_retries(
    runtime: Runtime, hand_clock: HandClock
) -> None:
    run = await worker_run(runtime)
    for retry, base in enumerate((2 * MINUTE, 10 * MINUTE, 30 * MINUTE, 2 * HOUR), start=1):
        reply = await fail(runtime, run)
        assert reply.result["status"] == "queued"
        delay = unix_seconds(reply.result["retry_at"]) - hand_clock.now
        assert base <= delay <= base * 1.25, (retry, delay)
        [scheduled] = events(reply, "run_retry_scheduled")
        assert (scheduled.retries, scheduled.error, scheduled.retry_at) == (
            retry,
            "boom",
            reply.result["retry_at"],
        )
        hand_clock.advance(delay + 1e-6)  # past the time shown, rounded to the microsecond
        run = await claimed(runtime, "worker")
        assert (run["attempt"], run["retries"]) == (retry + 1, retry)
    last = await fail(runtime, run)
    assert (last.result["status"], last.result["retry_at"]) == ("failed", None)
    [failed] = events(last, "run_failed")
    assert (failed.reason, failed.error, failed.attempt) == ("retries_exhausted", "boom", 5)
    [row] = await list_runs(runtime, task_id="T1")
    assert (row["status"], row["outcome_reason"], row["last_error"]) == (
        "failed",
        "retries_exhausted",
        "boom",
    )


async def test_kandev_backoff_clamps_at_its_last_delay_and_jitter_spreads_retries(
    db_path: Any, host: RecordingHost, hand_clock: HandClock
) -> None:
    policy = RunPolicy(backoff=(10.0, 20.0), max_retries=6)
    async with open_runtime(db_path, host=host, clock=hand_clock.wall, run_policy=policy) as rt:
        run = await worker_run(rt)
        delays = []
        for _ in range(6):
            reply = await fail(rt, run)
            delays.append(unix_seconds(reply.result["retry_at"]) - hand_clock.now)
            hand_clock.advance(delays[-1] + 1e-6)
            run = await claimed(rt, "worker")
        assert 10 <= delays[0] <= 12.5 and all(20 <= d <= 25 for d in delays[1:])
        assert len(set(delays[1:])) > 1  # the jitter is drawn per retry


async def test_kandev_rate_limit_reset_time_from_the_host_wins_over_the_backoff(
    runtime: Runtime, hand_clock: HandClock
) -> None:
    run = await worker_run(runtime)
    reset = hand_clock.now + 5 * HOUR + 30  # the host read the reset time (+30 s) off a rate-limit error
    reply = await fail(runtime, run, retry_at=reset)
    assert (reply.result["status"], reply.result["retry_at"]) == ("queued", rfc3339(reset))
    hand_clock.advance(5 * HOUR)
    assert await claim(runtime, "worker") is None
    hand_clock.advance(30)
    assert (await claimed(runtime, "worker"))["id"] == run["id"]


async def test_kandev_after_the_last_retry_the_run_fails_and_an_agent_error_run_goes_to_the_ceo_agent(
    runtime: Runtime, hand_clock: HandClock
) -> None:
    run = await worker_run(runtime, ceo_agent_id="ceo")
    for _ in range(4):
        reply = await fail(runtime, run, error="quota")
        hand_clock.advance(unix_seconds(reply.result["retry_at"]) - hand_clock.now + 1e-6)
        run = await claimed(runtime, "worker")
    last = await fail(runtime, run, error="quota")
    [failed] = events(last, "run_failed")
    [escalation] = events(last, "run_queued")
    assert failed.escalated_run_id == escalation.run_id == last.result["escalated_run_id"]
    assert (escalation.agent_profile_id, escalation.reason) == ("ceo", "agent_error")
    ceo = await claimed(runtime, "ceo")
    assert ceo["payload"] == {"agent_profile_id": "worker", "run_id": run["id"], "error": "quota"}
    # a replayed final failure escalates nothing more
    replay = await fail(runtime, run, error="quota")
    assert replay.result["replay"] is True and replay.events == []
    assert [r["reason"] for r in await list_runs(runtime, agent_profile_id="ceo")] == ["agent_error"]


async def test_kandev_an_agents_own_failure_is_terminal_a_launch_error_retries(runtime: Runtime) -> None:
    run = await worker_run(runtime)
    launch = await fail(runtime, run, error="could not start the agent")  # retryable by default
    assert launch.result["status"] == "queued"
    await comment(runtime, "T1", "c-2")
    second = await claimed(runtime, "worker")
    own = await fail(runtime, second, error="the agent gave up", retryable=False)
    assert own.result["status"] == "failed"
    [failed] = events(own, "run_failed")
    assert (failed.reason, failed.escalated_run_id) == ("not_retryable", None)  # T1 has no CEO agent


async def test_kandev_run_too_old_a_run_requested_over_24h_ago_is_not_retried_nor_handed_out(
    runtime: Runtime, hand_clock: HandClock
) -> None:
    run = await worker_run(runtime)
    hand_clock.advance(23.99 * HOUR)
    reply = await fail(runtime, run)  # its retry would fall past the 24 h age limit
    assert reply.result["status"] == "cancelled"
    [cancelled] = events(reply, "run_cancelled")
    assert cancelled.reason == "run_too_old"
    await comment(runtime, "T1", "c-2")
    hand_clock.advance(24 * HOUR)
    claimed_late = await ok(runtime, {"type": "claim_run", "agent_profile_id": "worker"})
    assert claimed_late.result is None
    assert [(e.run_id, e.reason) for e in events(claimed_late, "run_cancelled")] == [
        (run["id"] + 1, "run_too_old")
    ]


async def test_kandev_execution_too_old_is_one_age_limit_so_the_fourth_retry_is_reachable(
    runtime: Runtime, hand_clock: HandClock
) -> None:
    """Kandev cancels a retried run older than 2 h at claim (`execution_too_old`), so its own 4th retry
    (2 + 10 + 30 min + 2 h of backoff) can never run; here one 24 h limit governs, and it runs."""
    run = await worker_run(runtime)
    for _ in range(4):
        reply = await fail(runtime, run)
        hand_clock.advance(unix_seconds(reply.result["retry_at"]) - hand_clock.now + 1e-6)
        run = await claimed(runtime, "worker")
    assert hand_clock.now - unix_seconds(run["requested_at"]) > 2 * HOUR + 42 * MINUTE
    assert (run["retries"], run["attempt"]) == (4, 5)


async def test_kandev_workflow_step_changed_a_run_of_a_left_step_is_cancelled_at_once_not_at_claim(
    office: Runtime,
) -> None:
    """Kandev cancels at claim a run whose step is no longer its task's (`workflow_step_changed`); here
    leaving the step entry cancels its queued runs in the same transaction (`entry_left`)."""
    await to_review(office, "T1")
    moved = await move(office, "T1", "work")
    cancelled = events(moved, "run_cancelled")
    assert sorted((e.agent_profile_id, e.reason) for e in cancelled) == [
        ("rev-a", "entry_left"),
        ("rev-b", "entry_left"),
    ]
    assert {r["status"] for r in await list_runs(office, task_id="T1")} == {"cancelled"}
    assert await claim(office, "rev-a") is None


async def test_kandev_cancel_is_a_compare_and_set_on_queued_or_claimed(runtime: Runtime) -> None:
    run = await worker_run(runtime)
    reply = await ok(runtime, {"type": "cancel_run", "run_id": run["id"], "reason": "operator"})
    assert reply.result == {"run_id": run["id"], "cancelled": True}
    assert [(e.reason, e.attempt) for e in events(reply, "run_cancelled")] == [("operator", 1)]
    again = await ok(runtime, {"type": "cancel_run", "run_id": run["id"]})
    assert again.result["cancelled"] is False and again.events == []
    stale = await finish(runtime, run)  # its holder learns it is no longer its claim
    assert (stale.ok, stale.error.code, stale.error.field) == (False, "conflict", "claim_token")
    await comment(runtime, "T1", "c-2")
    done = await claimed(runtime, "worker")
    assert (await finish(runtime, done)).ok
    refused = await send(runtime, {"type": "cancel_run", "run_id": done["id"]})
    assert (refused.error.code, refused.error.field) == ("conflict", "run_id")
    unknown = await send(runtime, {"type": "cancel_run", "run_id": 999})
    assert (unknown.error.code, unknown.error.field) == ("not_found", "run_id")


async def test_kandev_idempotency_key_is_a_noop_while_unresolved_and_24h_after_it_resolves(
    db_path: Any, hand_clock: HandClock
) -> None:
    """Kandev honours a key 24 h after it was seen; here while its run is unresolved, whatever its age, and
    24 h after it resolves (stricter: never more runs)."""
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": MINIMAL, "source": "m.yml"})
        await ok(
            rt, {"type": "create_task", "task_id": "T1", "workflow_id": "m", "primary_agent_id": "worker"}
        )
        assert _run_events(await comment(rt, "T1", "c-1")) == ["run_queued"]
        hand_clock.advance(25 * HOUR)
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:  # a restart: the ledger starts empty
        assert _run_events(await comment(rt, "T1", "c-1")) == ["run_suppressed"]  # still queued
        cancelled = await ok(rt, {"type": "claim_run", "agent_profile_id": "worker"})
        assert [e.reason for e in events(cancelled, "run_cancelled")] == ["run_too_old"]
        hand_clock.advance(24 * HOUR - 1)
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        assert _run_events(await comment(rt, "T1", "c-1")) == ["run_suppressed"]
        hand_clock.advance(2)
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        assert _run_events(await comment(rt, "T1", "c-1")) == ["run_queued"]


def _run_events(reply: Any) -> list[str]:
    return [e.type for e in reply.events if e.type in ("run_queued", "run_suppressed", "run_coalesced")]


MINIMAL = ONE_STEP_COMMENT_QUEUES_RUN


@pytest.mark.parametrize("lease", [0, -1, 3601, 86_401])
async def test_a_lease_outside_the_policy_is_refused_naming_lease_seconds(
    runtime: Runtime, lease: float
) -> None:
    reply = await send(runtime, {"type": "claim_run", "agent_profile_id": "worker", "lease_seconds": lease})
    assert (reply.ok, reply.error.field) == (False, "lease_seconds")


async def test_concurrent_claimers_never_share_a_run(runtime: Runtime) -> None:
    """60 claimers of one agent at once, 120 runs: each run handed out exactly once (PostgreSQL with several
    runtimes: tests/postgres/test_pg_runs.py)."""
    await ok(runtime, {"type": "register_workflow", "yaml": MINIMAL, "source": "m.yml"})
    for n in range(120):
        await ok(
            runtime, {"type": "create_task", "task_id": f"T{n}", "workflow_id": "m", "primary_agent_id": "w"}
        )
        await comment(runtime, f"T{n}", f"c-{n}")
    claimed: list[int] = []

    async def claimer() -> None:
        while (run := await claim(runtime, "w")) is not None:
            claimed.append(run["id"])

    async with trio.open_nursery() as nursery:
        for _ in range(60):
            nursery.start_soon(claimer)
    assert sorted(claimed) == sorted(set(claimed)) and len(claimed) == 120


async def test_retry_at_in_rfc3339_schedules_the_same_retry_as_unix_seconds_and_comes_back_as_sent(
    runtime: Runtime, hand_clock: HandClock
) -> None:
    """A host writes `retry_at` in the protocol's one time format, and reads the same text back."""
    run = await worker_run(runtime)
    reset = rfc3339(round(hand_clock.now) + 3600)  # whole seconds, so the text round-trips exactly
    reply = await fail(runtime, run, retry_at=reset)
    [scheduled] = events(reply, "run_retry_scheduled")
    assert (reply.result["retry_at"], scheduled.retry_at) == (reset, reset)
    hand_clock.advance(unix_seconds(reset) - hand_clock.now - 1)
    assert await claim(runtime, "worker") is None
    hand_clock.advance(1)
    assert (await claimed(runtime, "worker"))["id"] == run["id"]
