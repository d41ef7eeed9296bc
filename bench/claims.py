"""Claim throughput with flow control: 100 agents, with and without ceilings.

Run: python bench/claims.py [-a 100] [-r 20] [--rounds 3] [--ceiling 4] [--db postgresql://…]

Each setup opens a fresh runtime (a SQLite file, or the given PostgreSQL database emptied first), queues
`-r` runs for each of `-a` agents (direct enqueues, one transaction per 100), then one Trio task per agent
claims its agent's runs (`claim_run`) and finishes each (fenced `finish_run`) until none is left. Setups,
interleaved round by round: `none` (no limits), `ceilings` (every agent `max_concurrent` = `--ceiling`, and a
global ceiling of agents x ceiling: both checked in every claim's transaction, never reached) and
`paused-other` (the ceilings, plus a pause of an agent nobody claims for: the pause filter has a row to
test). Prints claims+finishes per second per setup and round, then the medians and `ceilings / none` (target
at least 0.8x).

Checks (exit 1 on a violation): every run finished exactly once, none left queued or claimed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.backends.connection import Connection
from onceflow.store.runs import runs
from onceflow.store.runs.runs import RunRequest

SETUPS = ("none", "ceilings", "paused-other")


def _enqueue_all(conn: Connection, agents: list[str], per_agent: int, start: int, now: float) -> None:
    for n in range(start, min(start + 100, len(agents) * per_agent)):
        agent = agents[n % len(agents)]
        runs.enqueue_run(conn, RunRequest(agent, None, None, f"r{n}", exclude_from_coalescing=True), now)


async def _setup(rt: Runtime, setup: str, agents: list[str], ceiling: int) -> None:
    if setup == "none":
        return
    for agent in agents:
        await rt.send({"type": "set_limits", "scope": "agent", "id": agent, "max_concurrent": ceiling})
    await rt.send({"type": "set_limits", "scope": "global", "max_concurrent": ceiling * len(agents)})
    if setup == "paused-other":
        await rt.send({"type": "pause", "scope": "agent", "id": "nobody", "reason": "bench"})


async def _claim_all(rt: Runtime, agent: str, done: list[int]) -> None:
    while True:
        reply = await rt.send({"type": "claim_run", "agent_profile_id": agent})
        if not reply.ok:
            raise SystemExit(f"claim refused: {reply.error}")
        run = reply.result
        if run is None:
            return
        finished = await rt.send(
            {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]}
        )
        if not finished.ok:
            raise SystemExit(f"finish refused: {finished.error}")
        done.append(run["id"])


async def one(db: str, setup: str, n_agents: int, per_agent: int, ceiling: int) -> float:
    """Runs claimed and finished per second for one setup on database `db`."""
    agents = [f"agent-{i:03d}" for i in range(n_agents)]
    async with open_runtime(db) as rt:
        store = rt.services.store
        for start in range(0, n_agents * per_agent, 100):
            await store.transact(_enqueue_all, agents, per_agent, start, rt.services.now())
        await _setup(rt, setup, agents, ceiling)
        done: list[int] = []
        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for agent in agents:
                nursery.start_soon(_claim_all, rt, agent, done)
        took = time.perf_counter() - began
        left = await store.transact(
            lambda conn: conn.execute("SELECT COUNT(*) FROM runs WHERE status != 'finished'").fetchone()[0]
        )
    if len(done) != n_agents * per_agent or len(set(done)) != len(done) or left:
        raise SystemExit(f"{setup}: {len(done)} finished ({len(set(done))} distinct), {left} left unfinished")
    return len(done) / took


def _fresh(db: str | None, folder: Path, name: str) -> str:
    if db is None:
        return str(folder / f"{name}.db")
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:
        for table in ("runs", "run_limits", "run_pauses", "run_turns", "coalesced_keys"):
            with contextlib.suppress(psycopg.errors.UndefinedTable):
                conn.execute(f"DELETE FROM {table}")
    return db


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-a", "--agents", type=int, default=100)
    parser.add_argument("-r", "--runs", type=int, default=20, help="runs per agent")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ceiling", type=int, default=4)
    parser.add_argument("--db", help="a PostgreSQL URL (emptied before each setup); default: SQLite files")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    figures: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for setup in SETUPS if round_ % 2 == 0 else reversed(SETUPS):
                db = _fresh(args.db, Path(tmp), f"{setup}-{round_}")
                rate = trio.run(one, db, setup, args.agents, args.runs, args.ceiling)
                figures[setup].append(rate)
                print(f"round {round_ + 1} {setup:>12}: {rate:8.0f} runs/s", flush=True)
    medians = {setup: statistics.median(values) for setup, values in figures.items()}
    for setup, value in medians.items():
        print(f"median {setup:>12}: {value:8.0f} runs/s")
    ratio = medians["ceilings"] / medians["none"]
    print(f"ceilings / none: {ratio:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
