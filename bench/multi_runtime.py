"""Aggregate entries/s with 1, 2 and 4 runtime processes on one PostgreSQL, next to one SQLite runtime.

Run: python bench/multi_runtime.py [-n 4000] [-c 64] [--runtimes 1 2 4]

dispatch.py's workload (move_task work → review; review's on_enter clears decisions and fans out to 3 template
reviewers). A throw-away PostgreSQL is started from Debian's binaries (tests/pg_support.py) with fsync and
synchronous_commit on, the durable settings, on a unix-socket-free TCP port of 127.0.0.1. For R runtimes,
one database gets the workflow and the seats, then R processes each open a runtime on it and create N/R
tasks of their own (not timed); once all are ready they are released at once and each moves its tasks
from C concurrent Trio tasks (timed). Aggregate entries/s = N / (last finish - release). SQLite runs the
same workload in one process (dispatch.run_dispatch, `synchronous=FULL`, dup-rate 0) in the same
invocation. Afterwards each database is checked by SQL: runs = entries x 3, no idempotency key twice, every
entry terminal, one done clear_decisions marker per entry. A violated invariant prints VIOLATION, exit 1.
Each PostgreSQL line also gives the round trips (`round_trip_counter`) and statements (transaction control and
savepoints included) per entry of the move phase, exact.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import structlog
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dispatch import CLEARS_KEPT, REVIEW, REVIEWERS, WF, WORKFLOW, _send, run_dispatch
from pg_support import start_postgres

from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.backends import postgres
from onceflow.store.runs import keys as run_keys
from onceflow.store.writer import Durability


def round_trip_counter() -> Callable[[], int]:
    """A reader of this process's PostgreSQL round trips (waits for the server's answer): the store's own
    count (`PgConnection.total_round_trips`), or, on code from before it counted (a "before" run from a copy
    on PYTHONPATH), one per statement the unpipelined wrapper ran, each of which waited for its answer."""
    from onceflow.store.backends import postgres

    if hasattr(postgres.PgConnection, "total_round_trips"):
        return lambda: int(postgres.PgConnection.total_round_trips)
    calls = [0]
    for name in ("execute", "executemany"):
        original = getattr(postgres.PgConnection, name)

        def counted(self: Any, *args: Any, _original: Any = original) -> Any:
            calls[0] += 1
            return _original(self, *args)

        setattr(postgres.PgConnection, name, counted)
    return lambda: calls[0]


def _statements() -> int:
    """Statements this process sent to PostgreSQL (`PgConnection.total_statements`; 0 on code from before it
    counted)."""
    return int(getattr(postgres.PgConnection, "total_statements", 0))


async def _child(url: str, prefix: str, n: int, concurrency: int) -> None:
    """One runtime: create `n` tasks, print `ready`, wait for a line on stdin, move them, print figures."""
    round_trips = round_trip_counter()
    async with open_runtime(url) as rt:

        async def create(offset: int) -> None:
            for i in range(offset, n, concurrency):
                await _send(rt, {"type": "create_task", "task_id": f"{prefix}-{i}", "workflow_id": WF})

        async with trio.open_nursery() as nursery:
            for offset in range(concurrency):
                nursery.start_soon(create, offset)
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        before = round_trips()
        statements = _statements()

        async def mover(offset: int) -> None:
            for i in range(offset, n, concurrency):
                await _send(rt, {"type": "move_task", "task_id": f"{prefix}-{i}", "step_id": REVIEW})

        async with trio.open_nursery() as nursery:
            for offset in range(concurrency):
                nursery.start_soon(mover, offset)
        figures = {"finished": time.time(), "round_trips": round_trips() - before,
                   "statements": _statements() - statements}  # fmt: skip
        print(json.dumps(figures), flush=True)


async def _seed(url: str) -> None:
    async with open_runtime(url) as rt:
        await _send(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "bench.yml"})
        for agent in REVIEWERS:
            await _send(
                rt,
                {"type": "add_participant", "workflow_id": WF, "step_id": REVIEW, "role": "reviewer",
                 "agent_profile_id": agent},
            )  # fmt: skip


def check_postgres(url: str, n: int) -> list[str]:
    """The invariants, by SQL on the PostgreSQL database."""
    with psycopg.connect(url) as conn:

        def one(sql: str) -> int:
            row = conn.execute(sql).fetchone()
            assert row is not None
            return int(row[0])

        runs = one("SELECT count(*) FROM runs")
        keys = one(f"SELECT count(DISTINCT {run_keys.STORED_KEY_SQL}) FROM runs")
        entries = one("SELECT count(*) FROM step_entries")
        open_entries = one("SELECT count(*) FROM step_entries WHERE terminal = 0")
        clears = one(
            "SELECT (SELECT count(*) FROM step_entry_markers"
            " WHERE kind = 'clear_decisions' AND state = 'done')"
            f" + (SELECT COALESCE(SUM({CLEARS_KEPT.format(e='')}), 0) FROM step_entries)"
        )
    violations = []
    if entries != n:
        violations.append(f"{entries} entries for {n} tasks")
    if runs != 3 * n or keys != runs:
        violations.append(f"{runs} runs with {keys} distinct keys for {n} entries")
    if open_entries:
        violations.append(f"{open_entries} entries left open")
    if clears != n:
        violations.append(f"{clears} done clears for {n} entries")
    return violations


def run_postgres(server: Any, runtimes: int, n: int, concurrency: int) -> dict[str, Any]:
    url = server.create_database(f"bench{runtimes}")
    trio.run(_seed, url)
    share = n // runtimes
    children = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                url,
                "--prefix",
                f"R{r}",
                "-n",
                str(share),
                "-c",
                str(concurrency),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(runtimes)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    released = time.time()
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    finished = []
    round_trips = statements = 0
    for child in children:
        assert child.stdout is not None
        figures = json.loads(child.stdout.readline())
        finished.append(figures["finished"])
        round_trips += figures["round_trips"]
        statements += figures["statements"]
        child.wait()
    elapsed = max(finished) - released
    return {"runtimes": runtimes, "n": share * runtimes, "seconds": elapsed,
            "entries_per_s": share * runtimes / elapsed, "round_trips": round_trips, "statements": statements,
            "violations": check_postgres(url, share * runtimes)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", type=int, default=4000)
    parser.add_argument("-c", type=int, default=64)
    parser.add_argument("--runtimes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    if args.child:
        trio.run(_child, args.child, args.prefix, args.n, args.c)
        return 0
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        sqlite = trio.run(
            run_dispatch, Path(folder) / "bench.db", args.n, args.c, 0.0, Durability.FULL, 64, 1
        )
    print(f"sqlite   1 runtime : {sqlite['entries_per_s']:8,.0f} entries/s  ({args.n} entries)")
    failed |= bool(sqlite["violations"])
    server = start_postgres(durable=True)
    try:
        for runtimes in args.runtimes:
            result = run_postgres(server, runtimes, args.n, args.c)
            print(
                f"postgres {runtimes} runtime{'s' if runtimes > 1 else ' '}: {result['entries_per_s']:8,.0f}"
                f" entries/s  ({result['n']} entries, {result['seconds']:.2f} s,"
                f" {result['round_trips'] / result['n']:.2f} round trips and"
                f" {result['statements'] / result['n']:.2f} statements per entry)"
            )
            for violation in result["violations"]:
                print(f"VIOLATION: {violation}")
            failed |= bool(result["violations"])
    finally:
        server.stop()
    for violation in sqlite["violations"]:
        print(f"VIOLATION (sqlite): {violation}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
