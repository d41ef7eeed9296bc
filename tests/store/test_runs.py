"""The runs queue: 24 h idempotency window, 5 s coalescing and its discrete exclusion field, claims."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.protocol.runs import RunPolicy
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.records import RunRecord
from onceflow.store.runs import run_claims, runs
from onceflow.store.runs.runs import RunRequest
from onceflow.store.writer import StoreActor, open_store

T0 = 1_800_000_000.0


async def _enqueue(store: StoreActor, request: RunRequest, now: float) -> runs.EnqueueResult:
    return await store.transact(lambda conn: runs.enqueue_run(conn, request, now))


POLICY = RunPolicy()


def _claim(conn: Connection, now: float) -> RunRecord | None:
    return run_claims.claim(conn, "agent", now, POLICY.lease, POLICY).run


def _finish(conn: Connection, run: RunRecord, now: float) -> run_claims.Finished:
    return run_claims.finish(
        conn, run.id, run.claim_token, "finished", error=None, retryable=True, retry_at=None, now=now,
        policy=POLICY, draw=0.0,
    )  # fmt: skip


async def _resolve(store: StoreActor, run_id: int, now: float) -> None:
    """Claim (at `now`) and finish (at `now`) the only queued run of "agent", which must be `run_id`."""
    claimed = await store.transact(_claim, now)
    assert claimed is not None and claimed.id == run_id
    assert (await store.transact(_finish, claimed, now)).run.status == "finished"


@pytest.mark.parametrize("excluded", [False, True], ids=["coalescing", "excluded"])
async def test_ac_h6_a_key_is_honoured_for_24_hours_after_its_run_resolves(
    tmp_path: Path, excluded: bool
) -> None:
    async with open_store(tmp_path / "db") as store:
        request = RunRequest(
            "agent", None, None, "review", idempotency_key="k1", exclude_from_coalescing=excluded
        )
        first = await _enqueue(store, request, T0)
        await _resolve(store, first.run_id, T0 + 3600)
        again = await _enqueue(store, request, T0 + 3600 + 24 * 3600 - 1)
        assert (first.outcome, again.outcome, again.run_id) == ("queued", "suppressed", first.run_id)
        later = await _enqueue(store, request, T0 + 3600 + 24 * 3600)
        assert later.outcome == "queued" and later.run_id != first.run_id
        rows = await store.transact(lambda conn: runs.list_runs(conn))
        assert [r.idempotency_key for r in rows] == [None, "k1"]  # the expired key moved to the new run


@pytest.mark.parametrize("resolution", ["queued", "claimed"])
async def test_ac_h6_key_honoured_while_run_unresolved(tmp_path: Path, resolution: str) -> None:
    """Comment c-1's run stays queued (or claimed) for 25 h: a redelivery of c-1 still queues nothing."""
    async with open_store(tmp_path / "db") as store:
        request = RunRequest("agent", None, None, "task_comment", idempotency_key="c-1")
        first = await _enqueue(store, request, T0)
        if resolution == "claimed":
            assert await store.transact(_claim, T0 + 1) is not None
        again = await _enqueue(store, request, T0 + 25 * 3600)
        assert (again.outcome, again.run_id) == ("suppressed", first.run_id)
        assert len(await store.transact(lambda conn: runs.list_runs(conn))) == 1


@given(
    status=st.sampled_from(["queued", "claimed", "finished", "failed"]),
    seen_ago=st.floats(0, 3 * 24 * 3600),
    resolved_after=st.floats(0, 3 * 24 * 3600),
)
def test_ac_h6_key_honoured_never_less_than_24_hours_after_it_was_seen(
    status: str, seen_ago: float, resolved_after: float
) -> None:
    """The stricter reading: an unresolved run's key is always honoured; a resolved run's key lapses exactly
    24 h after the run resolved, so never sooner than 24 h after the key was seen."""
    now = T0
    seen_at = now - seen_ago
    resolved = status in ("finished", "failed")
    finished_at = min(seen_at + resolved_after, now) if resolved else None
    honoured = runs.key_honoured(status=status, seen_at=seen_at, finished_at=finished_at, now=now)
    if finished_at is None:
        assert honoured
    else:
        assert honoured == (now - finished_at < runs.IDEMPOTENCY_WINDOW_SECONDS)
    if seen_ago < runs.IDEMPOTENCY_WINDOW_SECONDS:
        assert honoured


