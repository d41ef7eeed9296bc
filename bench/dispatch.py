"""Dispatch throughput: N tasks entering a review step that clears decisions and fans out to 3 reviewers.

Run: python bench/dispatch.py [-n N] [-c C] [--dup-rate R] [--replay-rate P] [--durability FULL|NORMAL]
    [--max-batch B] [--count-statements] [--switch-interval S]

The inline workflow has steps work → review; review declares on_enter
[clear_decisions, queue_run_for_each_participant{role: reviewer}] and the template seats 3 reviewers.
N tasks are created in work (not timed), then C concurrent Trio tasks move each into review with
`move_task` (timed: one latency sample per entry, around its first send). Peak RSS is read at the end of
the move phase, before the `list_runs` check loads every run. With probability R a move is sent again at
once (a redelivery: a move to the current step is a no-op). With probability P the committed entry is
then dispatched again through the engine, as a second dispatcher or a recovery would (a replayed entry:
its markers are terminal, so it must not clear or fan out twice). Transactions and average batch size are
counted by wrapping the store actor's commit method. CPU per entry is given for the whole process and for
the store writer thread alone (its CPU clock read at the start and end of the move phase: SQLite's C work
plus the Python of every request, i.e. the writer's share of the GIL-bound run). The runtime runs with the GIL
switch interval `onceflow serve` uses (`--switch-interval`, seconds; 0: Python's own 0.005 s).

After the runtime closes the database is checked with plain SQL: no idempotency key twice, runs ==
entries x 3, one committed clear per entry (its clear_decisions marker done), every entry terminal, one
entry per task. A violated invariant prints VIOLATION and exits 1; the figures are then not valid.
"""

from __future__ import annotations

import argparse
import random
import resource
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import trio

from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.startup import SWITCH_INTERVAL, open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.runs import keys
from onceflow.store.writer import Durability

WORKFLOW = """\
id: bench
name: Bench
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: clear_decisions
        - type: queue_run_for_each_participant
          config: {role: reviewer}
"""
WF, REVIEW = "bench", "review"
REVIEWERS = ("rev-1", "rev-2", "rev-3")


async def _send(rt: Runtime, message: dict[str, Any]) -> Any:
    reply = await rt.send(message)
    if not reply.ok:
        raise RuntimeError(f"{message['type']} failed: {reply.error}")
    return reply.result


async def _count_runs(rt: Runtime) -> int:
    """How many runs `list_runs` lists, page by page."""
    listed, after = 0, None
    while True:
        page = await _send(rt, {"type": "list_runs", "after_run_id": after, "limit": 1000})
        listed += len(page["runs"])
        if (after := page["next_after_run_id"]) is None:
            return listed


async def setup(rt: Runtime, n: int, concurrency: int) -> None:
    await _send(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "bench.yml"})
    for agent in REVIEWERS:
        await _send(
            rt,
            {
                "type": "add_participant",
                "workflow_id": WF,
                "step_id": REVIEW,
                "role": "reviewer",
                "agent_profile_id": agent,
            },
        )

    async def create(offset: int) -> None:
        for i in range(offset, n, concurrency):
            await _send(rt, {"type": "create_task", "task_id": f"T-{i}", "workflow_id": WF})

    async with trio.open_nursery() as nursery:
        for offset in range(concurrency):
            nursery.start_soon(create, offset)


CLEARS_KEPT = "COALESCE(LENGTH({e}done_markers) - LENGTH(REPLACE({e}done_markers, 'c', '')), 0)"
"""SQL: the done clear markers an entry keeps on its row (`done_markers`: code `c`,
store/entries/step_entries.py `DONE_CODES`); the rest are `step_entry_markers` rows."""


def check(db: Path, n: int) -> tuple[dict[str, int], list[str]]:
    """The invariants over the closed database, by plain SQL."""
    conn = sqlite3.connect(db)
    try:
        return invariants(lambda sql: int(conn.execute(sql).fetchone()[0]), n)
    finally:
        conn.close()


