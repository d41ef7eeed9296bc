"""Peer benchmark: dispatch.py's workload on DBOS Transact (SQLite system database), next to onceflow's.

Run: python bench/peer_dbos.py [-n N] [--dbos-n N] [-c C] [--dup-rate R] [--wal] [--seed S] [--dir DIR]
Needs the optional `dbos` package (`pip install dbos`); without it this prints how to install it and exits 0.

The workload is dispatch.py's: N tasks each enter review once, and each entry clears the task's decisions
then queues 3 runs (rev-1, rev-2, rev-3) with idempotency keys; with probability R an entry is redelivered
at once, and a redelivery must not fan out twice. On DBOS every entry is one `@DBOS.workflow()` whose
workflow id is the entry identity (`entry-T-{i}-review-1`), made of two datasource transactions on a
SQLite application database (decisions and runs, onceflow's column shapes and indexes): clear, then
fan-out (3 inserts). A datasource transaction commits the step's checkpoint in the same SQLite
transaction as its writes, which is DBOS 3.4's way to make a database step exactly-once (there is no
`DBOS.transaction` with an application_database_url any more). A redelivery calls the workflow again with
the same id: DBOS must return the recorded result without running the steps. Every task is seeded with
one stale decision (not timed), so the clear deletes something.

Concurrency: C worker threads (a ThreadPoolExecutor), each calling the workflow function directly (it runs
in the calling thread, the synchronous DBOS API) for entries offset, offset + C, ... — the same shape as
dispatch.py's C Trio movers, one latency sample per entry around its first call and the redelivery sent
right after it. Only this entry phase is timed (DBOS launch, schema and seeding are not).

SQLite settings are DBOS's own unless `--wal`: DBOS sets busy_timeout=30000, foreign_keys=ON and IMMEDIATE
transactions on every connection and leaves journal_mode (rollback journal, DELETE) and synchronous (the
build default, FULL) alone; the script reads and prints what the connections really use. `--wal` puts both
database files in WAL mode before DBOS opens them (WAL is persistent in the file), closer to onceflow's
WAL + synchronous=FULL store.

In the same process (onceflow first, then DBOS) it runs bench/dispatch.py's `run_dispatch` at -n, -c, the
same dup rate, FULL durability and max_batch 64, and prints both rates and the ratio onceflow / DBOS
(entries/s over entries/s; `--dbos-n` lets DBOS do fewer entries when it is slow, which is printed).
After each run the invariants are checked by plain SQL: a violation prints VIOLATION and exits 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
import sqlite3
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import trio

REVIEWERS = ("rev-1", "rev-2", "rev-3")
TARGET_RATIO = 50.0  # the target: onceflow >= 50x DBOS on the same workload

# onceflow's decisions and runs columns, constraints and indexes (store/backends/schema.py), minus the foreign
# key to tasks (no tasks table here): the per-row index work matches.
APP_SCHEMA = """
CREATE TABLE decisions (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id        TEXT NOT NULL,
    step_id        TEXT NOT NULL,
    participant_id INTEGER,
    role           TEXT NOT NULL DEFAULT '',
    decider_type   TEXT NOT NULL CHECK (decider_type IN ('agent', 'user')),
    decider_id     TEXT NOT NULL,
    decision       TEXT NOT NULL CHECK (decision IN ('approved', 'rejected', 'changes_requested')),
    comment        TEXT NOT NULL DEFAULT '',
    created_at     REAL NOT NULL
);
CREATE INDEX decisions_by_task_step ON decisions(task_id, step_id);
CREATE TABLE runs (
    id                      INTEGER PRIMARY KEY AUTOINCREMENT,
    agent_profile_id        TEXT NOT NULL,
    task_id                 TEXT,
    workflow_step_id        TEXT,
    reason                  TEXT NOT NULL,
    payload                 TEXT,
    idempotency_key         TEXT UNIQUE,
    exclude_from_coalescing INTEGER NOT NULL DEFAULT 0,
    status                  TEXT NOT NULL DEFAULT 'queued',
    coalesced_count         INTEGER NOT NULL DEFAULT 0,
    requested_at            REAL NOT NULL,
    claimed_at              REAL,
    finished_at             REAL
);
CREATE INDEX runs_queued_by_agent ON runs(agent_profile_id, status, requested_at);
"""


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _prepare_app_db(path: Path, n: int, wal: bool) -> None:
    """Schema plus one stale review decision per task (not timed)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        if wal:
            assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        conn.executescript(APP_SCHEMA)
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO decisions (task_id, step_id, role, decider_type, decider_id, decision, created_at)"
            " VALUES (?, 'review', 'reviewer', 'agent', 'rev-1', 'changes_requested', 0)",
            ((f"T-{i}",) for i in range(n)),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


