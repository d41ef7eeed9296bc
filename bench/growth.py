"""Growth under retention: T tasks through R rounds of Work -> Review -> Work, every run claimed and finished.

Run: python bench/growth.py [-t T] [-r R] [--hours-per-round H] [--retention-hours K] [-c C] [--db URL]
    [--windows W]

The workflow is bench/dispatch.py's: Review declares on_enter [clear_decisions,
queue_run_for_each_participant{role: reviewer}] and 3 reviewers are seated, so each entry into Review has
two markers and queues 3 runs. A round moves every task into Review (C concurrent movers), then a host loop
of C claimers claims and finishes every run (`claim_run`, `finish_run` with its token) until none is left,
moves every task back to Work, runs retention (`prune`, the runtime's own bounded batches) and advances the
runtime's clock by H hours (Trio's clock runs at the real rate and jumps H hours: the runtime's clock follows
it, actors/kernel/clock.py). With retention K hours (at least 24, the key window) the history of about K/H
rounds is kept. On PostgreSQL retention judges by the server's clock, which the bench does not move: there
nothing ages, so growth figures come from SQLite.

Per window of R/W rounds it prints: entries into Review per second (moves only, timed), claims+finishes
per second, the database's bytes (SQLite: its pages; PostgreSQL: `pg_database_size`), the bytes of the
rows and indexes a live entry is made of (step_entries, step_entry_markers, runs, coalesced_keys: SQLite's
dbstat, PostgreSQL's `pg_total_relation_size`) divided by the live entries. At the end it checks the
targets: the database's size over the last 20 % of rounds within +-10 %, the last window's entries/s at
least 0.9x the first's, at most 600 bytes per live entry. A missed target prints MISSED (exit 1 with
--strict).
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import trio
from trio.testing import MockClock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dispatch import REVIEW, REVIEWERS, setup

from onceflow.actors.runtime.retention import prune
from onceflow.actors.runtime.startup import SWITCH_INTERVAL, open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.backends.urls import is_postgres_url

HOUR = 3600.0
ENTRY_TABLES = ("step_entries", "step_entry_markers", "runs", "coalesced_keys")


async def _send(rt: Runtime, message: dict[str, Any]) -> Any:
    reply = await rt.send(message)
    if not reply.ok:
        raise RuntimeError(f"{message['type']} failed: {reply.error}")
    return reply.result


async def move_all(rt: Runtime, tasks: int, step: str, concurrency: int) -> None:
    async def mover(offset: int) -> None:
        for i in range(offset, tasks, concurrency):
            await _send(rt, {"type": "move_task", "task_id": f"T-{i}", "step_id": step})

    async with trio.open_nursery() as nursery:
        for offset in range(concurrency):
            nursery.start_soon(mover, offset)


async def drain(rt: Runtime, concurrency: int) -> int:
    """Claim and finish every run until none is left; returns how many."""
    done = [0]

    async def worker(agent: str) -> None:
        while (run := await _send(rt, {"type": "claim_run", "agent_profile_id": agent})) is not None:
            await _send(rt, {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]})
            done[0] += 1

    async with trio.open_nursery() as nursery:
        for n in range(concurrency):
            nursery.start_soon(worker, REVIEWERS[n % len(REVIEWERS)])
    return done[0]


def sizes(db: str) -> tuple[int, int, int]:
    """(database bytes, bytes of the entry tables and their indexes, live entries), read beside the
    runtime."""
    if is_postgres_url(db):
        import psycopg

        with psycopg.connect(db) as conn:
            total = conn.execute("SELECT pg_database_size(current_database())").fetchone()
            parts = conn.execute(
                "SELECT SUM(pg_total_relation_size(c)) FROM unnest(%s::regclass[]) AS c",
                (list(ENTRY_TABLES),),
            ).fetchone()
            live = conn.execute("SELECT COUNT(*) FROM step_entries").fetchone()
            assert total and parts and live
            return int(total[0]), int(parts[0]), int(live[0])
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        (freelist,) = conn.execute("PRAGMA freelist_count").fetchone()
        names = ",".join("?" * len(ENTRY_TABLES))
        (parts,) = conn.execute(
            "SELECT SUM(pgsize) FROM dbstat WHERE name IN"
            f" (SELECT name FROM sqlite_schema WHERE tbl_name IN ({names}))",
            ENTRY_TABLES,
        ).fetchone()
        (live,) = conn.execute("SELECT COUNT(*) FROM step_entries").fetchone()
        return (pages - freelist) * page_size, int(parts), int(live)
    finally:
        conn.close()


async def bench(args: argparse.Namespace, db: str, clock: MockClock) -> list[dict[str, float]]:
    rounds: list[dict[str, float]] = []
    async with open_runtime(
        db,
        retention=args.retention_hours * HOUR,
        retention_every=10**9,  # the bench prunes each round itself, in the runtime's bounded batches
        switch_interval=SWITCH_INTERVAL,
    ) as rt:
        await setup(rt, args.tasks, args.concurrency)
        for number in range(args.rounds):
            started = time.perf_counter()
            await move_all(rt, args.tasks, REVIEW, args.concurrency)
            moved = time.perf_counter()
            finished = await drain(rt, args.concurrency)
            drained = time.perf_counter()
            await move_all(rt, args.tasks, "work", args.concurrency)
            back = time.perf_counter()
            deleted = await prune(rt.services.store, rt.services.clock, args.retention_hours * HOUR)
            pruned = time.perf_counter()
            clock.jump(args.hours_per_round * HOUR)
            total, parts, live = await trio.to_thread.run_sync(sizes, db)
            rounds.append(
                {
                    "round": number + 1,
                    "entries_per_s": args.tasks / (moved - started),
                    "runs_per_s": finished / (drained - moved),
                    "back_s": back - drained,
                    "prune_s": pruned - back,
                    "deleted": sum(deleted.values()),
                    "db_bytes": total,
                    "entry_bytes": parts,
                    "live_entries": live,
                }
            )
            if finished != args.tasks * len(REVIEWERS):
                raise RuntimeError(
                    f"round {number + 1}: {finished} runs, expected {args.tasks * len(REVIEWERS)}"
                )
    return rounds


def breakdown(db: str) -> None:
    """Print each table's and index's pages and payload per live entry (dbstat), largest first."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (live,) = conn.execute("SELECT COUNT(*) FROM step_entries").fetchone()
        rows = conn.execute(
            "SELECT name, SUM(pgsize), SUM(payload) FROM dbstat GROUP BY name ORDER BY SUM(pgsize) DESC"
        ).fetchall()
    finally:
        conn.close()
    print(f"per live entry ({live} live), pages (payload):")
    for name, pages, payload in rows:
        if pages / max(1, live) >= 4:
            print(f"  {name:<36} {pages / max(1, live):>7.0f} ({payload / max(1, live):.0f})")


