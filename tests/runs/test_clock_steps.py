"""A wall clock that steps (an NTP correction, a VM resumed, a laptop woken) breaks no lease, ages no run and
reopens no idempotency key while the runtime runs: inside a process time is Trio's monotonic clock, read
from the wall clock once at open (and on PostgreSQL from the server's clock). Across a restart the new
reading decides, and what the previous process wrote is trusted at most so far: a lease ends at most its
own length after the restart. Real databases (both backends), real Trio scheduling, a clock moved by hand
(tests/hand_clock.py: Trio's, and on PostgreSQL the server's with it; `step_wall` moves the wall clock
alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hand_clock import HandClock
from helpers import COMMENT_QUEUES_RUN, events, list_runs, ok, send

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.times import unix_seconds
from onceflow.store.runs import runs

HOUR = 3600.0
STEPS = {"forward_61_s": 61.0, "back_1_h": -HOUR, "forward_25_h": 25 * HOUR}
LEASE = 2.0


async def queue(rt: Runtime, task_id: str, agent: str) -> None:
    """A task at Work whose comment queues one run for `agent`."""
    if "m" not in rt.services.workflows.workflows:
        await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
    await ok(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "m", "primary_agent_id": agent})
    await ok(rt, {"type": "task_comment", "task_id": task_id, "comment_id": f"c-{task_id}"})


async def claim(rt: Runtime, agent: str, **extra: Any) -> dict[str, Any] | None:
    return (await ok(rt, {"type": "claim_run", "agent_profile_id": agent, **extra})).result  # type: ignore[no-any-return]


async def renew(rt: Runtime, run: dict[str, Any]) -> Any:
    message = {"type": "renew_run", "run_id": run["id"], "claim_token": run["claim_token"]}
    return await send(rt, {**message, "lease_seconds": LEASE})


@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
async def test_a_wall_clock_step_while_running_moves_no_lease_no_age_and_no_key(
    db_path: Path | str, hand_clock: HandClock, step: float
) -> None:
    """A live holder renews its 2 s lease every second, a dead holder stopped, a thief claims every second,
    a run waits queued and a finished run's key is redelivered, around a step of the wall clock: the thief
    gets the dead holder's run once its lease is over and never the live one's, the queued run is handed
    out (not `run_too_old`), the key still suppresses."""
    async with open_runtime(db_path, clock=hand_clock.wall, lease_sweep_interval=1.0) as rt:
        await queue(rt, "live", "w")
        await queue(rt, "dead", "w")
        await queue(rt, "waiting", "idle")
        await queue(rt, "done", "d")
        live = await claim(rt, "w", lease_seconds=LEASE)
        dead = await claim(rt, "w", lease_seconds=LEASE)
        finished = await claim(rt, "d")
        assert live and dead and finished
        await ok(rt, {"type": "finish_run", "run_id": finished["id"], "claim_token": finished["claim_token"]})
        watch = rt.subscribe()

        hand_clock.step_wall(step)  # the wall clock alone: Trio's monotonic clock and the server's go on
        stolen = []
        for _ in range(6):
            await hand_clock.elapse(rt, 1.0)
            thief = await claim(rt, "w", lease_seconds=300)
            if thief is not None:
                stolen.append((thief["id"], hand_clock.now))
            renewed = await renew(rt, live)
            assert renewed.ok, (renewed.error, stolen)  # a claim renewed a second ago is never taken
        assert [run_id for run_id, _ in stolen] == [dead["id"]]  # once, and not an hour later
        assert stolen[0][1] - unix_seconds(dead["lease_expires_at"]) <= 1.0

        waiting = await ok(rt, {"type": "claim_run", "agent_profile_id": "idle"})
        assert waiting.result is not None and waiting.result["attempt"] == 1
        assert not events(waiting, "run_cancelled")
        key = finished["idempotency_key"]
        request = runs.RunRequest("d", "done", "work", "task_comment", idempotency_key=key)
        again = await rt.services.store.transact(runs.enqueue_run, request, rt.services.now())
        assert (again.outcome, again.run_id) == ("suppressed", finished["id"])
        seen = drain(watch)
        assert [e.run_id for e in seen if e.type == "run_lease_expired"] in ([], [dead["id"]])
        assert not [e for e in seen if e.type == "run_cancelled"]


async def test_across_a_restart_whose_clock_went_back_an_hour_a_dead_holders_run_returns_after_its_lease(
    db_path: Path | str, hand_clock: HandClock
) -> None:
    """The runtime stops while a dead holder's 2 s lease runs; the clock it reads at open (the wall clock on
    SQLite, the server's on PostgreSQL) goes back an hour. The lease ends at most its own 2 s after the
    restart, not an hour later; the queued run and the times of the history stay (clamped to the restart,
    not aged)."""
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await queue(rt, "dead", "w")
        await queue(rt, "waiting", "idle")
        dead = await claim(rt, "w", lease_seconds=LEASE)
        assert dead is not None
    hand_clock.step_wall(-HOUR)
    hand_clock.step_server(-HOUR)
    async with open_runtime(db_path, clock=hand_clock.wall, lease_sweep_interval=1.0) as rt:
        assert await claim(rt, "w") is None  # the lease holds a little longer: its 2 s from the restart
        [row] = await list_runs(rt, task_id="dead")
        assert unix_seconds(row["lease_expires_at"]) <= rt.services.now() + LEASE
        taken = None
        for _ in range(3):
            await hand_clock.elapse(rt, 1.0)
            if (taken := await claim(rt, "w")) is not None:
                break
        assert taken is not None and (taken["id"], taken["attempt"]) == (dead["id"], 2)
        [waiting] = await list_runs(rt, task_id="waiting")
        assert (waiting["status"], unix_seconds(waiting["requested_at"]) <= rt.services.now()) == (
            "queued",
            True,
        )


def drain(channel: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    seen = []
    while True:
        try:
            seen.append(channel.receive_nowait())
        except trio.WouldBlock:
            return seen
