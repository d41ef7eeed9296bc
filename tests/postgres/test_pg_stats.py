"""The writer gives PostgreSQL tables it grows their first planner statistics itself
(store/backends/pg_stats.py), so a new database's plans do not rest on the planner's guesses until
autovacuum's first look."""

from __future__ import annotations

from onceflow.store.backends import pg_schema, pg_stats, postgres
from onceflow.store.backends.postgres import PgConnection


def _analyzed(conn: PgConnection, table: str) -> int:
    return int(conn.raw.execute("SELECT analyze_count FROM pg_stat_user_tables WHERE relname = %s", [table])
               .fetchone()[0])  # fmt: skip


def _commits(conn: PgConnection, count: int) -> None:
    for _ in range(count):
        with conn.pipelined():
            conn.execute("BEGIN")
            conn.execute("SELECT 1")
            conn.execute("COMMIT")


def _grow(conn: PgConnection, rows: int) -> None:
    """`rows` tasks, written outside the writer's transactions (no commit counted), and the session's
    table statistics sent to the server at once (else up to a second later)."""
    conn.raw.execute(
        "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
        " SELECT 't' || (n + (SELECT count(*) FROM tasks)), 'wf', 's', 0, 0 FROM generate_series(1, %s) AS n",
        [rows],
    )
    conn.raw.execute("SELECT pg_stat_force_next_flush()")


def test_a_table_without_statistics_is_analyzed_once_it_holds_young_rows_changed_rows(pg_url: str) -> None:
    conn = postgres.connect(pg_url, lock_timeout=1.0)
    try:
        pg_schema.migrate(conn)
        conn.raw.execute("INSERT INTO workflows (id, name, source, definition, registered_at)"
                         " VALUES ('wf', 'wf', '', '{}', 0)")  # fmt: skip
        _grow(conn, pg_stats.YOUNG_ROWS - 1)
        _commits(conn, pg_stats.CHECK_EVERY)
        assert _analyzed(conn, "tasks") == 0  # checked, but small: a plan reading it all costs little
        _grow(conn, 1)
        _commits(conn, pg_stats.CHECK_EVERY - 1)
        assert _analyzed(conn, "tasks") == 0  # not checked between two checks
        _commits(conn, 1)
        assert _analyzed(conn, "tasks") == 1
        assert _analyzed(conn, "runs") == 0  # empty: left to autovacuum
        _grow(conn, pg_stats.YOUNG_ROWS)
        _commits(conn, pg_stats.CHECK_EVERY)
        assert _analyzed(conn, "tasks") == 1  # it has statistics: autovacuum keeps them from then on
    finally:
        conn.close()
