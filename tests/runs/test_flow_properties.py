"""Flow control over random interleavings of enqueues, claims (one agent, several, any), finishes, pauses and
ceiling changes, on the store itself (store/runs/run_claims.py, store/runs/flow.py), on both backends: an
agent's live claims never exceed its ceiling, no run is lost or handed to two live claimers, a claim finds
nothing exactly when nothing is eligible, and priority order holds (no aging here: the clock stands still)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_support import freeze_server_clock

from onceflow.protocol.runs import RunPolicy
from onceflow.store.backends import pg_schema, postgres, schema
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import dialect_of
from onceflow.store.backends.urls import is_postgres_url
from onceflow.store.runs import flow, run_claims, runs
from onceflow.store.runs.runs import RunRequest

T0 = 1_800_000_000.0
AGENTS = ("a", "b", "c")
POLICY = RunPolicy()


@pytest.fixture
def conn(db_path: Path | str) -> Iterator[Connection]:
    if isinstance(db_path, str) and is_postgres_url(db_path):
        freeze_server_clock(db_path, T0)
        pg = postgres.connect(db_path)
        pg_schema.migrate(pg)
        yield pg
        pg.close()
        return
    raw = sqlite3.connect(db_path, isolation_level=None)
    raw.execute("PRAGMA foreign_keys=ON")
    schema.migrate(raw)
    yield raw
    raw.close()


def tx(conn: Connection, fn: Any, *args: Any) -> Any:
    conn.execute(dialect_of(conn).begin)
    try:
        result = fn(conn, *args)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


agent = st.sampled_from(AGENTS)
op = st.one_of(
    st.tuples(st.just("enqueue"), agent, st.integers(0, 3)),
    st.tuples(st.just("enqueue"), agent, st.integers(0, 3)),
    st.tuples(st.just("claim"), agent),
    st.tuples(st.just("ceiling"), agent, st.integers(1, 2)),
    st.tuples(
        st.just("claim"), st.one_of(agent, st.lists(agent, min_size=2, max_size=3, unique=True), st.none())
    ),
    st.tuples(st.just("finish"), st.integers(0, 10)),
    st.tuples(st.just("pause"), st.one_of(agent, st.just("*"))),
    st.tuples(st.just("resume"), st.one_of(agent, st.just("*"))),
    st.tuples(st.just("ceiling"), agent, st.one_of(st.none(), st.integers(1, 3))),
    st.tuples(st.just("global"), st.one_of(st.none(), st.integers(1, 4))),
)


def _state(conn: Connection) -> tuple[dict[str, int], int | None, set[str], bool, list[tuple[int, str, int]]]:
    """Ceilings, the global one, paused agents, all paused, and the queued runs (id, agent, priority)."""
    limits = flow.list_limits(conn)
    ceilings = {x.target_id: x.max_concurrent for x in limits if x.scope == "agent" and x.max_concurrent}
    cap = next((x.max_concurrent for x in limits if x.scope == "global"), None)
    pauses = flow.list_pauses(conn)
    paused = {p.target_id for p in pauses if p.scope == "agent"}
    queued = [(r.id, r.agent_profile_id, r.priority) for r in runs.list_runs(conn, status="queued")]
    return ceilings, cap, paused, any(p.scope == "all" for p in pauses), queued  # type: ignore[return-value]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=10, max_size=60))
def test_ceilings_fencing_and_priority_hold_over_any_interleaving(conn: Connection, ops: list[Any]) -> None:
    for table in ("runs", "run_limits", "run_pauses", "run_turns"):
        tx(conn, lambda c, t=table: c.execute(f"DELETE FROM {t}"))
    enqueued = 0
    live: dict[int, str] = {}  # run id -> the token of its live claim
    for step in ops:
        kind = step[0]
        if kind == "enqueue":
            request = RunRequest(
                step[1], None, None, f"r{enqueued}", exclude_from_coalescing=True, priority=step[2]
            )
            assert tx(conn, runs.enqueue_run, request, T0).outcome == "queued"
            enqueued += 1
        elif kind == "claim":
            target = step[1]
            ceilings, cap, paused, everything, queued = tx(conn, lambda c: _state(c))
            counts = {a: 0 for a in AGENTS}
            for run_id in live:
                run = tx(conn, runs.get_run, run_id)
                counts[run.agent_profile_id] += 1
            wanted = AGENTS if target is None else [target] if isinstance(target, str) else target
            open_agents = {a for a in wanted if counts[a] < ceilings.get(a, 10**9)}
            full_global = cap is not None and len(live) >= cap
            eligible = [
                (prio, run_id, a)
                for run_id, a, prio in queued
                if a in open_agents and a not in paused and not everything and not full_global
            ]
            claimed = tx(conn, run_claims.claim, target, T0, 300.0, POLICY)
            if not eligible:
                assert claimed.run is None, (step, eligible)
                continue
            run = claimed.run
            assert run is not None, (step, eligible)
            assert run.id not in live  # never handed to two live claimers
            best = min(prio for prio, _, _ in eligible)
            assert run.priority == best
            oldest_of_agent = min(i for p, i, a in eligible if p == best and a == run.agent_profile_id)
            if isinstance(target, str):
                assert run.id == min(i for p, i, _ in eligible if p == best)
            else:
                assert run.id == oldest_of_agent
            live[run.id] = run.claim_token or ""
            assert counts[run.agent_profile_id] + 1 <= ceilings.get(run.agent_profile_id, 10**9)
            assert cap is None or len(live) <= cap
        elif kind == "finish" and live:
            run_id = sorted(live)[step[1] % len(live)]
            done = tx(
                conn,
                lambda c, r=run_id: run_claims.finish(
                    c, r, live[r], "finished", error=None, retryable=True, retry_at=None, now=T0,
                    policy=POLICY, draw=0.0,
                ),
            )  # fmt: skip
            assert done.run.status == "finished"
            del live[run_id]
        elif kind in ("pause", "resume"):
            scope, target_id = ("all", "") if step[1] == "*" else ("agent", step[1])
            if kind == "pause":
                tx(conn, flow.pause, scope, target_id, "test", T0)
            else:
                tx(conn, flow.resume, scope, target_id)
        elif kind == "ceiling":
            tx(conn, flow.set_limits, "agent", step[1], {"max_concurrent": step[2]}, T0)
        elif kind == "global":
            tx(conn, flow.set_limits, "global", "", {"max_concurrent": step[1]}, T0)
    every = tx(conn, lambda c: runs.list_runs(c))
    assert len(every) == enqueued  # none lost
    assert {r.id for r in every if r.status == "claimed"} == set(live)
    assert all(r.status in ("queued", "claimed", "finished") for r in every)
