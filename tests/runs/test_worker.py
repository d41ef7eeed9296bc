"""The runs worker (`rt.runs(agent)`, actors/runtime/worker.py) under Trio: it claims, renews while a slow
body runs, finishes from the body's outcome, cancels a body whose claim is lost, and hands back a run its
consumer stops working on. Real SQLite, real Trio scheduling; a clock moved by hand drives the leases
(tests/hand_clock.py: the runtime's clock follows Trio's, and on PostgreSQL the server's moves with it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hand_clock import HandClock
from helpers import COMMENT_QUEUES_RUN, list_runs, ok, send

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.actors.runtime.worker import Run, RunError
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.events import Event
from onceflow.protocol.runs import RunPolicy
from onceflow.protocol.times import rfc3339
from onceflow.store.runs import run_claims


@pytest.fixture
async def rt(db_path: Path | str, hand_clock: HandClock) -> AsyncIterator[Runtime]:
    policy = RunPolicy(backoff=(60.0,), jitter=0.0)
    async with open_runtime(db_path, clock=hand_clock.wall, run_policy=policy) as runtime:
        await ok(runtime, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
        yield runtime


async def queue(rt: Runtime, task_id: str, comment: str = "1") -> None:
    """One run for agent `worker` (a comment on the task, created at Work when new)."""
    if not (await send(rt, {"type": "get_task", "task_id": task_id})).ok:
        task = {"type": "create_task", "task_id": task_id, "workflow_id": "m", "primary_agent_id": "worker"}
        await ok(rt, task)
    await ok(rt, {"type": "task_comment", "task_id": task_id, "comment_id": f"{task_id}-{comment}"})


def _nothing(conn: object) -> None:
    return None


def drain(events: trio.MemoryReceiveChannel[Event]) -> list[Event]:
    seen = []
    while True:
        try:
            seen.append(events.receive_nowait())
        except trio.WouldBlock:
            return seen


def diagnostics(seen: list[Event], code: str) -> list[dict[str, Any]]:
    return [e.fields for e in seen if e.type == "diagnostic" and getattr(e, "code", None) == code]


async def test_a_completed_body_finishes_its_run_and_the_loop_waits_for_the_next(rt: Runtime) -> None:
    await queue(rt, "T1")
    watch = rt.subscribe()
    done: list[Run] = []
    async with rt.runs("worker", wait_seconds=5) as runs:
        async for run in runs:
            async with run:
                assert (run.task_id, run.reason, run.attempt) == ("T1", "task_comment", 1)
                await trio.sleep(0)
            done.append(run)
            if len(done) == 1:
                await queue(rt, "T1", "2")  # the next claim takes it
            else:
                runs.stop()
    assert [run.outcome["status"] for run in done if run.outcome] == ["finished", "finished"]
    rows = await list_runs(rt, task_id="T1")
    assert [(row["status"], row["attempt"]) for row in rows] == [("finished", 1), ("finished", 1)]
    types = [e.type for e in drain(watch) if e.type.startswith("run_")]
    assert types == ["run_claimed", "run_finished", "run_queued", "run_claimed", "run_finished"]


async def test_a_slow_body_keeps_its_claim_through_renewals(rt: Runtime, hand_clock: HandClock) -> None:
    """Lease 30 s, a body of 100 s: renewed every 10 s, never expired, one attempt."""
    await queue(rt, "T1")
    watch = rt.subscribe()
    seen_leases: list[str | None] = []  # RFC 3339 UTC: sorts as the times do

    async def work() -> None:
        async with rt.runs("worker", lease_seconds=30) as runs:
            async for run in runs:
                async with run:
                    for _ in range(10):
                        await trio.sleep(10)
                        seen_leases.append(run.lease_expires_at)
                runs.stop()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        await hand_clock.elapse(rt, 101, step=1.0)
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"]) == ("finished", 1)
    assert len(set(seen_leases)) >= 9  # each renewal moved the lease's end
    assert seen_leases == sorted(seen_leases)
    assert not [e for e in drain(watch) if e.type == "run_lease_expired"]


async def test_without_renewals_the_same_body_would_lose_its_lease(
    rt: Runtime, hand_clock: HandClock
) -> None:
    """The control for the test above: a claim held 100 s without the worker expires (the test can fail)."""
    await queue(rt, "T1")
    watch = rt.subscribe()
    await ok(rt, {"type": "claim_run", "agent_profile_id": "worker", "lease_seconds": 30})
    await hand_clock.elapse(rt, 40, step=1.0)
    assert [e.type for e in drain(watch) if e.type == "run_lease_expired"] == ["run_lease_expired"]


async def test_a_raising_body_fails_its_run_retryable_and_the_loop_goes_on(rt: Runtime) -> None:
    await queue(rt, "T1")
    await queue(rt, "T2")
    watch = rt.subscribe()
    ran: list[str | None] = []
    async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs:
        async for run in runs:
            async with run:
                ran.append(run.task_id)
                if run.task_id == "T1":
                    raise ValueError("model timed out")
            if len(ran) == 2:
                runs.stop()
    assert ran == ["T1", "T2"]
    [failed] = await list_runs(rt, task_id="T1")
    assert (failed["status"], failed["retries"], failed["last_error"]) == (
        "queued",
        1,
        "ValueError: model timed out",
    )
    [finished] = await list_runs(rt, task_id="T2")
    assert finished["status"] == "finished"
    assert [e.type for e in drain(watch) if e.type in ("run_retry_scheduled", "run_finished")] == [
        "run_retry_scheduled",
        "run_finished",
    ]


async def test_run_error_not_retryable_fails_the_run_for_good(rt: Runtime) -> None:
    await queue(rt, "T1")
    async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs:
        async for run in runs:
            async with run:
                raise RunError("the diff does not apply", retryable=False)
            runs.stop()
    assert run.outcome is not None and run.outcome["status"] == "failed"
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["last_error"]) == ("failed", "the diff does not apply")


async def test_run_error_retry_at_schedules_the_retry_then(rt: Runtime) -> None:
    await queue(rt, "T1")
    async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs:
        async for run in runs:
            at = rt.services.now() + 5
            async with run:
                raise RunError("rate limited", retry_at=at)
            runs.stop()
    assert run.outcome is not None and (run.outcome["status"], run.outcome["retry_at"]) == (
        "queued",
        rfc3339(at),
    )


async def test_a_cancelled_run_cancels_its_body_at_once_and_the_loop_goes_on(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await queue(rt, "T1")
    watch = rt.subscribe()
    cancelled_at: list[float] = []
    async with rt.runs("worker", lease_seconds=300, wait_seconds=0, until_idle=True) as runs:
        async for run in runs:
            async with run:
                began = trio.current_time()
                await ok(rt, {"type": "cancel_run", "run_id": run.id, "reason": "user_stopped"})
                try:
                    await trio.sleep(1000)
                finally:
                    cancelled_at.append(trio.current_time())
            runs.stop()
    assert cancelled_at == [began]  # not at a renewal, 100 s later: the event cancelled it
    assert (run.lost, run.outcome, run.released) == ("cancelled", None, False)
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["outcome_reason"]) == ("cancelled", "user_stopped")
    [lost] = diagnostics(drain(watch), "run_lost")
    assert (lost["run_id"], lost["reason"], lost["cause"]) == (run.id, "cancelled", "user_stopped")


async def test_a_claim_taken_over_is_found_at_the_next_renewal_and_cancels_the_body(
    rt: Runtime, hand_clock: HandClock
) -> None:
    """No event tells this runtime (as when another PostgreSQL runtime took the run over): the renewal's
    conflict does."""
    await queue(rt, "T1")
    watch = rt.subscribe()
    outcome: list[Run] = []

    async def work() -> None:
        async with rt.runs("worker", lease_seconds=30, wait_seconds=0, until_idle=True) as runs:
            async for run in runs:
                async with run:
                    await rt.services.store.transact(run_claims.release, run.id, run.claim_token)
                    await ok(rt, {"type": "claim_run", "agent_profile_id": "worker"})  # another holder
                    await trio.sleep(1000)
                outcome.append(run)
                runs.stop()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        await hand_clock.elapse(rt, 11, step=1.0)
    [run] = outcome
    assert (run.lost, run.outcome) == ("claim_lost", None)
    [lost] = diagnostics(drain(watch), "run_lost")
    assert lost["reason"] == "claim_lost"
    [row] = await list_runs(rt, task_id="T1")
    assert row["status"] == "claimed"  # the other holder's claim is untouched


async def test_a_superseded_run_cancels_its_body_and_is_not_retried(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await queue(rt, "T1")
    outcome: list[Run] = []

    async def work() -> None:
        async with rt.runs("worker", lease_seconds=30, wait_seconds=0, until_idle=True) as runs:
            async for run in runs:
                async with run:
                    await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "done"})
                    await trio.sleep(1000)
                outcome.append(run)
                runs.stop()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        await hand_clock.elapse(rt, 11, step=1.0)
    [run] = outcome
    assert (run.lost, run.superseded) == ("superseded", True)
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["outcome_reason"]) == ("cancelled", "entry_left")


async def test_a_body_that_completes_after_superseding_its_own_run_finishes_it(rt: Runtime) -> None:
    """The agent's own move leaves the entry (as a developer's turn_complete does): its finish counts."""
    await queue(rt, "T1")
    async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs:
        async for run in runs:
            async with run:
                await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "done"})
    assert run.lost is None
    assert run.outcome is not None and (run.outcome["status"], run.outcome["superseded"]) == (
        "finished",
        True,
    )


async def test_cancelling_the_consumer_hands_its_run_back(rt: Runtime) -> None:
    await queue(rt, "T1")
    watch = rt.subscribe()
    started = trio.Event()
    handed: list[Run] = []

    async def work() -> None:
        async with rt.runs("worker") as runs:
            async for run in runs:
                handed.append(run)
                async with run:
                    started.set()
                    await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        await started.wait()
        nursery.cancel_scope.cancel()
    [run] = handed
    assert (run.released, run.outcome, run.lost) == (True, None, None)
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"], row["outcome_reason"]) == ("queued", 0, "claim_released")
    [released] = diagnostics(drain(watch), "run_released")
    assert released["run_id"] == run.id
    again = await ok(rt, {"type": "claim_run", "agent_profile_id": "worker"})
    assert (again.result["id"], again.result["attempt"]) == (run.id, 1)  # at once, not after a lease


async def test_a_waiting_claim_wakes_for_a_released_run(rt: Runtime, hand_clock: HandClock) -> None:
    """A second worker of the agent, long-polling, takes the run the first hands back at once (the mock
    clock does not move: without the wake-up it would wait its 60 s)."""
    await queue(rt, "T1")
    first_started = trio.Event()
    first_scope = trio.CancelScope()
    taken: list[Run] = []

    async def first() -> None:
        with first_scope:
            async with rt.runs("worker") as runs:
                async for run in runs:
                    async with run:
                        first_started.set()
                        await trio.sleep_forever()

    async def other() -> None:
        async with rt.runs("worker") as runs:
            async for run in runs:
                async with run:
                    taken.append(run)
                runs.stop()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await first_started.wait()
        nursery.start_soon(other)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []
        first_scope.cancel()
        for _ in range(3):
            await trio.testing.wait_all_tasks_blocked()
            await rt.services.store.transact(_nothing)
        assert [(run.id, run.attempt) for run in taken] == [(1, 1)]


async def test_cancel_while_waiting_claims_nothing_and_stop_ends_the_loop(rt: Runtime) -> None:
    async with rt.runs("worker", wait_seconds=60) as runs:
        with trio.move_on_after(0.3):
            async for _ in runs:
                raise AssertionError("nothing was queued")
        runs.stop()
        async for _ in runs:
            raise AssertionError("stopped")
    await queue(rt, "T1")
    [row] = await list_runs(rt, task_id="T1")
    assert row["status"] == "queued"


async def test_runs_handed_to_tasks_are_worked_on_concurrently(rt: Runtime) -> None:
    """Each run is entered by a task of the host's nursery: three at once, each finished on its own."""
    for task in ("T1", "T2", "T3"):
        await queue(rt, task)
    release = trio.Event()
    working: list[Run] = []

    async def handle(run: Run) -> None:
        async with run:
            working.append(run)
            await release.wait()

    async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs, trio.open_nursery() as nursery:
        async for run in runs:
            nursery.start_soon(handle, run)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(run.task_id or "" for run in working) == ["T1", "T2", "T3"]
        assert [row["status"] for row in await list_runs(rt)] == ["claimed"] * 3
        release.set()
    assert [row["status"] for row in await list_runs(rt)] == ["finished"] * 3


