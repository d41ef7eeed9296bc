"""PostgreSQL's planner statistics for the store's young tables. Writer thread.

The server's autovacuum analyzes a table once 50 rows + 10 % of it changed, but it looks only every
`autovacuum_naptime` (a minute by default), so the tables of a new database grow for up to a minute with no
statistics. Without them the planner guesses that 1 % of the rows match `status IN ('queued', 'claimed')`,
and a batch's leave (store/runs/runs.py `leave_entries`, `task_id = ANY(...)`) reads every open run through
`runs_open_by_agent`'s predicate instead of probing `runs_open_by_task`: thousands of rows for none found,
measured ~15 % of the server's statement time in `bench/multi_runtime.py`. Generic plans of prepared
statements made meanwhile rest on the same guesses.

So the writer gives each of the tables it grows its first statistics itself (`Keeper.after_commit`, called
by `PgConnection` after every COMMIT): every `CHECK_EVERY` commits it asks the server which of `TABLES` has
none yet, and analyzes those that hold `YOUNG_ROWS` changed rows or more (`ANALYZE (SKIP_LOCKED)`: a table
another session is analyzing is left to it). Once every one of them has statistics (from this or any
session, or autovacuum) it stops asking; autovacuum keeps them current from then on. An ANALYZE reads at
most 30,000 sampled rows (`default_statistics_target` 100), so one costs tens of milliseconds whatever the
table's size, once per table and database; the batch that just committed waits for it before its replies.
A failure (no privilege: the server skips the table with a warning; a lost connection) is logged and never
fails the transaction, which has committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
import structlog

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

log = structlog.get_logger("onceflow.store")

TABLES = ("runs", "tasks", "step_entries", "step_entry_markers", "task_history", "decisions")
"""The tables the writer grows on every step entry, whose plans matter most."""

CHECK_EVERY = 16
"""Commits between two checks, while a table of `TABLES` has no statistics."""

YOUNG_ROWS = 1000
"""Changed rows (`n_mod_since_analyze`) from which a table with no statistics is analyzed: below it a plan
that reads every row costs little."""

_YOUNG = (
    "SELECT relname, n_mod_since_analyze FROM pg_stat_user_tables"
    " WHERE schemaname = current_schema() AND relname = ANY(%s)"
    " AND last_analyze IS NULL AND last_autoanalyze IS NULL"
)


class Keeper:
    """Whether and when a connection still gives tables their first statistics (module docstring). One per
    connection; `run` executes one statement on it outside any transaction and returns its rows."""

    def __init__(self, run: Callable[[str, Sequence[Any] | None], list[tuple[Any, ...]]]) -> None:
        self._run = run
        self._commits = 0
        self.done = False
        """Every table of `TABLES` had statistics at the last check: no more checks on this connection."""

    def after_commit(self) -> None:
        """Count a commit; at every `CHECK_EVERY`-th, analyze the young tables (one round trip to ask, one
        per table analyzed). Never raises a database error: it is logged."""
        if self.done:
            return
        self._commits += 1
        if self._commits % CHECK_EVERY:
            return
        try:
            young = self._run(_YOUNG, [list(TABLES)])
            if not young:
                self.done = True
                return
            for table, changed in young:
                if changed >= YOUNG_ROWS:
                    self._run(f"ANALYZE (SKIP_LOCKED) {table}", None)
                    log.info("store_table_analyzed", table=table, changed_rows=changed)
        except psycopg.Error as exc:
            log.warning("store_analyze_failed", error=str(exc))