def _prepare_sys_db(path: Path) -> None:
    """Only for --wal: an empty file already in WAL mode, which DBOS's connections then keep."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    finally:
        conn.close()


def _pragmas(engine: Any) -> str:
    """journal_mode / synchronous / busy_timeout as one of DBOS's own pooled connections sees them."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        journal, sync, busy = (
            conn.execute(sa.text(f"PRAGMA {name}")).scalar()
            for name in ("journal_mode", "synchronous", "busy_timeout")
        )
    sync_name = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(int(sync), str(sync))
    return f"journal_mode={journal} synchronous={sync_name} busy_timeout={busy}"


def run_dbos(tmp: Path, n: int, concurrency: int, dup_rate: float, wal: bool, seed: int) -> dict[str, Any]:
    """The workload on DBOS in `tmp`; returns figures (incl. 'violations')."""
    import sqlalchemy as sa
    from dbos import DBOS, DBOSConfig, SetWorkflowID, SQLAlchemyDatasource

    sys_path, app_path = tmp / "dbos_sys.sqlite", tmp / "app.sqlite"
    _prepare_app_db(app_path, n, wal)
    if wal:
        _prepare_sys_db(sys_path)
    config: DBOSConfig = {
        "name": "onceflow-peer",
        "system_database_url": f"sqlite:///{sys_path}",
        "log_level": "WARNING",
    }
    instance = DBOS(config=config)
    ds = SQLAlchemyDatasource.create(f"sqlite:///{app_path}")

    # Registered after DBOS() and the datasource exist; names fixed so they don't depend on this closure.
    @ds.transaction(name="clear_decisions")
    def clear_decisions(task: str) -> int:
        deleted = ds.sql_session().execute(
            sa.text("DELETE FROM decisions WHERE task_id = :task AND step_id = 'review'"), {"task": task}
        )
        return int(deleted.rowcount)  # type: ignore[attr-defined]

    @ds.transaction(name="queue_runs")
    def queue_runs(task: str, entry: str) -> int:
        # Plain INSERT (not OR IGNORE): a second fan-out would fail on the UNIQUE key, not hide.
        ds.sql_session().execute(
            sa.text(
                "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, idempotency_key,"
                " exclude_from_coalescing, requested_at)"
                " VALUES (:agent, :task, 'review', 'on_enter', :key, 1, :now)"
            ),
            [
                {"agent": a, "task": task, "key": f"on_enter:{entry}:{a}", "now": time.time()}
                for a in REVIEWERS
            ],
        )
        return len(REVIEWERS)

    @DBOS.workflow(name="review_entry")
    def review_entry(task: str, entry: str) -> int:
        clear_decisions(task)
        return queue_runs(task, entry)

    DBOS.launch()
    try:
        sys_settings = _pragmas(instance._sys_db.engine)  # private, but the only handle on DBOS's own engine
        app_settings = _pragmas(ds.engine)
        rng = random.Random(seed)
        dups = [rng.random() < dup_rate for _ in range(n)]
        latencies: list[float] = []
        errors: list[str] = []
        mismatched = [0]
        lock = threading.Lock()  # latencies/errors are shared by the worker threads

        def worker(offset: int) -> None:
            for i in range(offset, n, concurrency):
                task = f"T-{i}"
                entry = f"entry-{task}-review-1"
                try:
                    began = time.perf_counter()
                    with SetWorkflowID(entry):
                        first = review_entry(task, entry)
                    took = time.perf_counter() - began
                    if dups[i]:
                        with SetWorkflowID(entry):  # the redelivery: same id, DBOS must replay
                            again = review_entry(task, entry)
                        if again != first:
                            with lock:
                                mismatched[0] += 1
                    with lock:
                        latencies.append(took)
                except Exception as e:  # counted and reported: a failed entry invalidates the run
                    with lock:
                        errors.append(f"{entry}: {type(e).__name__}: {str(e).splitlines()[0]}")

        began = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="peer-") as pool:
            for future in [pool.submit(worker, offset) for offset in range(concurrency)]:
                future.result()
        elapsed = time.perf_counter() - began
    finally:
        DBOS.destroy(destroy_registry=True)

    figures, violations = check_dbos(app_path, sys_path, n)
    violations += [f"workflow failed: {e}" for e in errors[:5]]
    if len(errors) > 5:
        violations.append(f"... and {len(errors) - 5} more failed workflows")
    if mismatched[0]:
        violations.append(f"{mismatched[0]} redeliveries returned a different result than the first call")
    latencies.sort()
    return {
        "n": n,
        "concurrency": concurrency,
        "seconds": elapsed,
        "entries_per_s": n / elapsed,
        "runs_per_s": figures["runs"] / elapsed,
        "p50_ms": _percentile(latencies, 0.50) * 1000 if latencies else float("nan"),
        "p99_ms": _percentile(latencies, 0.99) * 1000 if latencies else float("nan"),
        "dup_sends": sum(dups),
        "sys_settings": sys_settings,
        "app_settings": app_settings,
        **figures,
        "violations": violations,
    }


