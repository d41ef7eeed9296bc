"""Runtimes whose own clocks disagree agree on every lease: on PostgreSQL each lease, expiry and age is
judged by the database server's clock (store/backends/clock.py), never by the runtime's. Real server
(tests/pg_support.py), real time, two runtimes in one process on one database."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import trio
from helpers import COMMENT_QUEUES_RUN, ok

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime

RUNS = 10
SKEW = 40.0  # seconds one runtime's wall clock is ahead of the other's
LEASE = 30.0


async def _queue(rt: Runtime, count: int) -> None:
    await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
    for n in range(count):
        await ok(rt, {"type": "create_task", "task_id": f"T{n}", "workflow_id": "m", "primary_agent_id": "w"})
        await ok(rt, {"type": "task_comment", "task_id": f"T{n}", "comment_id": f"c-{n}"})


async def test_a_runtime_40_s_ahead_expires_no_lease_another_runtime_granted(pg_url: str) -> None:
    """One runtime grants ten 30 s leases; another, whose wall clock is 40 s ahead, sweeps leases every
    0.2 s and claims the same agent's runs meanwhile. It takes none, and every renewal is kept (10/10)."""
    async with AsyncExitStack() as stack:
        granting = await stack.enter_async_context(open_runtime(pg_url, clock=time.time))
        ahead = await stack.enter_async_context(
            open_runtime(pg_url, clock=lambda: time.time() + SKEW, lease_sweep_interval=0.2)
        )
        await _queue(granting, RUNS)
        held = []
        for _ in range(RUNS):
            reply = await ok(granting, {"type": "claim_run", "agent_profile_id": "w", "lease_seconds": LEASE})
            held.append(reply.result)
        watch = ahead.subscribe()
        await trio.sleep(1.0)  # five sweeps of the runtime ahead
        assert (await ok(ahead, {"type": "claim_run", "agent_profile_id": "w"})).result is None
        kept = 0
        for run in held:
            renew = {"type": "renew_run", "run_id": run["id"], "claim_token": run["claim_token"]}
            kept += (await ok(granting, {**renew, "lease_seconds": LEASE})).ok
            kept_ahead = await ok(ahead, {**renew, "lease_seconds": LEASE})  # renewed through either
            assert kept_ahead.result["lease_expires_at"] >= run["lease_expires_at"]
        assert kept == RUNS
        expired = []
        while True:
            try:
                event = watch.receive_nowait()
            except trio.WouldBlock:
                break
            if event.type == "run_lease_expired":
                expired.append(event.run_id)
        assert expired == []
