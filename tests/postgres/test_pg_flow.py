"""Flow control on PostgreSQL with several runtimes on one database: a ceiling is one ceiling, not one per
runtime (a storm of claimers on three runtimes never holds more than it), and a pause set through one runtime
holds on the others. Real server (tests/pg_support.py), real time."""

from __future__ import annotations

import random
import threading
from contextlib import AsyncExitStack

import psycopg
import trio
from helpers import ONE_STEP_COMMENT_QUEUES_RUN, ok

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime

WORKFLOW = ONE_STEP_COMMENT_QUEUES_RUN
RUNS, RUNTIMES, CLAIMERS, CEILING = 120, 3, 8, 4


async def _queue(rt: Runtime, count: int) -> None:
    await ok(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "m.yml"})
    for n in range(count):
        await ok(rt, {"type": "create_task", "task_id": f"T{n}", "workflow_id": "m", "primary_agent_id": "w"})
        await ok(rt, {"type": "task_comment", "task_id": f"T{n}", "comment_id": f"c-{n}"})


def _watch(url: str, stop: threading.Event, seen: list[int]) -> None:
    """Read how many runs are claimed, as often as the server answers, until `stop`."""
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            (count,) = conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'claimed'").fetchone()  # type: ignore[misc]
            seen.append(int(count))


async def test_a_storm_of_claimers_on_three_runtimes_never_holds_more_than_the_ceiling(pg_url: str) -> None:
    async with AsyncExitStack() as stack:
        runtimes = [await stack.enter_async_context(open_runtime(pg_url)) for _ in range(RUNTIMES)]
        await _queue(runtimes[0], RUNS)
        await ok(runtimes[1], {"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": CEILING})
        held, most, finished = 0, 0, []
        seen: list[int] = []
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(pg_url, stop, seen))
        watcher.start()

        async def claimer(rt: Runtime, rng: random.Random) -> None:
            nonlocal held, most
            while True:
                reply = await ok(rt, {"type": "claim_run", "agent_profile_id": "w", "wait_seconds": 0.5})
                run = reply.result
                if run is None:
                    if len(finished) == RUNS:
                        return
                    continue
                held += 1
                most = max(most, held)
                await trio.sleep(rng.random() * 0.01)
                held -= 1  # before the finish is sent: never counted lower than the database holds
                await ok(rt, {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]})
                finished.append(run["id"])

        try:
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for index, rt in enumerate(runtimes):
                        for n in range(CLAIMERS):
                            nursery.start_soon(claimer, rt, random.Random(index * 100 + n))
        finally:
            stop.set()
            await trio.to_thread.run_sync(watcher.join)
    assert sorted(finished) == sorted(set(finished)) and len(finished) == RUNS
    assert most == CEILING  # the storm reached the ceiling
    assert max(seen) <= CEILING and len(seen) > 10


async def test_a_pause_through_one_runtime_holds_on_another(pg_url: str) -> None:
    async with open_runtime(pg_url) as first, open_runtime(pg_url) as second:
        await _queue(first, 2)
        await ok(first, {"type": "pause", "scope": "agent", "id": "w", "reason": "deploy"})
        refused = await ok(second, {"type": "claim_run", "agent_profile_id": "w"})
        assert refused.result is None and [e.reason for e in refused.events] == ["paused"]
        await ok(first, {"type": "resume", "scope": "agent", "id": "w"})
        assert (await ok(second, {"type": "claim_run", "agent_profile_id": "w"})).result is not None
