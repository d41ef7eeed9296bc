"""Read-only views of a board's database: tasks, runs, step entries, decisions, outcomes, workflow versions,
the queue. Main thread, its own read-only connection (never the writer's).

`onceflow tasks|runs|entries|decisions|outcomes|workflows|queue --db FILE|URL [--task ID] [--json]` reads the
database while runtimes serve it. A SQLite file is opened `mode=ro` through a URI, so it is a WAL reader that
never writes, never migrates and never takes the runtime's ownership lock (`<db>.lock`); it sees the last
committed state. A `postgresql://` URL is opened with store/backends/postgres.py's `connect` in a read-only
session (`default_transaction_read_only`) and read in one `REPEATABLE READ READ ONLY` transaction: one
snapshot for the whole view, no row locks, no advisory locks, no epoch, so it never blocks a runtime and
cannot write. Rows are read with the store's own query functions (`store/`), so a view shows what the
protocol's queries return. Output is an aligned table for people (control characters escaped) or, with
`--json`, one JSON object per line for scripts; times are RFC 3339 UTC, as in the protocol's results.
`entries` lists every step entry `history` tells of: the entry records, and the entries of steps that allocate
none (their on_enter declares only host-owned actions, as Work and Done do), read from their transitions with
`entry_seq` None.

`onceflow queue` is `queue_stats` per agent (queued, claimed, ceiling, oldest age, paused, refused in the last
hour), then a `(global)` line when a global limit is set; ages are judged by this process's clock on SQLite,
by the server's on PostgreSQL.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote, unquote, urlsplit

from onceflow.protocol.times import rfc3339
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.schema import SCHEMA_VERSION
from onceflow.store.backends.urls import database_arg, is_postgres_url, redacted
from onceflow.store.entries import participants, step_entries
from onceflow.store.outcomes import outcomes
from onceflow.store.records import TaskRecord
from onceflow.store.runs import flow, runs
from onceflow.store.tasks import history, tasks, workflows

VIEWS = ("tasks", "runs", "entries", "decisions", "outcomes", "workflows", "queue")
TASK_SCOPED = ("tasks", "runs", "entries", "decisions")
CANNOT_RUN = 2
"""Exit status when the database cannot be read: `onceflow.cli.main.CANNOT_RUN` (cli imports this module)."""
_CONNECT_TIMEOUT = 5.0  # seconds a view waits for a PostgreSQL server before reporting it unreachable
_LOCK_TIMEOUT = 2.0  # seconds a view's read waits behind a schema change's lock before giving up

Row = dict[str, Any]


class ViewError(Exception):
    """The database cannot be read. `kind` says why: `missing` (no such file or database), `not_onceflow`
    (not a database, or without onceflow's schema), `schema_version` (another version), `bad_url`,
    `unreachable` (no server answers), `credentials` (the server refused the user or password), `read`
    (a query failed). The message is one line and never carries a password."""

    def __init__(self, message: str, kind: str = "read") -> None:
        super().__init__(" ".join(message.split()))
        self.kind = kind


@contextlib.contextmanager
def open_read_only(target: Path | str) -> Iterator[Connection]:
    """A read-only connection to the database `target` names, checked to be at this code's schema version:
    a SQLite file (`mode=ro` URI: never writes, never locks it for ownership, never migrates), or a
    `postgresql://` URL (a read-only session inside one read-only snapshot transaction, see the module
    docstring; the connection is store/backends/postgres.py's, so it answers like sqlite3).

    Raises:
        ViewError: the file or database does not exist, is not an onceflow database, or its schema version
            differs from this onceflow's (older: open it once with this version's runtime to migrate;
            newer: upgrade); for a URL also `bad_url`, `unreachable` and `credentials` (see `ViewError`).
    """
    if is_postgres_url(target):
        with _open_postgres(str(target)) as pg:
            yield pg
        return
    path = Path(target)
    if not path.is_file():
        raise ViewError(f"no database at {path}", "missing")
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise ViewError(f"cannot open {path} read-only: {exc}", "not_onceflow") from None
    try:
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        except sqlite3.DatabaseError as exc:
            raise ViewError(f"{path} is not an onceflow database: {exc}", "not_onceflow") from None
        _check_version(str(path), version)
        yield conn
    finally:
        conn.close()


def _check_version(name: str, version: int) -> None:
    if version < SCHEMA_VERSION:
        raise ViewError(
            f"{name} has schema version {version}, older than this onceflow's {SCHEMA_VERSION}: open it"
            " once with this version's runtime to migrate it (views never migrate)",
            "schema_version",
        )
    if version > SCHEMA_VERSION:
        raise ViewError(
            f"{name} has schema version {version}, newer than this onceflow's {SCHEMA_VERSION}: use the"
            " onceflow that wrote it",
            "schema_version",
        )


# libpq's words for a server that refused who we are (it reports no SQLSTATE before a session exists).
_REFUSED = ("authentication failed", "no password supplied", "role", "pg_hba.conf", "permission denied")


@contextlib.contextmanager
def _open_postgres(url: str) -> Iterator[Connection]:
    """`open_read_only` for a PostgreSQL URL (psycopg is imported only here: SQLite views never load it)."""
    import psycopg

    from onceflow.store.backends import postgres

    name = redacted(url)
    try:
        conn = postgres.connect(url, connect_timeout=_CONNECT_TIMEOUT, lock_timeout=_LOCK_TIMEOUT)
    except postgres.PgConnection.errors as exc:
        cause = exc.__cause__
        text = _scrubbed(str(cause if cause is not None else exc), url)
        unparsed = "invalid" in text and "connection to server" not in text and "host name" not in text
        if not isinstance(cause, psycopg.OperationalError) or unparsed:  # libpq could not parse the URL
            raise ViewError(f"{name} is not a valid PostgreSQL URL: {text}", "bad_url") from None
        if "database" in text and "does not exist" in text:
            raise ViewError(f"no database at {name}: {text}", "missing") from None
        if any(word in text for word in _REFUSED):
            raise ViewError(f"{name} refused the credentials: {text}", "credentials") from None
        raise ViewError(f"cannot reach {name}: {text}", "unreachable") from None
    try:
        try:
            # Read-only for the whole session, not only the transaction below: nothing a view runs can write.
            conn.execute("SET default_transaction_read_only = on")
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            if conn.scalar("SELECT to_regclass('onceflow_meta')") is None:
                raise ViewError(f"{name} is not an onceflow database: no onceflow_meta table", "not_onceflow")
            version = conn.scalar("SELECT version FROM onceflow_meta")
        except postgres.PgConnection.errors as exc:
            text = _scrubbed(str(exc), url)
            if "permission denied" in text:  # the user may connect but not read onceflow's tables
                raise ViewError(f"{name} refused the credentials: {text}", "credentials") from None
            raise ViewError(f"cannot read {name}: {text}", "unreachable") from None
        if version is None:
            raise ViewError(f"{name} is not an onceflow database: onceflow_meta is empty", "not_onceflow")
        _check_version(name, int(version))
        yield conn
    finally:
        conn.close()


def _scrubbed(text: str, url: str) -> str:
    """`text` (a driver's message) without the password of `url`, as given or percent-decoded."""
    with contextlib.suppress(ValueError):
        password = urlsplit(url).password
        if password:
            for form in {password, unquote(password)}:
                text = text.replace(form, "***")
    return text


def rows(conn: Connection, view: str, task_id: str | None = None, limit: int | None = None) -> list[Row]:
    """The rows of one view (see `VIEWS`), optionally of one task (task-scoped views only), at most `limit`
    (None: all): `stream` collected.

    Raises:
        ValueError: an unknown view, or `task_id` given for the outcomes view.
        ViewError: a query failed (e.g. the database is not onceflow's).
    """
    return list(stream(conn, view, task_id, limit))


def stream(
    conn: Connection, view: str, task_id: str | None = None, limit: int | None = None
) -> Iterator[Row]:
    """The rows of one view, read in pages of `PAGE` rows keyed by the view's order (task id, run id, entry
    key, decision id, outcome id): memory stays that of one page however large the database, and the first
    row comes after one page's query. Stops after `limit` rows (None: all). On SQLite each page is its own
    read, so a long view sees the rows committed meanwhile in later pages; on PostgreSQL one snapshot.

    Raises (when iterated):
        ValueError: an unknown view, or `task_id` given for the outcomes view (raised at the call).
        ViewError: a query failed (e.g. the database is not onceflow's).
    """
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; one of {', '.join(VIEWS)}")
    if task_id is not None and view not in TASK_SCOPED:
        raise ValueError(f"the {view} view is not task-scoped")
    return _limited(_QUERIES[view](conn, task_id), view, limit)


def _limited(pages: Iterator[list[Row]], view: str, limit: int | None) -> Iterator[Row]:
    left = limit
    try:
        for page in pages:
            yield from page if left is None else page[:left]
            if left is not None:
                left -= min(left, len(page))
                if left == 0:
                    return
    except faults.any_database_errors() as exc:
        raise ViewError(f"reading the {view} view failed: {exc}", "read") from None


PAGE = 500
"""Rows a view reads per query."""


def _tasks(conn: Connection, task_id: str | None) -> Iterator[list[Row]]:
    if task_id is not None:
        found = tasks.find_task(conn, task_id)
        yield [] if found is None else [_task_row(found)]
        return
    after: str | None = None
    while True:
        page, more = tasks.list_tasks(conn, after_task_id=after, limit=PAGE)
        yield [_task_row(task) for task in page]
        if not more:
            return
        after = page[-1].id


def _task_row(task: TaskRecord) -> Row:
    return {**tasks.task_info(task), "updated_at": rfc3339(task.updated_at)}


def _runs(conn: Connection, task_id: str | None) -> Iterator[list[Row]]:
    after: int | None = None
    while True:
        page, more = runs.runs_page(conn, after_id=after, limit=PAGE, task_id=task_id)
        yield [dict(runs.run_info(run)) for run in page]
        if not more:
            return
        after = page[-1].id


def _entries(conn: Connection, task_id: str | None) -> Iterator[list[Row]]:
    """Every step entry, as `history` shows them: the entry records and, merged in the same (task, step)
    order, the entries that allocated none (a step whose on_enter declares no engine-owned action: Work,
    Done), from their transitions: `entry_seq`, `terminal` and `declaration_digest` None, no markers."""
    merged = heapq.merge(_records(conn, task_id), _recordless(conn, task_id), key=lambda pair: pair[0])
    while page := [row for _, row in itertools.islice(merged, PAGE)]:
        yield page


def _records(conn: Connection, task_id: str | None) -> Iterator[tuple[tuple[str, str, int, int], Row]]:
    after: step_entries.EntryCursor | None = None
    while True:
        page, more = step_entries.entries_page(conn, task_id=task_id, after=after, limit=PAGE)
        yield from (((e["task_id"], e["step_id"], 1, e["entry_seq"]), dict(e)) for e in page)
        if not more:
            return
        after = (page[-1]["task_id"], page[-1]["step_id"], page[-1]["entry_seq"])


def _recordless(conn: Connection, task_id: str | None) -> Iterator[tuple[tuple[str, str, int, int], Row]]:
    """The record-less entries in (task, step, history seq) order: read in the history's (task, seq) order,
    one task's at a time sorted by step (held in memory: one task's transitions into such steps)."""
    for _, group in itertools.groupby(_recordless_by_seq(conn, task_id), key=lambda pair: pair[0][0]):
        yield from sorted(group, key=lambda pair: pair[0])


def _recordless_by_seq(
    conn: Connection, task_id: str | None
) -> Iterator[tuple[tuple[str, str, int, int], Row]]:
    after: history.RecordlessCursor | None = None
    while True:
        page, more = history.recordless_entries_page(conn, task_id=task_id, after=after, limit=PAGE)
        for (task, seq), detail in page:
            row = {
                "task_id": task,
                "step_id": detail["to_step"],
                "entry_seq": None,
                "workflow_id": detail["workflow_id"],
                "declaration_digest": None,
                "entry_path": detail["entry_path"],
                "terminal": None,
                "markers": [],
            }
            yield (task, detail["to_step"], 0, seq), row
        if not more:
            return
        after = page[-1][0]


def _decisions(conn: Connection, task_id: str | None) -> Iterator[list[Row]]:
    after: int | None = None
    while True:
        page, more = participants.decisions_page(conn, task_id=task_id, after_id=after, limit=PAGE)
        yield [dict(participants.decision_info(decision)) for decision in page]
        if not more:
            return
        after = page[-1].id


def _outcomes(conn: Connection, _: str | None) -> Iterator[list[Row]]:
    after: str | None = None
    while True:
        page, more = outcomes.outcomes_page(conn, after_id=after, limit=PAGE)
        yield [dict(record.info()) for record in page]
        if not more:
            return
        after = page[-1].outcome_id


def _workflows(conn: Connection, _: str | None) -> Iterator[list[Row]]:
    """Every registered workflow: its versions, the newest, and how many tasks each version holds (what
    `list_workflows` answers)."""
    counts = workflows.live_tasks_by_version(conn)
    yield [
        {
            "workflow_id": workflow_id,
            "versions": versions,
            "newest": versions[-1],
            "live_tasks_by_version": counts.get(workflow_id, {}),
        }
        for workflow_id, versions in workflows.versions_summary(conn)
    ]


def _queue(conn: Connection, _: str | None) -> Iterator[list[Row]]:
    agents, limits, _pauses, _now = flow.queue_stats(conn, time.time())
    page: list[Row] = [
        {
            "agent_profile_id": a.agent_profile_id,
            "queued": a.queued,
            "claimed": a.claimed,
            "max_concurrent": a.max_concurrent,
            "runs_per_hour": a.runs_per_hour,
            "oldest_age_s": None if a.oldest_age is None else round(a.oldest_age, 3),
            "paused": a.paused,
            "rate_limited_last_hour": a.rate_limited_last_hour,
        }
        for a in agents
    ]
    for limit in limits:
        if limit.scope == "global":
            page.append(
                {
                    "agent_profile_id": "(global)",
                    "queued": sum(row["queued"] for row in page),
                    "claimed": sum(row["claimed"] for row in page),
                    "max_concurrent": limit.max_concurrent,
                    "runs_per_hour": limit.runs_per_hour,
                }
            )
    yield page


_QUERIES: dict[str, Callable[[Connection, str | None], Iterator[list[Row]]]] = {
    "tasks": _tasks,
    "runs": _runs,
    "entries": _entries,
    "decisions": _decisions,
    "outcomes": _outcomes,
    "workflows": _workflows,
    "queue": _queue,
}

# What a table shows per view (JSON lines carry every field). Nested values are rendered as compact JSON.
COLUMNS: dict[str, tuple[str, ...]] = {
    "tasks": ("task_id", "workflow_id", "step_id", "wip_admitted", "queued_for_step_id", "priority", "title",
              "updated_at"),
    "runs": ("id", "task_id", "step_id", "agent_profile_id", "reason", "status", "attempt", "outcome_reason",
             "requested_at", "idempotency_key"),
    "entries": ("task_id", "step_id", "entry_seq", "entry_path", "terminal", "markers"),
    "decisions": ("id", "task_id", "step_id", "role", "decider_id", "decision", "created_at", "comment"),
    "queue": ("agent_profile_id", "queued", "claimed", "max_concurrent", "runs_per_hour", "oldest_age_s",
              "paused", "rate_limited_last_hour"),
    "outcomes": ("outcome_id", "phase", "delivery_attempts", "duplicate_signals", "stale_acknowledgements",
                 "coordinator_fence", "delivered_at", "acknowledged_at", "last_delivery_error"),
    "workflows": ("workflow_id", "newest", "versions", "live_tasks_by_version"),
}  # fmt: skip


def escape(text: str) -> str:
    """`text` with control characters (C0, DEL, C1) written as escapes (`\\n`, `\\x1b`), so a stored value
    cannot move the cursor or recolour a terminal."""
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text
    )


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "markers" and isinstance(value, list):
        return " ".join(f"{m['position']}:{m['kind']}={m['state']}" for m in value) or "-"
    if isinstance(value, dict | list):
        return escape(json.dumps(value, separators=(",", ":")))
    return escape(str(value))


def render_table(view: str, data: list[Row]) -> str:
    """The rows as an aligned text table with a header line (the view's `COLUMNS`)."""
    return "\n".join(Table(view).lines(data, header=True))


class Table:
    """A view's table printed page by page: the header once, each page aligned to the widest cell seen so
    far (columns only widen, so a later long value shifts its own page, never an earlier one)."""

    def __init__(self, view: str) -> None:
        self.columns = COLUMNS[view]
        self.widths = [len(column) for column in self.columns]

    def lines(self, page: list[Row], *, header: bool) -> list[str]:
        """The lines of one page (preceded by the header line when `header`)."""
        cells = [[_cell(column, row.get(column)) for column in self.columns] for row in page]
        if header:
            cells.insert(0, list(self.columns))
        for line in cells:
            self.widths = [max(w, len(c)) for w, c in zip(self.widths, line, strict=True)]
        return [
            "  ".join(c.ljust(w) for c, w in zip(line, self.widths, strict=True)).rstrip() for line in cells
        ]


def show(
    target: Path | str, view: str, task_id: str | None, as_json: bool, out: TextIO, limit: int | None = None
) -> int:
    """Print one view of the database `target` names (file or `postgresql://` URL) to `out`, page by page
    as it is read (`stream`: constant memory, the first row after one page), at most `limit` rows (None:
    all); return the exit status: 0, or `CANNOT_RUN` (2) after printing one `error: ...` line to stderr
    when the database cannot be read (`open_read_only`, `stream`; the password never shown). A closed
    `out` (a reader such as `head` went away) raises BrokenPipeError, which `onceflow.cli.main.main` turns
    into a quiet exit."""
    try:
        with open_read_only(target) as conn:
            table = Table(view)
            page: list[Row] = []
            header = True
            for row in stream(conn, view, task_id, limit):
                page.append(row)
                if len(page) == PAGE:
                    _write(out, page, table, as_json, header)
                    page, header = [], False
            if page or header:
                _write(out, page, table, as_json, header)
    except ViewError as exc:
        print(f"error: {escape(str(exc))}", file=sys.stderr)
        return CANNOT_RUN
    return 0


def _write(out: TextIO, page: list[Row], table: Table, as_json: bool, header: bool) -> None:
    if as_json:
        lines = [json.dumps(row, separators=(",", ":")) for row in page]
    else:
        lines = table.lines(page, header=header)
    if lines:
        out.write("\n".join(lines) + "\n")
        out.flush()


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add one subcommand per view to the `onceflow` parser; each sets `handler` (args -> exit status)."""
    for view in VIEWS:
        parser = sub.add_parser(view, help=f"show the {view} of a database (read-only; safe while it runs)")
        parser.add_argument("--db", type=database_arg, required=True, help="SQLite file or postgresql:// URL")
        if view in TASK_SCOPED:
            parser.add_argument("--task", help="only this task")
        parser.add_argument("--json", action="store_true", help="one JSON object per line")
        parser.add_argument("--limit", type=_positive, metavar="N", help="at most N rows")
        parser.set_defaults(
            handler=lambda args, view=view: show(
                args.db, view, getattr(args, "task", None), args.json, sys.stdout, args.limit
            )
        )


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
