"""Metrics through OpenTelemetry's API, read here by the SDK's in-memory reader."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from helpers import FakeClock, metric_delta, metric_points, ok, register
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from onceflow.actors.runtime.startup import open_runtime

METERED = """
id: metered
name: Metered
steps:
  - {id: backlog, name: Backlog, position: 0, allow_manual_move: true}
  - id: work
    name: Work
    position: 1
    is_start_step: true
    allow_manual_move: true
    events:
      on_heartbeat:
        - {type: queue_run, config: {target: primary, reason: heartbeat}}
      on_turn_complete:
        - {type: move_to_step, config: {step_id: review}}
  - id: review
    name: Review
    position: 2
    events:
      on_enter:
        - {type: clear_decisions}
"""


async def test_metrics_count_entries_runs_commits_and_recovered_entries(
    db_path: Path, clock: FakeClock, metric_reader: InMemoryMetricReader
) -> None:
    before = metric_points(metric_reader)
    beat = {"type": "heartbeat", "task_id": "T1", "step_id": "work", "unix": 1}
    async with open_runtime(db_path, clock=clock) as rt:
        await register(rt, METERED)
        await ok(rt, {"type": "create_task", "task_id": "T1", "workflow_id": "metered",
                      "step_id": "backlog", "primary_agent_id": "worker"})  # fmt: skip
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})  # E2
        await ok(rt, beat)  # queued
        await ok(rt, {**beat, "unix": 2})  # coalesced: same agent and reason within 5 s
        await ok(rt, {"type": "turn_complete", "task_id": "T1"})  # E1 into review
    with sqlite3.connect(db_path) as conn:  # as if a crash had left review's entry open
        conn.execute("UPDATE step_entries SET terminal = 0 WHERE step_id = 'review'")
    async with open_runtime(db_path, clock=clock) as rt:  # the scan finds it
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})  # E2
        await ok(rt, beat)  # redelivered after the restart: the run's key is suppressed

    moved = metric_delta(before, metric_points(metric_reader))
    work, review = (
        (("step_id", "work"), ("workflow_id", "metered")),
        (("step_id", "review"), ("workflow_id", "metered")),
    )
    assert moved[("onceflow.step_entries", (("entry_path", "E2"), *work))] == 2
    assert moved[("onceflow.step_entries", (("entry_path", "E1"), *review))] == 1
    for result in ("queued", "coalesced", "suppressed"):
        assert moved[("onceflow.runs", (("result", result),))] == 1
    assert moved[("onceflow.recovery.open_entries", review)] == 1
    commits = moved[("onceflow.store.commit.duration", ())]
    assert commits >= 7  # at least one per command that wrote
    assert 0 < moved[("onceflow.store.commit.duration.sum", ())] < commits  # seconds, not milliseconds
    assert moved[("onceflow.store.commit.batch_size", ())] == commits
    assert moved[("onceflow.store.commit.batch_size.sum", ())] >= commits
