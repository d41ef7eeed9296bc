"""The read-only views at scale: time to first row and peak memory of `onceflow VIEW --db` on a big board.

Run: python bench/views.py [--entries 300000] [--runs-per-entry 3] [--db PATH] [--views runs,entries,...]

Builds (or reuses, with --db naming an existing file) a SQLite board with ENTRIES terminal step entries
(3 per task), RUNS-PER-ENTRY finished runs and one decision per entry, written in one transaction through
`store.bulk.fill_history` after a real runtime created the schema and registered the office workflow. Then
each view runs as its own process (`python -m onceflow.cli VIEW --db DB`, as an operator runs it), in
table and in --json form, with stdout read to the end: printed per run are the time to the first output
line, the total time, the rows printed and the process's peak RSS (`ru_maxrss` of the child). A closing
line runs `runs --json --limit 10` for the time a bounded look costs; the first, `onceflow --version`, is
the interpreter's and the CLI's start-up alone (most of a first row's time is that start-up); before them,
each view's first row read in this process (open + one page's query, no start-up). Targets: first
row under 1 s and peak RSS under 150 MB whatever the size. Prints figures; asserts nothing
about time.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.cli import views
from onceflow.store import bulk

WORKFLOW = Path(__file__).resolve().parent.parent / "onceflow" / "examples" / "office-example.yml"
PER_TASK = 3
STEPS = ("work", "review", "done")  # the office workflow's, in order


async def _schema(db: Path) -> None:
    """A real runtime creates the schema and registers the workflow, then closes (releasing the file)."""
    async with open_runtime(db) as runtime:
        text = WORKFLOW.read_text(encoding="utf-8")
        reply = await runtime.send({"type": "register_workflow", "yaml": text, "source": str(WORKFLOW)})
        if not reply.ok:
            raise SystemExit(f"register_workflow refused: {reply.error}")


def build(db: Path, entries: int, runs_per_entry: int) -> float:
    """Create the board; return the seconds the bulk fill took."""
    trio.run(_schema, db)
    conn = sqlite3.connect(db, isolation_level=None)
    started = time.perf_counter()
    conn.execute("BEGIN")
    filled = bulk.fill_history(
        conn,
        workflow_id="office-example",
        step_ids=STEPS,
        tasks=entries // PER_TASK,
        entries_per_task=PER_TASK,
        runs_per_entry=runs_per_entry,
        now=time.time(),
    )
    conn.execute("COMMIT")
    took = time.perf_counter() - started
    conn.close()
    print(f"filled {db}: {filled} in {took:.1f} s ({db.stat().st_size / 1e6:.0f} MB)")
    return took


def measure(db: Path | None, view: str, *extra: str) -> None:
    """Run one view as a child process (None `db`: `onceflow --version`, the start-up baseline) and print
    its figures."""
    args = [
        sys.executable,
        "-m",
        "onceflow.cli",
        *([view, "--db", str(db)] if db else ["--version"]),
        *extra,
    ]
    started = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert child.stdout is not None
    first: float | None = None
    lines = 0
    for _ in child.stdout:
        if first is None:
            first = time.perf_counter() - started
        lines += 1
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    total = time.perf_counter() - started
    rows = lines - (0 if "--json" in extra or db is None else 1)
    failed = "" if child.returncode == 0 else f"  exit {child.returncode}"
    print(
        f"{view:9} {' '.join(extra):22} first row {first or 0:6.3f} s  total {total:6.1f} s"
        f"  rows {rows:8}  peak RSS {usage.ru_maxrss / 1024:5.0f} MB{failed}",
        flush=True,
    )


def first_page(db: Path, view: str) -> None:
    """In this process, no start-up: the seconds to open the database and read a view's first row."""
    started = time.perf_counter()
    with views.open_read_only(db) as conn:
        next(views.stream(conn, view), None)
    print(f"{view:9} in process: open + first row {time.perf_counter() - started:.4f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--entries", type=int, default=300_000)
    parser.add_argument("--runs-per-entry", type=int, default=3)
    parser.add_argument("--db", type=Path, help="reuse this board when it exists, else build it there")
    parser.add_argument("--views", default="runs,entries,decisions,tasks,outcomes")
    args = parser.parse_args()
    db = args.db or Path(tempfile.mkdtemp(prefix="onceflow-views-")) / "views.db"
    if not db.exists():
        build(db, args.entries, args.runs_per_entry)
    os.environ.setdefault("NO_COLOR", "1")
    for view in args.views.split(","):
        first_page(db, view)
    measure(None, "start-up")
    for view in args.views.split(","):
        for form in ((), ("--json",)):
            measure(db, view, *form)
    measure(db, "runs", "--json", "--limit", "10")


if __name__ == "__main__":
    main()
