"""The queued- and claimed-run gauges (onceflow/observability/metrics.py `onceflow.runs.queued`,
`onceflow.runs.claimed`), read by the SDK's in-memory reader, on either backend."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing
from hand_clock import HandClock
from helpers import metric_points, ok, register
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from test_metrics import METERED

from onceflow.actors.runtime.startup import open_runtime


async def test_the_queued_and_claimed_run_gauges_count_open_runs_by_agent_profile(
    db_path: Path, hand_clock: HandClock, metric_reader: InMemoryMetricReader
) -> None:
    """Each collection reports the open runs the runtime last counted and has it count afresh; an agent
    profile whose runs are gone reads 0; a closed runtime is no longer observed."""

    def gauges() -> dict[tuple[str, str], float]:
        points = metric_points(metric_reader)
        return {
            (name.rsplit(".", 1)[1], dict(attributes)["agent_profile_id"]): value
            for (name, attributes), value in points.items()
            if name in ("onceflow.runs.queued", "onceflow.runs.claimed")
        }

    async def settled(expected: dict[tuple[str, str], float]) -> None:
        for _ in range(100):  # each collection asks for a reading, which is queued before our round trip
            if gauges() == expected:
                return
            await trio.testing.wait_all_tasks_blocked()
            await rt.services.store.transact(lambda conn: None)
        assert gauges() == expected

    beat = {"type": "heartbeat", "task_id": "T1", "step_id": "work"}
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await register(rt, METERED)
        for task, agent in (("T1", "worker"), ("T2", "other")):
            await ok(rt, {"type": "create_task", "task_id": task, "workflow_id": "metered",
                          "step_id": "work", "primary_agent_id": agent})  # fmt: skip
        await ok(rt, {**beat, "unix": 1})
        hand_clock.advance(10)  # past the coalescing window: a second run
        await ok(rt, {**beat, "unix": 2})
        await ok(rt, {**beat, "task_id": "T2", "unix": 3})
        await settled({("queued", "worker"): 2, ("queued", "other"): 1})
        claimed = await ok(rt, {"type": "claim_run", "agent_profile_id": "other"})
        await settled({("queued", "worker"): 2, ("queued", "other"): 0, ("claimed", "other"): 1})
        run = claimed.result
        await ok(rt, {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]})
        await settled({("queued", "worker"): 2, ("queued", "other"): 0, ("claimed", "other"): 0})
    assert gauges() == {}