def report(rounds: list[dict[str, float]], windows: int) -> list[str]:
    size = max(1, len(rounds) // windows)
    heads = ("entries/s", "runs/s", "prune s", "db MiB", "B/entry", "live")
    print(f"{'rounds':>9} " + " ".join(f"{head:>{max(8, len(head))}}" for head in heads))
    chunks = [rounds[i : i + size] for i in range(0, len(rounds), size)]
    for chunk in chunks:
        last = chunk[-1]
        print(
            f"{int(chunk[0]['round']):>4}-{int(last['round']):<4} "
            f"{statistics.median(r['entries_per_s'] for r in chunk):>10.0f} "
            f"{statistics.median(r['runs_per_s'] for r in chunk):>8.0f} "
            f"{statistics.median(r['prune_s'] for r in chunk):>8.3f} "
            f"{last['db_bytes'] / 2**20:>8.2f} "
            f"{last['entry_bytes'] / max(1, last['live_entries']):>8.0f} "
            f"{int(last['live_entries']):>8}"
        )
    missed = []
    tail = rounds[int(len(rounds) * 0.8) :]
    low, high = min(r["db_bytes"] for r in tail), max(r["db_bytes"] for r in tail)
    mid = statistics.median(r["db_bytes"] for r in tail)
    spread = max(high - mid, mid - low) / mid
    print(f"size over the last 20 % of rounds: {low / 2**20:.2f}..{high / 2**20:.2f} MiB (+-{spread:.1%})")
    if spread > 0.10:
        missed.append(f"database size varies {spread:.1%} over the last 20 % of rounds (target +-10 %)")
    first = statistics.median(r["entries_per_s"] for r in chunks[0])
    last_rate = statistics.median(r["entries_per_s"] for r in chunks[-1])
    print(f"entries/s last window / first: {last_rate / first:.2f}x")
    if last_rate < 0.9 * first:
        missed.append(f"last window {last_rate / first:.2f}x the first's entries/s (target >= 0.9x)")
    per_entry = rounds[-1]["entry_bytes"] / max(1, rounds[-1]["live_entries"])
    if per_entry > 600:
        missed.append(f"{per_entry:.0f} bytes per live entry (target <= 600)")
    for line in missed:
        print(f"MISSED: {line}")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-t", "--tasks", type=int, default=500)
    parser.add_argument("-r", "--rounds", type=int, default=60)
    parser.add_argument("--hours-per-round", type=float, default=1.0)
    parser.add_argument("--retention-hours", type=float, default=24.0)
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--db", help="a postgresql:// URL (default: a SQLite file in a temp dir)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--dir", help="the parent of the temporary directory (SQLite)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="SQLite: bytes per live entry of each table and index (dbstat)",
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        db = args.db or str(Path(folder) / "growth.db")
        print(
            f"growth: {args.tasks} tasks x {args.rounds} rounds, {args.hours_per_round} h a round,"
            f" retention {args.retention_hours} h, {'PostgreSQL' if args.db else 'SQLite'}"
        )
        clock = MockClock(rate=1.0)  # real time, and the hours each round jumps
        rounds = trio.run(bench, args, db, clock, clock=clock)
        if args.breakdown and not args.db:
            breakdown(db)
    missed = report(rounds, args.windows)
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