def check_dbos(app_path: Path, sys_path: Path, n: int) -> tuple[dict[str, int], list[str]]:
    """The invariants over the closed databases, by plain SQL."""
    figures: dict[str, int] = {}
    for path, queries in (
        (
            app_path,
            {
                "runs": "SELECT COUNT(*) FROM runs",
                "dup_keys": "SELECT COUNT(*) FROM (SELECT idempotency_key FROM runs"
                " GROUP BY idempotency_key HAVING COUNT(*) > 1)",
                "null_keys": "SELECT COUNT(*) FROM runs WHERE idempotency_key IS NULL",
                "tasks_with_runs": "SELECT COUNT(DISTINCT task_id) FROM runs",
                "decisions_left": "SELECT COUNT(*) FROM decisions",
            },
        ),
        (
            sys_path,
            {
                "workflows": "SELECT COUNT(*) FROM workflow_status WHERE name = 'review_entry'",
                "workflows_ok": "SELECT COUNT(*) FROM workflow_status"
                " WHERE name = 'review_entry' AND status = 'SUCCESS'",
            },
        ),
    ):
        conn = sqlite3.connect(path)
        try:
            for key, sql in queries.items():
                figures[key] = int(conn.execute(sql).fetchone()[0])
        finally:
            conn.close()
    violations = []
    if figures["runs"] != n * len(REVIEWERS) or figures["tasks_with_runs"] != n:
        violations.append(
            f"{figures['runs']} runs over {figures['tasks_with_runs']} tasks, expected {n} x {len(REVIEWERS)}"
        )
    if figures["dup_keys"] or figures["null_keys"]:
        violations.append(f"duplicate runs: {figures['dup_keys']} keys twice, {figures['null_keys']} unkeyed")
    if figures["decisions_left"]:
        violations.append(f"{figures['decisions_left']} decisions not cleared")
    if figures["workflows"] != n or figures["workflows_ok"] != n:
        violations.append(
            f"{figures['workflows']} workflows ({figures['workflows_ok']} SUCCESS), expected {n}"
        )
    return figures, violations


def run_onceflow(tmp: Path, n: int, concurrency: int, dup_rate: float, seed: int) -> dict[str, Any]:
    from dispatch import run_dispatch  # bench/ is on sys.path when run as a script

    from onceflow.store.writer import Durability

    return trio.run(run_dispatch, tmp / "onceflow.db", n, concurrency, dup_rate, Durability.FULL, 64, seed)


def _row(label: str, result: dict[str, Any]) -> str:
    return (
        f"{label:<10}{result['n']:>7}{result['concurrency']:>5}{result['seconds']:>9.2f}"
        f"{result['entries_per_s']:>11,.1f}{result['runs_per_s']:>9,.1f}{result['p50_ms']:>9.1f}"
        f"{result['p99_ms']:>9.1f}{result['dup_sends']:>6}  {'OK' if not result['violations'] else 'FAILED'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "-n", "--tasks", type=int, default=1000, help="entries (onceflow, and DBOS by default)"
    )
    parser.add_argument("--dbos-n", type=int, default=None, help="entries for DBOS if not -n (it is slow)")
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("--dup-rate", type=float, default=0.1, help="fraction of entries redelivered")
    parser.add_argument("--wal", action="store_true", help="put DBOS's SQLite files in WAL mode first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary database directory")
    args = parser.parse_args()
    try:
        import dbos  # noqa: F401
    except ImportError:
        print("bench/peer_dbos.py: DBOS Transact is not installed, skipped (to run it: pip install dbos)")
        return 0
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    dbos_n = args.dbos_n if args.dbos_n is not None else args.tasks

    version = importlib.metadata.version("dbos")
    print(f"dbos {version}, sqlite {sqlite3.sqlite_version}, Python {sys.version.split()[0]}")
    print(f"C={args.concurrency} dup-rate={args.dup_rate}; onceflow FULL, max_batch 64")
    with tempfile.TemporaryDirectory(prefix="onceflow-peer-dbos-", dir=args.dir) as tmp:
        ours = run_onceflow(Path(tmp), args.tasks, args.concurrency, args.dup_rate, args.seed)
        theirs = run_dbos(Path(tmp), dbos_n, args.concurrency, args.dup_rate, args.wal, args.seed)
    print(f"DBOS system db: {theirs['sys_settings']}")
    print(f"DBOS app db:    {theirs['app_settings']}")
    print(
        f"{'':<10}{'N':>7}{'C':>5}{'seconds':>9}{'entries/s':>11}{'runs/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'dups':>6}  invariants"
    )
    print(_row("onceflow", ours))
    print(_row("DBOS", theirs))
    for name, result in (("onceflow", ours), ("DBOS", theirs)):
        for violation in result["violations"]:
            print(f"VIOLATION ({name}): {violation}")
    if dbos_n != args.tasks:
        print(f"note: DBOS ran {dbos_n} entries, onceflow {args.tasks}: the ratio compares rates, not runs")
    ratio = ours["entries_per_s"] / theirs["entries_per_s"]
    verdict = "met" if ratio >= TARGET_RATIO else "not met"
    print(f"ratio onceflow / DBOS (entries/s): {ratio:.1f}x  (target >= {TARGET_RATIO:.0f}x: {verdict})")
    return 1 if ours["violations"] or theirs["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
