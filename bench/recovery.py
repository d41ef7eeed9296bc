"""Recovery time: K unfinished step entries left as a killed runtime leaves them; time to "recovery done".

Run: python bench/recovery.py [-k K] [--durability FULL|NORMAL] [--count-statements] [--db sqlite|postgres]

A first runtime registers bench/dispatch.py's workflow (review declares [clear_decisions,
queue_run_for_each_participant{role: reviewer}], 3 template reviewers) and closes. Then, through the store
actor alone (no runtime, as after a SIGKILL between the admitting commit and dispatch), K tasks are written
at review with one open step entry each (terminal=0, the declaration's real digest, no markers) and one
stale review decision each. The timed part is `open_runtime` from its call until it yields: the recovery
scan runs to completion before it yields. Printed: its wall seconds and the process's CPU seconds (both
threads) over the same span, and the 1-minute load average. The database is then checked by SQL: every
entry terminal, one committed clear per entry, 3 runs per entry, no key twice, no decision left. Exits 1 on
a violation.

`--db postgres` runs the same on a throw-away PostgreSQL (tests/pg_support.py, fsync and synchronous_commit
on), where the start-up scan is `recover_at_start`; it also prints the round trips of the timed span
(`PgConnection.total_round_trips`) and the statements it sent, exact counts. The CPU seconds are the
client's only (the server's are not counted).
"""

from __future__ import annotations

import argparse
import os
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dispatch import REVIEW, REVIEWERS, WF, WORKFLOW, _send, check, count_statement, invariants
from pg_support import start_postgres

from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.entries.step_entries import declaration_digest
from onceflow.store.runs import digests
from onceflow.store.writer import Durability, StoreActor, open_store

DIGEST = declaration_digest(["clear_decisions", "queue_run_for_each_participant"])


Database = Path | str
"""A SQLite file, or a PostgreSQL URL."""


async def prepare(db: Database, k: int) -> None:
    async with open_runtime(db) as rt:
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

    def write(conn: Any) -> None:
        now = time.time()
        ids = [f"T-{i}" for i in range(k)]
        conn.executemany(
            "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?)",
            ((t, WF, REVIEW, now, now) for t in ids),
        )
        digests.keep(conn, [DIGEST])  # an entry holds its digest's id (store/runs/digests.py)
        conn.executemany(
            "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest,"
            " entry_path, terminal, created_at)"
            f" VALUES (?, ?, 1, ?, {digests.id_sql('?')}, 'manual_move', 0, ?)",
            ((t, REVIEW, WF, DIGEST, now) for t in ids),
        )
        conn.executemany(
            "INSERT INTO decisions (task_id, step_id, role, decider_type, decider_id, decision, created_at)"
            " VALUES (?, ?, 'reviewer', 'agent', 'rev-1', 'approved', ?)",
            ((t, REVIEW, now) for t in ids),
        )

    async with open_store(db) as store:
        await store.transact(write)


async def recover(
    db: Database, durability: Durability, statements: dict[str, int] | None = None
) -> tuple[float, float, int]:
    """Seconds from `open_runtime` until it yields, the CPU seconds the process (both threads) spent
    meanwhile (on a shared machine the CPU time varies less than the wall time), and on PostgreSQL the round
    trips meanwhile (else 0). `statements`: count the SQL statements run meanwhile by kind (on SQLite its
    trace callback: slower, the time is then not comparable; on PostgreSQL every statement sent)."""
    undo = _count_statements(isinstance(db, str), statements) if statements is not None else None
    trips = _round_trips() if isinstance(db, str) else lambda: 0
    try:
        began, cpu, before = time.perf_counter(), time.process_time(), trips()
        async with open_runtime(db, durability=durability):
            # the recovery scan has finished before the yield
            elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
            round_trips = trips() - before
    finally:
        if undo is not None:
            undo()
    return elapsed, cpu, round_trips


def _round_trips() -> Callable[[], int]:
    from onceflow.store.backends.postgres import PgConnection

    return lambda: PgConnection.total_round_trips


