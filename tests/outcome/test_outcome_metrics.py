"""`onceflow.outcomes` counts outcomes entering each delivery phase (AC-CO-3's phases)."""

from __future__ import annotations

from pathlib import Path

from helpers import FakeClock, metric_delta, metric_points, ok
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from outcome_support import ack, diagnostic, envelope, ready

from onceflow.actors.runtime.startup import open_runtime
from onceflow.testing import RecordingCoordinator


async def test_outcome_metrics_count_each_phase_entered_once(
    db_path: Path, clock: FakeClock, metric_reader: InMemoryMetricReader
) -> None:
    before = metric_points(metric_reader)
    async with open_runtime(db_path, clock=clock, coordinator=RecordingCoordinator()) as rt:
        events = rt.subscribe()
        env = envelope()
        await ready(rt, env)
        await ready(rt, env)  # a duplicate signal enters no phase
        await diagnostic(events, "outcome_delivered")
        await ok(rt, ack(env, "coord-1"))
        await diagnostic(events, "outcome_acknowledged")
    moved = metric_delta(before, metric_points(metric_reader))
    phases = {
        dict(attributes)["phase"]: n for (name, attributes), n in moved.items() if name == "onceflow.outcomes"
    }
    assert phases == {"pending": 1, "needs-coordinator-ack": 1, "acknowledged": 1}