def invariants(one: Callable[[str], int], n: int) -> tuple[dict[str, int], list[str]]:
    """The figures and violated invariants of a database holding n review entries, `one` answering a
    single-value query (portable SQL: SQLite or PostgreSQL)."""
    figures = {
        "entries": one("SELECT COUNT(*) FROM step_entries WHERE step_id = 'review'"),
        "open_entries": one("SELECT COUNT(*) FROM step_entries WHERE terminal = 0"),
        "runs": one("SELECT COUNT(*) FROM runs"),
        "dup_keys": one(
            # a key is its text or its parts (store/runs/keys.py): each grouped in its own unique index's
            # order (no sort, no key rebuilt), so the check costs what it did per run
            "SELECT (SELECT COUNT(*) FROM (SELECT 1 FROM runs WHERE idempotency_key IS NOT NULL"
            " GROUP BY idempotency_key HAVING COUNT(*) > 1) AS t) + (SELECT COUNT(*) FROM (SELECT 1 FROM runs"
            f" WHERE key_position IS NOT NULL GROUP BY {keys.ENTRY_KEY_COLUMNS} HAVING COUNT(*) > 1) AS p)"
        ),
        "null_keys": one("SELECT COUNT(*) FROM runs WHERE idempotency_key IS NULL AND key_position IS NULL"),
        "clears_done": one(
            "SELECT (SELECT COUNT(*) FROM step_entry_markers"
            " WHERE kind = 'clear_decisions' AND state = 'done')"
            f" + (SELECT COALESCE(SUM({CLEARS_KEPT.format(e='')}), 0) FROM step_entries)"
        ),
        "entries_without_one_clear": one(
            "SELECT COUNT(*) FROM step_entries e WHERE (SELECT COUNT(*) FROM step_entry_markers m"
            " WHERE m.task_id = e.task_id AND m.step_id = e.step_id AND m.entry_seq = e.entry_seq"
            f" AND m.kind = 'clear_decisions' AND m.state = 'done') + {CLEARS_KEPT.format(e='e.')} != 1"
        ),
        "tasks_in_review": one("SELECT COUNT(*) FROM tasks WHERE workflow_step_id = 'review'"),
    }
    violations = []
    if figures["entries"] != n:
        violations.append(f"{figures['entries']} review entries, expected one per task ({n})")
    if figures["open_entries"]:
        violations.append(f"{figures['open_entries']} entries not terminal")
    if figures["dup_keys"] or figures["null_keys"]:
        violations.append(f"duplicate runs: {figures['dup_keys']} keys twice, {figures['null_keys']} unkeyed")
    if figures["runs"] != figures["entries"] * len(REVIEWERS):
        violations.append(f"{figures['runs']} runs, expected {figures['entries']} x {len(REVIEWERS)}")
    if figures["entries_without_one_clear"] or figures["clears_done"] != figures["entries"]:
        violations.append(f"{figures['entries_without_one_clear']} entries without exactly one clear")
    if figures["tasks_in_review"] != n:
        violations.append(f"{figures['tasks_in_review']} tasks in review, expected {n}")
    return figures, violations


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def replay(rt: Runtime, task_id: str) -> int:
    """Dispatch the task's committed review entry again, as a second dispatcher (or a recovery) would: its
    markers are all terminal, so nothing may run twice. Returns how many actions it ran (must be 0)."""
    entries = (await _send(rt, {"type": "list_step_entries", "task_id": task_id, "limit": 1000}))["entries"]
    key = EntryKey(task_id, REVIEW, max(e["entry_seq"] for e in entries if e["step_id"] == REVIEW))
    task = await rt.engine.load_task(task_id)
    workflow = rt.services.workflows.get(WF)
    out = Outbox(EventHub())
    await rt.engine.dispatch_entry(task, workflow, workflow.step(REVIEW), key, "recovery", out)
    return sum(event.type == "action_outcome" for event in out.events)


