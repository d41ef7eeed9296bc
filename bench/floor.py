"""The floor: onceflow's durable writes per step entry, issued by a straight sqlite3 loop in one thread.

Run: python bench/floor.py [-n N] [--compare] [-c C]

Same schema (onceflow's migrations, so the same indexes and foreign keys) and the same PRAGMAs as the store
actor (WAL, synchronous=FULL, foreign_keys=ON). Per entry, the writes onceflow commits when a task enters
review with [clear_decisions, queue_run_for_each_participant{role: reviewer}] and 3 reviewers:
task step update, step_entries insert (next entry_seq), clear marker claimed, decisions delete, clear marker
done, fan-out marker claimed, 3 run inserts, fan-out marker done, entry terminal. Two rows: every entry in
one transaction, and one transaction per action (6: move+entry, claim, clear+done, claim, runs+done,
terminal — the shape onceflow's dispatch has). No lookups, validation, events or Trio.

`--compare` then runs bench/dispatch.py's core (`run_dispatch`) in the same process, at concurrency 1 and
at -c, and prints each as a ratio of the one-transaction-per-entry floor.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import trio

from onceflow.store.backends import schema

REVIEWERS = ("rev-1", "rev-2", "rev-3")
KINDS = ("clear_decisions", "queue_run_for_each_participant")


def _connect(path: Path, n: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout=5000")
    assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    schema.migrate(conn)
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, registered_at)"
        " VALUES ('bench', 'B', 's', 'd', 0)"
    )
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
        " VALUES (?, 'bench', 'work', 0, 0)",
        ((f"T-{i}",) for i in range(n)),
    )
    conn.execute("COMMIT")
    return conn


def _steps(conn: sqlite3.Connection, task: str, now: float) -> list[Callable[[], None]]:
    """The entry's writes grouped by action (each group = one transaction in per-action mode)."""
    ex = conn.execute
    seq_box = [0]
    marker = (
        "INSERT INTO step_entry_markers (task_id, step_id, entry_seq, position, kind, state, epoch,"
        " updated_at) VALUES (?, 'review', ?, ?, ?, 'in_progress', 'e', ?)"
    )
    done = (
        "UPDATE step_entry_markers SET state = 'done', epoch = NULL, updated_at = ?"
        " WHERE task_id = ? AND step_id = 'review' AND entry_seq = ? AND position = ? AND kind = ?"
    )

    def move() -> None:
        ex(
            "UPDATE tasks SET workflow_step_id = 'review', updated_at = ?"
            " WHERE id = ? AND workflow_step_id = 'work'",
            (now, task),
        )
        (seq_box[0],) = ex(
            "SELECT COALESCE(MAX(entry_seq), 0) + 1 FROM step_entries"
            " WHERE task_id = ? AND step_id = 'review'",
            (task,),
        ).fetchone()
        ex(
            "INSERT INTO step_entries (task_id, step_id, entry_seq, workflow_id, declaration_digest,"
            " entry_path, terminal, created_at)"
            " VALUES (?, 'review', ?, 'bench', 'digest', 'manual_move', 0, ?)",
            (task, seq_box[0], now),
        )

    def claim(position: int) -> Callable[[], None]:
        return lambda: ex(marker, (task, seq_box[0], position, KINDS[position], now))

    def clear() -> None:
        ex("DELETE FROM decisions WHERE task_id = ? AND step_id = 'review'", (task,))
        ex(done, (now, task, seq_box[0], 0, KINDS[0]))

    def fan_out() -> None:
        for agent in REVIEWERS:
            ex(
                "INSERT INTO runs (agent_profile_id, task_id, workflow_step_id, reason, entry_seq,"
                " key_position, key_digest, exclude_from_coalescing, requested_at)"
                " VALUES (?, ?, 'review', 'on_enter', ?, 1, 'digest', 1, ?)",
                (agent, task, seq_box[0], now),
            )
        ex(done, (now, task, seq_box[0], 1, KINDS[1]))

    def terminal() -> None:
        ex(
            "UPDATE step_entries SET terminal = 1 WHERE task_id = ? AND step_id = 'review' AND entry_seq = ?",
            (task, seq_box[0]),
        )

    return [move, claim(0), clear, claim(1), fan_out, terminal]


def floor(path: Path, n: int, per_action: bool) -> float:
    """Entries per second for `n` entries; one transaction per entry, or per action."""
    conn = _connect(path, n)
    try:
        began = time.perf_counter()
        for i in range(n):
            groups = _steps(conn, f"T-{i}", time.time())
            if per_action:
                for group in groups:
                    conn.execute("BEGIN IMMEDIATE")
                    group()
                    conn.execute("COMMIT")
            else:
                conn.execute("BEGIN IMMEDIATE")
                for group in groups:
                    group()
                conn.execute("COMMIT")
        elapsed = time.perf_counter() - began
        runs = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        open_entries = conn.execute("SELECT COUNT(*) FROM step_entries WHERE terminal = 0").fetchone()[0]
        assert runs == 3 * n and open_entries == 0, (runs, open_entries)
    finally:
        conn.close()
    return n / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", "--entries", type=int, default=2000)
    parser.add_argument("--compare", action="store_true", help="also run onceflow's dispatch bench, same N")
    parser.add_argument("-c", "--concurrency", type=int, default=64, help="second --compare concurrency")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary database directory")
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    print(f"sqlite {sqlite3.sqlite_version}, {args.entries} entries, WAL + synchronous=FULL")
    print(f"{'what':<44}{'entries/s':>11}{'x floor':>9}  invariants")
    with tempfile.TemporaryDirectory(prefix="onceflow-floor-", dir=args.dir) as tmp:
        base = floor(Path(tmp) / "entry.db", args.entries, per_action=False)
        print(f"{'sqlite3 loop, 1 txn per entry (the floor)':<44}{base:>11,.0f}{1.0:>9.2f}  OK")
        rate = floor(Path(tmp) / "action.db", args.entries, per_action=True)
        print(f"{'sqlite3 loop, 1 txn per action (6/entry)':<44}{rate:>11,.0f}{rate / base:>9.2f}  OK")
        failed = False
        if args.compare:
            from dispatch import run_dispatch  # bench/ is on sys.path when run as a script

            from onceflow.store.writer import Durability

            for concurrency in (1, args.concurrency):
                result = trio.run(
                    run_dispatch,
                    Path(tmp) / f"onceflow-{concurrency}.db",
                    args.entries,
                    concurrency,
                    0.0,
                    Durability.FULL,
                    64,
                    0,
                )
                ok = not result["violations"]
                failed |= not ok
                label = f"onceflow dispatch, {concurrency} task(s), FULL"
                print(
                    f"{label:<44}{result['entries_per_s']:>11,.0f}{result['entries_per_s'] / base:>9.2f}"
                    f"  {'OK' if ok else 'FAILED: ' + '; '.join(result['violations'])}"
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
