"""The runs queue: 24 h idempotency window, 5 s coalescing and its discrete exclusion field, claims."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from onceflow.store import runs
from onceflow.store.runs import RunRequest
from onceflow.store.writer import StoreActor, open_store

T0 = 1_800_000_000.0


async def _enqueue(store: StoreActor, request: RunRequest, now: float) -> runs.EnqueueResult:
    return await store.transact(lambda conn: runs.enqueue_run(conn, request, now))


@pytest.mark.parametrize("excluded", [False, True], ids=["coalescing", "excluded-insert-first"])
async def test_a_key_seen_within_24_hours_is_a_successful_no_op(tmp_path: Path, excluded: bool) -> None:
    async with open_store(tmp_path / "db") as store:
        request = RunRequest(
            "agent", None, None, "review", idempotency_key="k1", exclude_from_coalescing=excluded
        )
        first = await _enqueue(store, request, T0)
        again = await _enqueue(store, request, T0 + 24 * 3600 - 1)
        assert (first.outcome, again.outcome, again.run_id) == ("queued", "suppressed", first.run_id)
        later = await _enqueue(store, request, T0 + 24 * 3600)
        assert later.outcome == "queued" and later.run_id != first.run_id
        rows = await store.transact(lambda conn: runs.list_runs(conn))
        assert [r.idempotency_key for r in rows] == [None, "k1"]  # the expired key moved to the new run


async def test_a_failing_rekey_leaves_the_old_run_its_key(tmp_path: Path) -> None:
    """The expired-key path writes twice (release the old key, insert); a failure undoes both."""
    async with open_store(tmp_path / "db") as store:
        request = RunRequest(
            "agent", None, None, "review", idempotency_key="k1", exclude_from_coalescing=True
        )
        await _enqueue(store, request, T0)
        await store.transact(
            lambda conn: conn.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON runs BEGIN SELECT RAISE(ABORT, 'disk full'); END"
            )
        )

        def enqueue_and_survive(conn: sqlite3.Connection) -> str:
            try:
                runs.enqueue_run(conn, request, T0 + 24 * 3600)
            except sqlite3.IntegrityError as exc:
                return str(exc)
            return "enqueued"

        assert await store.transact(enqueue_and_survive) == "disk full"
        rows = await store.transact(lambda conn: runs.list_runs(conn))
        assert [r.idempotency_key for r in rows] == ["k1"]


async def test_same_agent_and_reason_coalesce_within_5_seconds_only(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db") as store:
        first = await _enqueue(store, RunRequest("agent", None, None, "comment", {"n": 1}), T0)
        merged = await _enqueue(store, RunRequest("agent", None, None, "comment", {"n": 2}), T0 + 5)
        assert (merged.outcome, merged.run_id, merged.coalesced_count) == ("coalesced", first.run_id, 1)
        fresh = await _enqueue(store, RunRequest("agent", None, None, "comment"), T0 + 10.5)
        assert fresh.outcome == "queued"
        rows = await store.transact(lambda conn: runs.list_runs(conn))
        assert rows[0].payload == {"n": 2} and rows[1].payload is None


async def test_the_exclusion_field_opts_out_of_coalescing_on_both_sides(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db") as store:
        excluded = RunRequest("agent", None, None, "review", exclude_from_coalescing=True)
        plain = RunRequest("agent", None, None, "review")
        outcomes = [
            (await _enqueue(store, excluded, T0)).outcome,
            (await _enqueue(store, plain, T0 + 1)).outcome,  # may not merge into an excluded run
            (await _enqueue(store, excluded, T0 + 2)).outcome,  # an excluded request never merges
        ]
        assert outcomes == ["queued", "queued", "queued"]
        assert not runs.should_coalesce(excluded) and runs.should_coalesce(plain)


async def test_claim_takes_the_oldest_queued_run_once(tmp_path: Path) -> None:
    async with open_store(tmp_path / "db") as store:
        for i, reason in enumerate(("a", "b")):
            await _enqueue(store, RunRequest("agent", None, None, reason), T0 + i * 10)
        first = await store.transact(lambda conn: runs.claim_run(conn, "agent", T0 + 30))
        second = await store.transact(lambda conn: runs.claim_run(conn, "agent", T0 + 31))
        none = await store.transact(lambda conn: runs.claim_run(conn, "agent", T0 + 32))
        assert first is not None and second is not None and none is None
        assert (first.reason, second.reason, first.status) == ("a", "b", "claimed")
        assert await store.transact(lambda conn: runs.finish_run(conn, first.id, "finished", T0 + 40))
        assert not await store.transact(lambda conn: runs.finish_run(conn, first.id, "finished", T0 + 41))