async def run_dispatch(
    db: Path,
    n: int,
    concurrency: int,
    dup_rate: float,
    durability: Durability,
    max_batch: int,
    seed: int,
    replay_rate: float = 0.0,
    count_statements: bool = False,
    switch_interval: float | None = SWITCH_INTERVAL,
) -> dict[str, Any]:
    """Run the benchmark on a fresh `db`; return figures (incl. 'violations'). The core of the bench.

    `count_statements` counts every SQL statement of the move phase through SQLite's trace callback (a
    Python call per statement: it slows the run, so its wall-clock figures are not comparable)."""
    rng = random.Random(seed)
    latencies: list[float] = []
    counts = {"transactions": 0, "requests": 0, "dup_sends": 0, "replays": 0, "replayed_actions": 0}
    statements = {"data": 0, "savepoint": 0, "transaction": 0}
    async with open_runtime(
        db, durability=durability, max_batch=max_batch, switch_interval=switch_interval
    ) as rt:
        await setup(rt, n, concurrency)
        store = rt.services.store
        commit = store._commit

        def counting_commit(conn: sqlite3.Connection, batch: list[Any]) -> None:
            counts["transactions"] += 1  # only the writer thread touches these
            counts["requests"] += len(batch)
            if not count_statements:
                commit(conn, batch)
                return
            conn.set_trace_callback(lambda sql: count_statement(statements, sql))
            try:
                commit(conn, batch)
            finally:
                conn.set_trace_callback(None)

        store._commit = counting_commit  # type: ignore[method-assign]
        dups = [rng.random() < dup_rate for _ in range(n)]
        replays = [rng.random() < replay_rate for _ in range(n)]

        async def mover(offset: int) -> None:
            for i in range(offset, n, concurrency):
                move = {"type": "move_task", "task_id": f"T-{i}", "step_id": REVIEW}
                began = time.perf_counter()
                await _send(rt, move)
                latencies.append(time.perf_counter() - began)
                if dups[i]:
                    counts["dup_sends"] += 1
                    await _send(rt, move)
                if replays[i]:
                    counts["replays"] += 1
                    counts["replayed_actions"] += await replay(rt, f"T-{i}")

        writer_clock = time.pthread_getcpuclockid(store._thread.ident or 0)
        began, cpu_began = time.perf_counter(), time.process_time()
        writer_began = time.clock_gettime(writer_clock)
        async with trio.open_nursery() as nursery:
            for offset in range(concurrency):
                nursery.start_soon(mover, offset)
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu_began
        writer_cpu = time.clock_gettime(writer_clock) - writer_began
        store._commit = commit  # type: ignore[method-assign]
        move_phase_rss = peak_rss_mb()  # before list_runs below pages through every run
        listed = await _count_runs(rt)
    figures, violations = check(db, n)
    if counts["replayed_actions"]:
        violations.append(f"replayed entries ran {counts['replayed_actions']} actions again")
    if listed != figures["runs"]:
        violations.append(f"list_runs returned {listed}, the table holds {figures['runs']}")
    latencies.sort()
    return {
        "n": n,
        "concurrency": concurrency,
        "durability": durability.value,
        "seconds": elapsed,
        "cpu_us_per_entry": cpu / n * 1e6,
        "writer_cpu_us_per_entry": writer_cpu / n * 1e6,
        "entries_per_s": n / elapsed,
        "runs_per_s": figures["runs"] / elapsed,
        "p50_ms": _percentile(latencies, 0.50) * 1000,
        "p99_ms": _percentile(latencies, 0.99) * 1000,
        "transactions": counts["transactions"],
        "avg_batch": counts["requests"] / max(1, counts["transactions"]),
        "dup_sends": counts["dup_sends"],
        "replays": counts["replays"],
        "peak_rss_mb": move_phase_rss,
        "statements": statements,
        **figures,
        "violations": violations,
    }


_LAST = [""]
"""The text `count_statement` saw last."""


