"""`onceflow history --db DB --task ID [--json] [--limit N]`: a task's history, read-only. Main thread, its
own read-only connection (onceflow/cli/views.py `open_read_only`: never the writer's, safe while runtimes
serve).

The items are those `task_history` returns (store/tasks/history.py), oldest first, read a page at a time and
printed as they are read (constant memory whatever the history's length): one line per item for people
(time, kind, what happened; control characters escaped) or, with `--json`, one JSON object per line, the
item as the protocol gives it. `--limit N` stops after N items. A closed pipe (`| head`) ends it quietly,
exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from onceflow.cli.views import CANNOT_RUN, ViewError, escape, open_read_only
from onceflow.protocol.results import HistoryItem
from onceflow.store.backends import faults
from onceflow.store.backends.urls import database_arg
from onceflow.store.tasks import history

PAGE = 500
"""Items read per query."""


def items(target: Path | str, task_id: str, limit: int | None) -> Iterator[HistoryItem]:
    """The task's history items, oldest first, at most `limit` (None: all), read `PAGE` at a time from the
    database `target` names (a generator: the connection stays open while it is iterated).

    Raises:
        ViewError: the database cannot be read, or the task does not exist (kind `missing`).
    """
    with open_read_only(target) as conn:
        try:
            if conn.execute("SELECT 1 FROM tasks WHERE id = ?", (task_id,)).fetchone() is None:
                raise ViewError(f"task {task_id!r} does not exist", "missing")
            after: history.Cursor | None = None
            left = limit
            while left is None or left > 0:
                size = PAGE if left is None else min(PAGE, left)
                page, more = history.page(conn, task_id, after=after, limit=size)
                for cursor, item in page:
                    yield item
                    after = cursor
                if left is not None:
                    left -= len(page)
                if not more:
                    return
        except faults.any_database_errors() as exc:
            raise ViewError(f"reading the history failed: {exc}", "read") from None


def line(item: HistoryItem) -> str:
    """One item as a line for people: its time, kind and what it says."""
    detail = item["detail"]
    match item["kind"]:
        case "created":
            what = f"at {detail['step_id']}" + (" (queued)" if detail.get("queued") else "")
        case "transition":
            what = f"{detail['from_step']} -> {detail['to_step']}" + (" (queued)" if detail["queued"] else "")
            what += f"  trigger={detail['trigger']} op={detail['operation_id'] or '-'}"
            what += f" path={detail['entry_path'] or '-'} entry={detail['entry_seq'] or '-'}"
        case "decision":
            what = f"{detail['decision']} by {detail['decider_type']} {detail['decider_id']}"
            what += f" at {detail['step_id']}"
            what += f" role={detail['role'] or '-'} op={detail['operation_id'] or '-'}"
        case _:
            what = (
                f"#{detail['run_id']} {detail['status']} {detail['agent_profile_id']} at {detail['step_id']}"
            )
            if "attempt" in detail:
                what += f" attempt={detail['attempt']}"
            if detail.get("outcome_reason"):
                what += f" reason={detail['outcome_reason']}"
    return escape(f"{item['at']}  {item['kind']:<10}  {what}")


def show(target: Path | str, task_id: str, as_json: bool, limit: int | None, out: TextIO) -> int:
    """Print the task's history to `out`; the exit status: 0 (also when the reader closed the pipe), or
    `CANNOT_RUN` (2) after one `error: ...` line on stderr when the database cannot be read or the task does
    not exist."""
    try:
        for item in items(target, task_id, limit):
            print(json.dumps(item, separators=(",", ":")) if as_json else line(item), file=out)
        out.flush()
    except ViewError as exc:
        print(f"error: {escape(str(exc))}", file=sys.stderr)
        return CANNOT_RUN
    except BrokenPipeError:  # the reader has gone: stop quietly, and let nothing flush into the closed pipe
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        os.close(devnull)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return value


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `history` to the `onceflow` parser; it sets `handler` (args -> exit status)."""
    parser = sub.add_parser("history", help="show a task's history (read-only; safe while it runs)")
    parser.add_argument("--db", type=database_arg, required=True, help="SQLite file or postgresql:// URL")
    parser.add_argument("--task", required=True, help="the task")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--limit", type=_positive, help="at most this many items")
    parser.set_defaults(handler=lambda args: show(args.db, args.task, args.json, args.limit, sys.stdout))
