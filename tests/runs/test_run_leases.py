"""Leases, fencing tokens, superseded claims and waiting claims, on a clock moved by hand
(tests/hand_clock.py): the runtime's clock follows Trio's, and on PostgreSQL the server's clock moves with it,
so lease ends, retry times and Trio's timers (the lease sweep, a waiting claim) move together."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hand_clock import HandClock
from helpers import COMMENT_QUEUES_RUN, events, list_runs, move, ok, send, setup_office, to_review
from pg_support import freeze_server_clock

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.runs import RunPolicy
from onceflow.protocol.times import unix_seconds
from onceflow.store.runs import run_claims


@pytest.fixture
async def rt(db_path: Path | str, hand_clock: HandClock) -> AsyncIterator[Runtime]:
    async with open_runtime(db_path, clock=hand_clock.wall, lease_sweep_interval=1.0) as runtime:
        await ok(runtime, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
        yield runtime


async def queue(rt: Runtime, task_id: str, comment: str = "c-1") -> None:
    reply = await send(rt, {"type": "get_task", "task_id": task_id})
    if not reply.ok:
        await ok(
            rt, {"type": "create_task", "task_id": task_id, "workflow_id": "m", "primary_agent_id": "worker"}
        )
    await ok(rt, {"type": "task_comment", "task_id": task_id, "comment_id": comment})


async def claim(rt: Runtime, **extra: Any) -> Any:
    return await ok(rt, {"type": "claim_run", "agent_profile_id": "worker", **extra})


async def test_an_expired_lease_hands_the_run_out_again_once_and_fences_the_old_token(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await queue(rt, "T1")
    first = (await claim(rt, lease_seconds=10)).result
    watch = rt.subscribe()
    await hand_clock.elapse(rt, 11)  # the sweep runs every second
    expired = [e for e in _drain(watch) if e.type == "run_lease_expired"]
    assert [(e.run_id, e.attempt) for e in expired] == [(first["id"], 1)]
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"], row["outcome_reason"], row["lease_expires_at"]) == (
        "queued",
        1,
        "lease_expired",
        None,
    )
    second = (await claim(rt)).result
    assert (second["id"], second["attempt"]) == (first["id"], 2)
    assert second["claim_token"] != first["claim_token"]
    assert (await claim(rt)).result is None  # handed out once
    for message in (
        {"type": "finish_run", "run_id": first["id"], "claim_token": first["claim_token"]},
        {"type": "renew_run", "run_id": first["id"], "claim_token": first["claim_token"]},
    ):
        refused = await send(rt, message)
        assert (refused.ok, refused.error.code, refused.error.field) == (False, "conflict", "claim_token")
    done = await ok(rt, {"type": "finish_run", "run_id": second["id"], "claim_token": second["claim_token"]})
    assert (done.result["status"], done.result["replay"]) == ("finished", False)
    replay = await ok(
        rt, {"type": "finish_run", "run_id": second["id"], "claim_token": second["claim_token"]}
    )
    assert (replay.result["replay"], replay.events) == (True, [])
    other = await send(
        rt,
        {
            "type": "finish_run",
            "run_id": second["id"],
            "claim_token": second["claim_token"],
            "status": "failed",
        },
    )
    assert (other.error.code, other.error.field) == ("conflict", "status")


async def test_renewing_keeps_the_claim_past_its_first_lease(rt: Runtime, hand_clock: HandClock) -> None:
    await queue(rt, "T1")
    run = (await claim(rt, lease_seconds=10)).result
    for _ in range(3):
        await hand_clock.elapse(rt, 8)
        renewed = await ok(
            rt,
            {
                "type": "renew_run",
                "run_id": run["id"],
                "claim_token": run["claim_token"],
                "lease_seconds": 10,
            },
        )
        assert unix_seconds(renewed.result["lease_expires_at"]) == pytest.approx(hand_clock.now + 10)
        assert renewed.result["superseded"] is False
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"]) == ("claimed", 1)
    await hand_clock.elapse(rt, 11)
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["outcome_reason"]) == ("queued", "lease_expired")


async def test_a_claim_takes_over_an_expired_lease_itself_before_any_sweep(
    rt: Runtime, hand_clock: HandClock
) -> None:
    """The claim is judged 6 s after the claim before it, with Trio's clock still: no sweep wakes (on SQLite
    the claim's `now` is its caller's; on PostgreSQL the server's clock alone moves)."""
    await queue(rt, "T1")
    first = (await claim(rt, lease_seconds=5)).result
    later = hand_clock.now + 6
    if hand_clock.postgres:
        freeze_server_clock(str(hand_clock.db), later)
    again = await rt.services.store.transact(run_claims.claim, "worker", later, 300.0, RunPolicy())
    assert [c.kind for c in again.changes] == ["lease_expired", "claimed"]
    assert again.run is not None and (again.run.id, again.run.attempt) == (first["id"], 2)


async def test_a_lease_expires_across_a_restart(db_path: Path | str, hand_clock: HandClock) -> None:
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
        await queue(rt, "T1")
        first = (await claim(rt, lease_seconds=30)).result
    hand_clock.advance(60)  # the runtime is down when the lease ends
    async with open_runtime(db_path, clock=hand_clock.wall, lease_sweep_interval=1.0) as rt:
        await hand_clock.elapse(rt, 0)  # its first sweep runs at start
        [row] = await list_runs(rt, task_id="T1")
        assert (row["status"], row["outcome_reason"]) == ("queued", "lease_expired")
        again = (await claim(rt)).result
        assert (again["id"], again["attempt"]) == (first["id"], 2)


