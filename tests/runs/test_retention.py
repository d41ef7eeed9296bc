"""Retention: resolved history goes once older than the retention, in bounded batches; what recovery, the
next `entry_seq` and the 24 h key window need stays. Real databases; the key-window property is checked
over generated times on the store's own functions."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hand_clock import HandClock
from helpers import (
    ONE_STEP_COMMENT_QUEUES_RUN,
    FakeClock,
    decide,
    list_entries,
    list_runs,
    metric_points,
    move,
    ok,
    to_review,
    turn_complete,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.actors.runtime.retention import prune
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.runs import KEY_WINDOW, RunPolicy
from onceflow.store.backends import schema
from onceflow.store.retention import retention
from onceflow.store.runs import run_claims, runs
from onceflow.store.runs.runs import RunRequest

DAY = 24 * 3600.0
WEEK = 7 * DAY


@pytest.fixture
def clock(hand_clock: HandClock) -> Callable[[], float]:
    """The wall clock the `runtime` and `office` fixtures open with: the hand-moved clock's
    (tests/hand_clock.py), so `hand_clock.advance` ages what they stamp, on both backends."""
    return hand_clock.wall


async def _prune(rt: Runtime, seconds: float = WEEK) -> dict[str, int]:
    return await prune(rt.services.store, rt.services.clock, seconds)


async def _finish_all(rt: Runtime, agent: str) -> int:
    done = 0
    while (run := (await ok(rt, {"type": "claim_run", "agent_profile_id": agent})).result) is not None:
        await ok(rt, {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]})
        done += 1
    return done


async def test_resolved_runs_go_after_the_retention_unresolved_ones_never(
    office: Runtime, hand_clock: HandClock
) -> None:
    await to_review(office, "T1")
    assert await _finish_all(office, "rev-a") == 1
    hand_clock.advance(WEEK - 1)
    assert (await _prune(office))["runs"] == 0
    hand_clock.advance(2)
    assert (await _prune(office))["runs"] == 1
    left = await list_runs(office, task_id="T1")
    assert [(r["agent_profile_id"], r["status"]) for r in left] == [
        ("rev-b", "queued")
    ]  # 7 days queued: kept


async def test_old_entries_go_but_the_latest_of_each_step_and_every_open_one_stay(
    office: Runtime, hand_clock: HandClock
) -> None:
    await to_review(office, "T1")
    for _ in range(3):  # three more rounds Review -> Work -> Review
        await decide(office, "T1", "review", "rev-a", "rejected")
        await turn_complete(office, "T1")
    before = [(e["step_id"], e["entry_seq"]) for e in await list_entries(office, "T1")]
    assert sorted(before) == [("review", n) for n in (1, 2, 3, 4)]
    hand_clock.advance(WEEK + 1)
    deleted = await _prune(office)
    assert deleted["step_entries"] == 3
    assert [(e["step_id"], e["entry_seq"]) for e in await list_entries(office, "T1")] == [("review", 4)]
    await decide(office, "T1", "review", "rev-a", "rejected")
    await turn_complete(office, "T1")
    assert [e["entry_seq"] for e in await list_entries(office, "T1")] == [4, 5]  # numbering goes on
    assert deleted["decisions"] == 0  # each rejection was cleared on re-entry: nothing superseded


async def test_superseded_decisions_go_the_latest_of_each_seat_stays(
    office: Runtime, hand_clock: HandClock
) -> None:
    await to_review(office, "T1")
    for verdict in ("approved", "changes_requested", "approved"):
        await decide(office, "T1", "review", "rev-a", verdict, decision_id=f"d-{verdict}-{hand_clock.now}")
        hand_clock.advance(1)
    hand_clock.advance(WEEK)
    deleted = await _prune(office)
    assert (deleted["decisions"], deleted["decision_receipts"]) == (2, 3)
    rows = (await ok(office, {"type": "list_decisions", "task_id": "T1", "step_id": "review"})).result[
        "decisions"
    ]
    assert [row["decision"] for row in rows] == ["approved"]


async def test_a_batch_never_deletes_more_than_its_limit(db_path: Path | str, hand_clock: HandClock) -> None:
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await _queue_and_finish(rt, 25)
        hand_clock.advance(WEEK + 1)
        pruned = await rt.services.store.transact(retention.prune_batch, hand_clock.now, WEEK, 10)
        assert (pruned.deleted["runs"], pruned.full) == (10, True)
        rest = await prune(rt.services.store, rt.services.clock, WEEK, batch=10)
        assert rest["runs"] == 15


async def test_the_runtime_prunes_at_start_and_after_every_so_many_history_events(
    db_path: Path | str, metric_reader: Any, hand_clock: HandClock
) -> None:
    async with open_runtime(db_path, clock=hand_clock.wall, retention=DAY, retention_every=4) as rt:
        await _queue_and_finish(rt, 3)  # 3 finished runs: not yet due
        hand_clock.advance(DAY + 1)
        await trio.testing.wait_all_tasks_blocked()
        assert len(await list_runs(rt)) == 3
        before = metric_points(metric_reader).get(("onceflow.retention.deleted", (("kind", "runs"),)), 0)
        await _queue_and_finish(rt, 1, first=3)  # the 4th history event: a pass deletes the 3 old runs
        assert await _settled(rt, lambda rows: [r["task_id"] for r in rows] == ["T3"])
        await trio.testing.wait_all_tasks_blocked()  # the pass counts what it deleted once its batch returns
        after = metric_points(metric_reader)[("onceflow.retention.deleted", (("kind", "runs"),))]
        assert after - before == 3
    hand_clock.advance(DAY + 1)
    async with open_runtime(db_path, clock=hand_clock.wall, retention=DAY) as rt:  # the pass at start-up
        assert await _settled(rt, lambda rows: rows == [])


async def _settled(rt: Runtime, done: Any) -> bool:
    """Whether the runs come to satisfy `done` while the background pass runs (a bounded wait: the pass is
    a few store requests, each behind the ones queued before it)."""
    for _ in range(50):
        await trio.testing.wait_all_tasks_blocked()
        if done(await list_runs(rt)):
            return True
    return False


@pytest.mark.parametrize("seconds", [0, 3600, DAY - 1, float("inf"), float("nan")])
def test_a_retention_below_the_key_window_is_refused_naming_retention(
    db_path: Path | str, seconds: float
) -> None:
    async def main() -> None:
        async with open_runtime(db_path, retention=seconds):
            pass

    with pytest.raises(ValueError, match="retention"):
        trio.run(main)


async def _queue_and_finish(rt: Runtime, count: int, first: int = 0) -> None:
    if "m" not in rt.services.workflows.workflows:
        await ok(rt, {"type": "register_workflow", "yaml": MINIMAL, "source": "m.yml"})
    for n in range(first, first + count):
        await ok(rt, {"type": "create_task", "task_id": f"T{n}", "workflow_id": "m", "primary_agent_id": "w"})
        await ok(rt, {"type": "task_comment", "task_id": f"T{n}", "comment_id": f"c-{n}"})
    assert await _finish_all(rt, "w") == count


MINIMAL = ONE_STEP_COMMENT_QUEUES_RUN


def test_onceflow_prune_deletes_on_demand_and_prints_the_counts(tmp_path: Path) -> None:
    db = tmp_path / "board.db"
    clock = FakeClock()

    async def fill() -> None:
        async with open_runtime(db, clock=clock) as rt:
            await _queue_and_finish(rt, 4)

    trio.run(fill)  # FakeClock starts in 2023: every run is long past a week
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "prune", "--db", str(db)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"] == 4
    refused = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "prune", "--db", str(db), "--older-than", "60"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (refused.returncode, refused.stderr.count("\n")) == (2, 1)
    assert "retention" in refused.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "prune", "--db", str(tmp_path / "none.db")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2 and not (tmp_path / "none.db").exists()


# --- the key window, over generated times -----------------------------------------------------------------

POLICY = RunPolicy()


@settings(max_examples=200, deadline=None)
@given(
    keep=st.floats(min_value=KEY_WINDOW, max_value=30 * DAY),
    resolved_after=st.floats(min_value=0, max_value=2 * DAY),
    pruned_after=st.floats(min_value=0, max_value=40 * DAY),
    redelivered_after=st.floats(min_value=0, max_value=3 * DAY),
    coalesced=st.booleans(),
)
def test_a_redelivery_inside_the_key_window_is_a_noop_after_any_prune(
    keep: float, resolved_after: float, pruned_after: float, redelivered_after: float, coalesced: bool
) -> None:
    """A key is honoured while its run is unresolved and 24 h after it resolves; pruning with any retention
    (>= 24 h) at any time never makes a redelivery inside that window queue a second run."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.execute("PRAGMA foreign_keys=ON")
    schema.migrate(conn)
    now = 1_700_000_000.0
    first = RunRequest(agent_profile_id="w", task_id=None, step_id=None, reason="r", idempotency_key="k-1")
    second = RunRequest(agent_profile_id="w", task_id=None, step_id=None, reason="r", idempotency_key="k-2")
    keys = ["k-1"]
    runs.enqueue_run(conn, first, now)
    if coalesced:  # a second key merged into the same queued run
        assert runs.enqueue_run(conn, second, now + 1).outcome == "coalesced"
        keys.append("k-2")
    claimed = run_claims.claim(conn, "w", now + 2, 300, POLICY).run
    assert claimed is not None
    resolved_at = now + 2 + resolved_after
    run_claims.finish(
        conn, claimed.id, claimed.claim_token, "finished", error=None, retryable=True, retry_at=None,
        now=resolved_at, policy=POLICY, draw=0.0,
    )  # fmt: skip
    pruned_at = resolved_at + pruned_after
    while retention.prune_batch(conn, pruned_at, keep, 100).full:
        pass
    redelivered_at = pruned_at + redelivered_after
    for key in keys:
        redelivery = RunRequest(
            agent_profile_id="w", task_id=None, step_id=None, reason="r", idempotency_key=key
        )
        again = runs.enqueue_run(conn, redelivery, redelivered_at)
        inside = redelivered_at - resolved_at < KEY_WINDOW
        assert (again.outcome == "suppressed") is inside, (key, again, redelivered_at - resolved_at)


def _columns(rows: list[dict[str, Any]], *names: str) -> list[tuple[Any, ...]]:
    return [tuple(row[name] for name in names) for row in rows]


async def test_an_approval_round_trip_leaves_nothing_unpruned_behind(
    office: Runtime, hand_clock: HandClock
) -> None:
    """Everything a resolved cycle leaves is retention's to delete once old: what stays is each task's
    latest entry per step and its current state."""
    await to_review(office, "T1")
    await move(office, "T1", "work")
    await turn_complete(office, "T1")
    for agent in ("rev-a", "rev-b"):
        await _finish_all(office, agent)
    hand_clock.advance(WEEK + 1)
    deleted = await _prune(office)
    assert deleted["runs"] == 4  # two entries' fan-outs: the first pair cancelled on leaving, then finished
    assert _columns(await list_runs(office, task_id="T1"), "status") == []