async def test_a_run_never_entered_is_handed_back(rt: Runtime) -> None:
    await queue(rt, "T1")
    async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs:
        async for run in runs:  # noqa: B007 (the run is left unentered on purpose)
            break
    assert run.released
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"]) == ("queued", 0)


async def test_an_error_outside_a_run_leaves_the_worker_as_it_is(rt: Runtime) -> None:
    """Not wrapped in an ExceptionGroup by the worker's nursery."""
    with pytest.raises(KeyError):
        async with rt.runs("worker", wait_seconds=1):
            raise KeyError("mine")


async def test_bad_options_name_their_field(rt: Runtime) -> None:
    for options, field in (
        ({"agent_profile_id": ""}, "agent_profile_id"),
        ({"agent_profile_id": "w", "lease_seconds": 4000.0}, "lease_seconds"),  # above max_lease
        ({"agent_profile_id": "w", "lease_seconds": -1.0}, "lease_seconds"),
        ({"agent_profile_id": "w", "wait_seconds": 61.0}, "wait_seconds"),
        ({"agent_profile_id": "w", "wait_seconds": 0.0}, "wait_seconds"),  # a busy poll
    ):
        with pytest.raises(ProtocolError) as refused:
            rt.runs(**options)
        assert refused.value.field == field


async def test_a_worker_iterated_without_entering_it_says_so(rt: Runtime) -> None:
    with pytest.raises(RuntimeError, match="async with"):
        async for _ in rt.runs("worker"):
            pass


def test_run_error_takes_a_retry_time_in_rfc3339_or_unix_seconds_and_refuses_others() -> None:
    assert (
        RunError("x", retry_at="2026-03-01T12:00:00Z").retry_at
        == RunError("x", retry_at=1_772_366_400).retry_at
    )
    for retry_at in (-1.0, float("inf"), float("nan"), True, "tomorrow", "2026-03-01T12:00:00+01:00"):
        with pytest.raises(ProtocolError) as refused:
            RunError("x", retry_at=retry_at)
        assert refused.value.field == "retry_at"