async def test_a_run_whose_leases_keep_expiring_fails_after_max_attempts(
    db_path: Path | str, hand_clock: HandClock
) -> None:
    policy = RunPolicy(max_attempts=2)
    async with open_runtime(
        db_path, clock=hand_clock.wall, run_policy=policy, lease_sweep_interval=1.0
    ) as rt:
        await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
        await queue(rt, "T1")
        watch = rt.subscribe()
        for _ in range(2):
            assert (await claim(rt, lease_seconds=5)).result is not None
            await hand_clock.elapse(rt, 7)
        failed = [e for e in _drain(watch) if e.type == "run_failed"]
        assert [(e.reason, e.attempt) for e in failed] == [("too_many_attempts", 2)]
        assert (await claim(rt)).result is None


async def test_a_claimed_run_of_a_left_entry_is_superseded_its_holder_told_and_never_retried(
    db_path: Path | str, kandev_templates: Path
) -> None:
    async with open_runtime(db_path) as office:
        await setup_office(office, kandev_templates / "office-default.yml")
        await to_review(office, "T1")
        held = (await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
        moved = await move(office, "T1", "work")
        assert [(e.agent_profile_id, e.reason) for e in events(moved, "run_cancelled")] == [
            ("rev-b", "entry_left")
        ]
        [note] = [e for e in events(moved, "diagnostic") if e.code == "run_superseded"]
        assert note.fields["run_id"] == held["id"]
        token = {"run_id": held["id"], "claim_token": held["claim_token"]}
        renewed = await ok(office, {"type": "renew_run", **token})
        assert renewed.result["superseded"] is True
        failed = await ok(office, {"type": "finish_run", **token, "status": "failed", "error": "stopped"})
        assert (failed.result["status"], failed.result["superseded"]) == ("cancelled", True)
        assert [e.reason for e in events(failed, "run_cancelled")] == ["entry_left"]
        rows = {r["agent_profile_id"]: r for r in await list_runs(office, task_id="T1")}
        assert rows["rev-a"]["superseded"] is True and rows["rev-a"]["status"] == "cancelled"


async def test_a_superseded_run_that_finishes_counts_as_finished(
    db_path: Path | str, kandev_templates: Path
) -> None:
    async with open_runtime(db_path) as office:
        await setup_office(office, kandev_templates / "office-default.yml")
        await to_review(office, "T1")
        held = (await ok(office, {"type": "claim_run", "agent_profile_id": "rev-a"})).result
        await move(office, "T1", "work")
        done = await ok(
            office, {"type": "finish_run", "run_id": held["id"], "claim_token": held["claim_token"]}
        )
        assert (done.result["status"], done.result["superseded"]) == ("finished", True)
        [finished] = events(done, "run_finished")
        assert finished.superseded is True


async def test_a_waiting_claim_sleeps_until_a_run_is_queued_without_polling(
    rt: Runtime, hand_clock: HandClock
) -> None:
    submitted = _count_transactions(rt)
    got: list[Any] = []

    async def waiter() -> None:
        got.append(await claim(rt, wait_seconds=30))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await hand_clock.elapse(rt, 10)
        assert got == [] and submitted() == 1  # one look, then asleep: no busy polling
        await queue(rt, "T1")
    [reply] = got
    assert reply.result["task_id"] == "T1"


async def test_a_waiting_claim_answers_null_once_its_wait_is_over(rt: Runtime, hand_clock: HandClock) -> None:
    submitted = _count_transactions(rt)
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_claim_into, rt, got, 20.0)
        await hand_clock.elapse(rt, 19.9)
        assert got == []
        await hand_clock.elapse(rt, 0.1)
    assert [reply.result for reply in got] == [None]
    assert submitted() == 2  # the first look, and the last at the deadline


async def test_a_waiting_claim_wakes_for_a_retry_time_it_was_told_of(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await queue(rt, "T1")
    run = (await claim(rt)).result
    await ok(
        rt,
        {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"], "status": "failed",
         "retry_at": hand_clock.now + 15},
    )  # fmt: skip
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_claim_into, rt, got, 60.0)
        await hand_clock.elapse(rt, 14.9)
        assert got == []
        await hand_clock.elapse(rt, 0.1)
    assert [reply.result["id"] for reply in got] == [run["id"]]


async def _claim_into(rt: Runtime, got: list[Any], wait: float) -> None:
    got.append(await claim(rt, wait_seconds=wait))


async def test_a_cancelled_wait_claims_nothing(rt: Runtime, hand_clock: HandClock) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_claim_into, rt, [], 30.0)
            await trio.testing.wait_all_tasks_blocked()
            await queue(rt, "T1")  # wakes the waiter, which is cancelled before it looks again
            scope.cancel()
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"]) == ("queued", 0)


async def test_a_claim_cancelled_once_it_committed_is_released(rt: Runtime, hand_clock: HandClock) -> None:
    await queue(rt, "T1")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_claim_into, rt, [], 0.0)
            await trio.testing.wait_all_tasks_blocked()  # the claim is in the writer's hands
            scope.cancel()
    [row] = await list_runs(rt, task_id="T1")
    assert (row["status"], row["attempt"], row["outcome_reason"]) == ("queued", 0, "claim_released")
    again = (await claim(rt)).result
    assert again["attempt"] == 1


def _drain(channel: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    seen = []
    while True:
        try:
            seen.append(channel.receive_nowait())
        except trio.WouldBlock:
            return seen


def _count_transactions(rt: Runtime) -> Any:
    """A counter of the claim transactions submitted from now on (through the store actor's single funnel;
    the lease sweep's are not counted)."""
    store = rt.services.store
    count = [0]
    submit = store._submit

    def counting(fn: Any, *args: Any) -> Any:
        count[0] += fn is run_claims.claim
        return submit(fn, *args)

    store._submit = counting  # type: ignore[method-assign]
    return lambda: count[0]
