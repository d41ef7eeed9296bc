"""The runs worker under asyncio (`onceflow.aio` `rt.runs(agent)`, onceflow/aio/worker.py): bodies on the
asyncio loop, claims, renewals and finishes on the runtime's Trio thread, each test under `asyncio.run`
with real time (short leases)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import COMMENT_QUEUES_RUN

import onceflow.aio
from onceflow.actors.runtime.worker import RunError
from onceflow.aio.worker import AsyncioRun
from onceflow.protocol.errors import ProtocolError
from onceflow.protocol.events import Reply
from onceflow.protocol.runs import RunPolicy
from onceflow.protocol.times import unix_seconds

Runtime = onceflow.aio.AsyncioRuntime


async def ok(rt: Runtime, message: dict[str, Any]) -> Reply:
    reply = await rt.send(message)
    assert reply.ok, reply.error
    return reply


async def queue(rt: Runtime, task_id: str) -> None:
    task = {"type": "create_task", "task_id": task_id, "workflow_id": "m", "primary_agent_id": "worker"}
    await ok(rt, task)
    await ok(rt, {"type": "task_comment", "task_id": task_id, "comment_id": f"{task_id}-1"})


async def runs_of(rt: Runtime, task_id: str) -> list[dict[str, Any]]:
    return list((await ok(rt, {"type": "list_runs", "task_id": task_id})).result["runs"])


def run_with_runtime(db: Path, scenario: Callable[[Runtime], Awaitable[None]]) -> None:
    async def main() -> None:
        policy = RunPolicy(backoff=(60.0,), jitter=0.0)
        async with onceflow.aio.open_runtime(db, run_policy=policy) as rt:
            await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
            await scenario(rt)

    asyncio.run(main())


def test_bodies_run_on_the_loop_finish_or_fail_and_the_loop_goes_on(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        for task in ("T1", "T2", "T3"):
            await queue(rt, task)
        seen: list[AsyncioRun] = []
        async with rt.runs("worker", wait_seconds=0, until_idle=True) as runs:
            async for run in runs:
                async with run:
                    seen.append(run)
                    await asyncio.sleep(0.01)  # asyncio code: this is the caller's loop
                    if run.task_id == "T2":
                        raise ValueError("model timed out")
                    if run.task_id == "T3":
                        raise RunError("cannot apply", retryable=False)
        assert [run.task_id for run in seen] == ["T1", "T2", "T3"]
        outcomes = [run.outcome["status"] if run.outcome else None for run in seen]
        assert outcomes == ["finished", "queued", "failed"]
        [retried] = await runs_of(rt, "T2")
        assert (retried["status"], retried["last_error"]) == ("queued", "ValueError: model timed out")
        [failed] = await runs_of(rt, "T3")
        assert (failed["status"], failed["last_error"]) == ("failed", "cannot apply")

    run_with_runtime(tmp_path / "a.db", scenario)


def test_a_body_longer_than_its_lease_keeps_its_claim(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        await queue(rt, "T1")
        async with rt.subscribe() as events:
            async with rt.runs("worker", lease_seconds=1.2, wait_seconds=0, until_idle=True) as runs:
                async for run in runs:
                    first_lease = run.lease_expires_at
                    async with run:
                        await asyncio.sleep(3.0)
                    assert run.lease_expires_at is not None and first_lease is not None
                    assert unix_seconds(run.lease_expires_at) > unix_seconds(first_lease) + 1.5  # renewed
            [row] = await runs_of(rt, "T1")
            assert (row["status"], row["attempt"]) == ("finished", 1)
            await rt.send({"type": "get_task", "task_id": "T1"})
            types = []
            async for event in events:
                types.append(event.type)
                if event.type == "run_finished":
                    break
            assert "run_lease_expired" not in types

    run_with_runtime(tmp_path / "a.db", scenario)


def test_a_cancelled_run_cancels_its_body_and_the_loop_goes_on(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        await queue(rt, "T1")
        await queue(rt, "T2")
        seen: list[AsyncioRun] = []
        async with rt.runs("worker", lease_seconds=300, wait_seconds=0, until_idle=True) as runs:
            async for run in runs:
                async with run:
                    seen.append(run)
                    if run.task_id == "T1":
                        await ok(rt, {"type": "cancel_run", "run_id": run.id})
                        await asyncio.sleep(30)  # cancelled by the run_cancelled event, not a renewal
                        raise AssertionError("not cancelled")
        assert [(run.task_id, run.lost) for run in seen] == [("T1", "cancelled"), ("T2", None)]
        assert [run.outcome["status"] if run.outcome else None for run in seen] == [None, "finished"]

    async def timed(rt: Runtime) -> None:
        await asyncio.wait_for(scenario(rt), 10)

    run_with_runtime(tmp_path / "a.db", timed)


def test_cancelling_the_consumer_task_hands_its_run_back(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        await queue(rt, "T1")
        started = asyncio.Event()
        handed: list[AsyncioRun] = []

        async def work() -> None:
            async with rt.runs("worker") as runs:
                async for run in runs:
                    handed.append(run)
                    async with run:
                        started.set()
                        await asyncio.sleep(30)

        consumer = asyncio.create_task(work())
        await started.wait()
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        [run] = handed
        assert (run.released, run.outcome, run.lost) == (True, None, None)
        [row] = await runs_of(rt, "T1")
        assert (row["status"], row["attempt"], row["outcome_reason"]) == ("queued", 0, "claim_released")

    run_with_runtime(tmp_path / "a.db", scenario)


def test_a_cancelled_wait_claims_nothing(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        async with rt.runs("worker", wait_seconds=60) as runs:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(runs.__anext__(), 0.3)
        await queue(rt, "T1")
        await asyncio.sleep(0.2)
        [row] = await runs_of(rt, "T1")
        assert (row["status"], row["attempt"]) == ("queued", 0)

    run_with_runtime(tmp_path / "a.db", scenario)


def test_stop_ends_a_waiting_loop(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        async with rt.runs("worker", wait_seconds=60) as runs:
            asyncio.get_running_loop().call_later(0.2, runs.stop)
            async for _ in runs:
                raise AssertionError("nothing was queued")

    async def timed(rt: Runtime) -> None:
        await asyncio.wait_for(scenario(rt), 10)

    run_with_runtime(tmp_path / "a.db", timed)


def test_bad_options_name_their_field(tmp_path: Path) -> None:
    async def scenario(rt: Runtime) -> None:
        with pytest.raises(ProtocolError) as refused:
            rt.runs("worker", lease_seconds=0)
        assert refused.value.field == "lease_seconds"

    run_with_runtime(tmp_path / "a.db", scenario)


def test_closing_the_runtime_under_a_busy_worker_hands_its_run_back(tmp_path: Path) -> None:
    """The runtime closes first: its worker closes with it, cancelling the body and handing the run back;
    nothing hangs."""
    db = tmp_path / "a.db"
    handed: list[AsyncioRun] = []

    async def main() -> None:
        started = asyncio.Event()
        async with onceflow.aio.open_runtime(db) as rt:
            await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
            await queue(rt, "T1")

            async def work() -> None:
                async with rt.runs("worker") as runs:
                    async for run in runs:
                        handed.append(run)
                        async with run:
                            started.set()
                            await asyncio.sleep(30)

            consumer = asyncio.create_task(work())
            await started.wait()
        await asyncio.wait_for(consumer, 10)  # the loop ended: the worker closed with the runtime

    asyncio.run(main())
    [run] = handed
    assert (run.lost, run.released) == ("worker_closed", True)

    async def after() -> None:
        async with onceflow.aio.open_runtime(db) as rt:
            [row] = await runs_of(rt, "T1")
            assert (row["status"], row["attempt"]) == ("queued", 0)

    asyncio.run(after())