def count_statement(statements: dict[str, int], sql: str) -> None:
    """Count one statement SQLite ran (its trace callback): data, SAVEPOINT/RELEASE/ROLLBACK TO, or
    BEGIN/COMMIT/ROLLBACK. A trigger's run is traced again with the text of the statement that fired it (once
    per row: `runs`' minute trigger, store/backends/schema.py migration 23): part of that statement, so a runs
    insert the same as the one before is not counted again (each row of any other `executemany` is). Unlike
    wall-clock figures these repeat exactly on a shared machine."""
    if sql == _LAST[0] and sql.lstrip()[:16].upper() == "INSERT INTO RUNS":
        return
    _LAST[0] = sql
    head = sql.lstrip()[:11].upper()
    if head.startswith(("SAVEPOINT", "RELEASE", "ROLLBACK TO")):
        statements["savepoint"] += 1
    elif head.startswith(("BEGIN", "COMMIT", "ROLLBACK")):
        statements["transaction"] += 1
    else:
        statements["data"] += 1


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def print_figures(result: dict[str, Any]) -> None:
    print(
        f"{'N':>7}{'C':>5}{'dur':>7}{'entries/s':>11}{'runs/s':>9}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'txns':>7}{'avg batch':>10}{'dups':>6}{'replays':>8}{'RSS MB':>8}"
    )
    print(
        f"{result['n']:>7}{result['concurrency']:>5}{result['durability']:>7}{result['entries_per_s']:>11,.0f}"
        f"{result['runs_per_s']:>9,.0f}{result['p50_ms']:>8.2f}{result['p99_ms']:>8.2f}"
        f"{result['transactions']:>7}{result['avg_batch']:>10.1f}{result['dup_sends']:>6}{result['replays']:>8}{result['peak_rss_mb']:>8.0f}"
    )
    print(
        f"invariants: entries={result['entries']} runs={result['runs']} clears_done={result['clears_done']}"
        f" open={result['open_entries']} dup_keys={result['dup_keys']}"
        f" -> {'OK' if not result['violations'] else 'FAILED'}"
    )
    for violation in result["violations"]:
        print(f"VIOLATION: {violation}")
    if any(result["statements"].values()):
        per = {kind: count / result["n"] for kind, count in result["statements"].items()}
        print(
            f"SQL statements per entry: {per['data']:.2f} data, {per['savepoint']:.2f} savepoint,"
            f" {per['transaction']:.2f} begin/commit (timed figures above are slowed by the counting)"
        )
    print("(transactions/avg batch count every commit of the move phase: moves, redeliveries, replays)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", "--tasks", type=int, default=10000)
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("--dup-rate", type=float, default=0.1, help="fraction of moves redelivered")
    parser.add_argument("--replay-rate", type=float, default=0.0, help="fraction of entries dispatched again")
    parser.add_argument("--durability", choices=[d.value for d in Durability], default="FULL")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count-statements", action="store_true", help="SQL statements per entry (slower)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary database directory")
    parser.add_argument("--switch-interval", type=float, default=SWITCH_INTERVAL, help="seconds; 0: Python's")
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    with tempfile.TemporaryDirectory(prefix="onceflow-dispatch-", dir=args.dir) as tmp:
        result = trio.run(
            run_dispatch,
            Path(tmp) / "dispatch.db",
            args.tasks,
            args.concurrency,
            args.dup_rate,
            Durability(args.durability),
            args.max_batch,
            args.seed,
            args.replay_rate,
            args.count_statements,
            args.switch_interval or None,
        )
    print(
        f"sqlite {sqlite3.sqlite_version}; GIL switch interval {args.switch_interval or 'default'} s;"
        f" move phase {result['seconds']:.2f} s,"
        f" CPU {result['cpu_us_per_entry']:.0f} us per entry (both threads),"
        f" {result['writer_cpu_us_per_entry']:.0f} us of it in the store writer thread"
    )
    print_figures(result)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
