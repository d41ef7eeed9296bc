"""The runs queue on PostgreSQL with several runtimes on one database: no run is ever handed to two
claimers, and a lease one runtime granted expires on another. Real server (tests/pg_support.py), real
time (the runtimes share it)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
from helpers import ONE_STEP_COMMENT_QUEUES_RUN, ok

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.errors import ConflictError
from onceflow.protocol.runs import RunPolicy
from onceflow.store.backends import postgres
from onceflow.store.runs import run_claims

WORKFLOW = ONE_STEP_COMMENT_QUEUES_RUN
RUNS, RUNTIMES, CLAIMERS = 200, 3, 20


async def _queue(rt: Runtime, count: int) -> None:
    await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "m.yml"})

    async def one(n: int) -> None:
        await ok(rt, {"type": "create_task", "task_id": f"T{n}", "workflow_id": "m", "primary_agent_id": "w"})
        await ok(rt, {"type": "task_comment", "task_id": f"T{n}", "comment_id": f"c-{n}"})

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(one, n)


async def test_several_runtimes_claiming_at_once_never_hand_a_run_out_twice(pg_url: str) -> None:
    async with AsyncExitStack() as stack:
        runtimes = [await stack.enter_async_context(open_runtime(pg_url)) for _ in range(RUNTIMES)]
        await _queue(runtimes[0], RUNS)
        claimed: list[int] = []

        async def claimer(rt: Runtime) -> None:
            while (reply := await ok(rt, {"type": "claim_run", "agent_profile_id": "w"})).result is not None:
                claimed.append(reply.result["id"])

        async with trio.open_nursery() as nursery:
            for rt in runtimes:
                for _ in range(CLAIMERS):
                    nursery.start_soon(claimer, rt)
    assert len(claimed) == RUNS
    assert [run for run, count in Counter(claimed).items() if count > 1] == []


async def test_a_lease_granted_by_one_runtime_expires_on_another(pg_url: str) -> None:
    async with open_runtime(pg_url) as first:
        await _queue(first, 1)
        held: dict[str, Any] = (
            await ok(first, {"type": "claim_run", "agent_profile_id": "w", "lease_seconds": 1})
        ).result
    async with open_runtime(pg_url, lease_sweep_interval=0.2) as second:
        watch = second.subscribe()
        with trio.fail_after(10):
            async for event in watch:
                if event.type == "run_lease_expired":
                    assert event.run_id == held["id"]
                    break
        again = (await ok(second, {"type": "claim_run", "agent_profile_id": "w"})).result
        assert (again["id"], again["attempt"]) == (held["id"], 2)
        stale = await second.send(
            {"type": "finish_run", "run_id": held["id"], "claim_token": held["claim_token"]}
        )
        assert (stale.ok, stale.error.field) == (False, "claim_token")


async def test_a_waiting_claim_on_postgresql_sees_another_runtimes_enqueue(pg_url: str) -> None:
    async with open_runtime(pg_url) as waiter, open_runtime(pg_url) as producer:
        await _queue(producer, 0)
        got: list[Any] = []

        async def wait() -> None:
            got.append(await ok(waiter, {"type": "claim_run", "agent_profile_id": "w", "wait_seconds": 10}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(0.3)
            await ok(
                producer,
                {"type": "create_task", "task_id": "T1", "workflow_id": "m", "primary_agent_id": "w"},
            )
            await ok(producer, {"type": "task_comment", "task_id": "T1", "comment_id": "c-1"})
        [reply] = got
        assert reply.result["task_id"] == "T1"


def _renew(conn: Any, run_id: int, token: str) -> object:
    return run_claims.renew(conn, run_id, token, time.time(), 30.0)


def _retry(conn: Any, run_id: int, token: str) -> object:
    return run_claims.finish(
        conn, run_id, token, "failed", error="boom", retryable=True, retry_at=None, now=time.time(),
        policy=RunPolicy(), draw=0.5,
    )  # fmt: skip


@pytest.mark.parametrize("call", [_renew, _retry], ids=["renew", "failed_retryable"])
async def test_a_holders_call_waiting_while_another_runtime_takes_the_run_over_is_refused(
    pg_url: str, call: Callable[[Any, int, str], object]
) -> None:
    """A renewal or a retryable failure reads the run as held under its token, then waits for the row while
    another runtime's transaction takes the claim over (a new token) and commits: under READ COMMITTED its
    compare-and-set then matches no row, and the call is a stale `claim_token` conflict that changed nothing
    (not a renewal reported done, not an internal error)."""
    async with open_runtime(pg_url) as rt:
        await _queue(rt, 1)
        held = (await ok(rt, {"type": "claim_run", "agent_profile_id": "w"})).result

    def race() -> tuple[BaseException | None, tuple[Any, ...]]:
        with (
            contextlib.closing(postgres.connect(pg_url)) as other,
            contextlib.closing(postgres.connect(pg_url)) as holder,
        ):
            pid = holder.scalar("SELECT pg_backend_pid()")
            other.execute("BEGIN")
            other.execute("UPDATE runs SET claim_token = 'taken-over', attempt = attempt + 1 WHERE id = ?",
                          (held["id"],))  # fmt: skip
            outcome: list[BaseException | None] = []

            def hold() -> None:
                holder.execute("BEGIN")
                try:
                    call(holder, held["id"], held["claim_token"])
                    outcome.append(None)
                except Exception as exc:
                    outcome.append(exc)
                holder.execute("COMMIT")

            thread = threading.Thread(target=hold)
            thread.start()
            deadline = time.monotonic() + 10
            while not other.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ? AND wait_event_type = 'Lock'", (pid,)
            ):
                assert time.monotonic() < deadline, "the holder's call never waited for the row"
                time.sleep(0.01)
            other.execute("COMMIT")
            thread.join(10)
            row = other.execute(
                "SELECT status, claim_token, attempt, lease_expires_at FROM runs WHERE id = ?", (held["id"],)
            ).fetchone()
            return outcome[0], tuple(row)

    error, row = await trio.to_thread.run_sync(race)
    assert isinstance(error, ConflictError) and error.field == "claim_token", repr(error)
    assert row[:3] == ("claimed", "taken-over", held["attempt"] + 1)