def _count_statements(postgres: bool, statements: dict[str, int]) -> Callable[[], None]:
    """Count every statement the store runs into `statements` (`count_statement`); returns the undo."""
    if postgres:
        from onceflow.store.backends.postgres import PgConnection

        execute, executemany = PgConnection.execute, PgConnection.executemany

        def counted(self: PgConnection, sql: str, params: Any = ()) -> Any:
            count_statement(statements, sql)
            return execute(self, sql, params)

        def counted_many(self: PgConnection, sql: str, seq: Any) -> Any:
            rows = list(seq)
            for _ in rows:
                count_statement(statements, sql)
            return executemany(self, sql, rows)

        PgConnection.execute = counted  # type: ignore[method-assign]
        PgConnection.executemany = counted_many  # type: ignore[method-assign]

        def undo_pg() -> None:
            PgConnection.execute = execute  # type: ignore[method-assign]
            PgConnection.executemany = executemany  # type: ignore[method-assign]

        return undo_pg
    commit = StoreActor._commit

    def counting_commit(self: StoreActor, conn: Any, batch: list[Any]) -> None:
        conn.set_trace_callback(lambda sql: count_statement(statements, sql))
        try:
            commit(self, conn, batch)
        finally:
            conn.set_trace_callback(None)

    StoreActor._commit = counting_commit  # type: ignore[method-assign]

    def undo() -> None:
        StoreActor._commit = commit  # type: ignore[method-assign]

    return undo


def _check_postgres(url: str, k: int) -> tuple[dict[str, int], list[str], int, int]:
    """`invariants` on the PostgreSQL database, the entries open and the decisions left."""
    import psycopg

    with psycopg.connect(url) as conn:

        def one(sql: str) -> int:
            row = conn.execute(sql).fetchone()
            assert row is not None
            return int(row[0])

        figures, violations = invariants(one, k)
        return figures, violations, figures["open_entries"], one("SELECT COUNT(*) FROM decisions")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-k", "--entries", type=int, default=10000)
    parser.add_argument("--durability", choices=[d.value for d in Durability], default="FULL")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary database directory")
    parser.add_argument("--count-statements", action="store_true", help="SQL statements per entry (slower)")
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args()
    statements = {"data": 0, "savepoint": 0, "transaction": 0} if args.count_statements else None
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    if args.db == "postgres":
        server = start_postgres(durable=True)
        try:
            url = server.create_database("recovery")
            trio.run(prepare, url, args.entries)
            left_open = _check_postgres(url, args.entries)[2]
            seconds, cpu, round_trips = trio.run(recover, url, Durability(args.durability), statements)
            figures, violations, _, stale = _check_postgres(url, args.entries)
        finally:
            server.stop()
    else:
        with tempfile.TemporaryDirectory(prefix="onceflow-recovery-", dir=args.dir) as tmp:
            db = Path(tmp) / "recovery.db"
            trio.run(prepare, db, args.entries)
            conn = sqlite3.connect(db)
            left_open = conn.execute("SELECT COUNT(*) FROM step_entries WHERE terminal = 0").fetchone()[0]
            conn.close()
            seconds, cpu, round_trips = trio.run(recover, db, Durability(args.durability), statements)
            figures, violations = check(db, args.entries)
            conn = sqlite3.connect(db)
            stale = conn.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]
            conn.close()
    if left_open != args.entries:
        violations.append(f"{left_open} entries open before recovery, expected {args.entries}")
    if stale:
        violations.append(f"{stale} decisions survived their entry's clear")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.db == "postgres":
        print(f"postgres (throw-away, fsync on), durability {args.durability}")
    else:
        print(f"sqlite {sqlite3.sqlite_version}, durability {args.durability}")
    print(
        f"{'open entries':>13}{'recovery s':>12}{'CPU s':>8}{'entries/s':>11}{'runs':>8}{'RSS MB':>8}"
        f"  invariants  (load average {os.getloadavg()[0]:.2f})"
    )
    print(
        f"{left_open:>13}{seconds:>12.3f}{cpu:>8.3f}{left_open / seconds:>11,.0f}{figures['runs']:>8}"
        f"{rss:>8.0f}  {'OK' if not violations else 'FAILED'}"
    )
    if args.db == "postgres":
        print(f"round trips: {round_trips}, per entry {round_trips / left_open:.4f}")
    if statements is not None:
        per = {kind: count / left_open for kind, count in statements.items()}
        print(
            f"SQL statements: {statements['data']} data, {statements['savepoint']} savepoint,"
            f" {statements['transaction']} begin/commit; per entry {per['data']:.4f}, {per['savepoint']:.4f},"
            f" {per['transaction']:.4f} (the time above is slowed by the counting)"
        )
    for violation in violations:
        print(f"VIOLATION: {violation}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