async def _refuse(store: StoreActor, when: str) -> None:
    """Make every later `when` (e.g. "INSERT ON runs") fail as a full disk would."""
    await store.transact(
        lambda conn: conn.execute(
            f"CREATE TRIGGER refuse BEFORE {when} BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
    )


def _enqueue_and_survive(request: RunRequest, now: float) -> Callable[[sqlite3.Connection], str]:
    def enqueue(conn: sqlite3.Connection) -> str:
        try:
            runs.enqueue_run(conn, request, now)
        except Exception as exc:
            if not faults.is_constraint_violation(exc):
                raise
            return str(exc)
        return "enqueued"

    return enqueue


async def test_a_failing_rekey_leaves_the_old_run_its_key(tmp_path: Path) -> None:
    """The expired-key path writes twice (release the old key, insert); a failure undoes both."""
    async with open_store(tmp_path / "db") as store:
        request = RunRequest(
            "agent", None, None, "review", idempotency_key="k1", exclude_from_coalescing=True
        )
        first = await _enqueue(store, request, T0)
        await _resolve(store, first.run_id, T0)
        await _refuse(store, "INSERT ON runs")
        assert await store.transact(_enqueue_and_survive(request, T0 + 24 * 3600)) == "disk full"
        rows = await store.transact(lambda conn: runs.list_runs(conn))
        assert [(r.id, r.idempotency_key) for r in rows] == [(first.run_id, "k1")]


async def test_a_failing_coalesced_key_undoes_the_merge(tmp_path: Path) -> None:
    """A keyed merge writes twice (count + 1, its key); a failure recording the key undoes the merge."""
    async with open_store(tmp_path / "db") as store:
        first = await _enqueue(store, RunRequest("agent", None, None, "r", {"n": 1}), T0)
        await _refuse(store, "INSERT ON coalesced_keys")
        merge = RunRequest("agent", None, None, "r", {"n": 2}, idempotency_key="k2")
        assert await store.transact(_enqueue_and_survive(merge, T0 + 1)) == "disk full"
        [row] = await store.transact(lambda conn: runs.list_runs(conn))
        assert (row.id, row.coalesced_count, row.payload) == (first.run_id, 0, {"n": 1})


async def test_coalescing_never_crosses_tasks(tmp_path: Path) -> None:
    """Two tasks sharing an agent, same reason within 5 s: each task keeps its own run."""
    async with open_store(tmp_path / "db") as store:
        await _tasks(store, "T1", "T2")
        a = await _enqueue(store, RunRequest("ceo", "T1", "work", "agent_error"), T0)
        b = await _enqueue(store, RunRequest("ceo", "T2", "work", "agent_error"), T0 + 1)
        a2 = await _enqueue(store, RunRequest("ceo", "T1", "work", "agent_error"), T0 + 2)
        assert (a.outcome, b.outcome) == ("queued", "queued") and b.run_id != a.run_id
        assert (a2.outcome, a2.run_id) == ("coalesced", a.run_id)  # within one task it still merges
        rows = await store.transact(lambda conn: runs.list_runs(conn))
        assert [(r.task_id, r.coalesced_count) for r in rows] == [("T1", 1), ("T2", 0)]


async def test_a_coalesced_enqueue_records_its_own_key(tmp_path: Path) -> None:
    """k2 merges into k1's run; k2 redelivered after the 5 s window is a no-op, not a second run."""
    async with open_store(tmp_path / "db") as store:
        first = await _enqueue(store, RunRequest("agent", None, None, "r", idempotency_key="k1"), T0)
        merged = await _enqueue(store, RunRequest("agent", None, None, "r", idempotency_key="k2"), T0 + 1)
        assert (merged.outcome, merged.run_id) == ("coalesced", first.run_id)
        again = await _enqueue(store, RunRequest("agent", None, None, "r", idempotency_key="k2"), T0 + 60)
        assert (again.outcome, again.run_id) == ("suppressed", first.run_id)
        assert len(await store.transact(lambda conn: runs.list_runs(conn))) == 1
        assert await _merged_key_holder(store, "k2") == first.run_id


async def _merged_key_holder(store: StoreActor, key: str) -> int | None:
    row = await store.transact(
        lambda conn: conn.execute(
            "SELECT run_id FROM coalesced_keys WHERE idempotency_key = ?", (key,)
        ).fetchone()
    )
    return None if row is None else int(row[0])


async def _tasks(store: StoreActor, *task_ids: str) -> None:
    def insert(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at) VALUES ('w', 'w', '', '', 0)"
        )
        for task_id in task_ids:
            conn.execute(
                "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
                " VALUES (?, 'w', 'work', 0, 0)",
                (task_id,),
            )

    await store.transact(insert)


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
        first = await store.transact(_claim, T0 + 30)
        second = await store.transact(_claim, T0 + 31)
        none = await store.transact(_claim, T0 + 32)
        assert first is not None and second is not None and none is None
        assert (first.reason, second.reason, first.status) == ("a", "b", "claimed")
        assert (await store.transact(_finish, first, T0 + 40)).replay is False
        assert (await store.transact(_finish, first, T0 + 41)).replay is True
