"""runs.task_id's foreign key on PostgreSQL, kept by triggers that check an INSERT's rows at once
(store/backends/pg_schema.py's migration 22): the same rule and the same error as the constraint, also
against a concurrent delete of the task."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from onceflow.store.backends import pg_schema, postgres

RUN = "INSERT INTO runs (agent_profile_id, task_id, reason, requested_at) VALUES ('agent', %s, 'r', 0)"


@pytest.fixture
def url(pg_url: str) -> Iterator[str]:
    """A migrated database with workflow wf and tasks a and b."""
    conn = postgres.connect(pg_url)
    try:
        pg_schema.migrate(conn)
    finally:
        conn.close()
    with psycopg.connect(pg_url, autocommit=True) as raw:
        raw.execute(
            "INSERT INTO workflows (id, name, source, definition, registered_at)"
            " VALUES ('wf', 'wf', '', '{}', 0)"
        )
        raw.execute(
            "INSERT INTO tasks (id, workflow_id, workflow_step_id, created_at, updated_at)"
            " VALUES ('a', 'wf', 's', 0, 0), ('b', 'wf', 's', 0, 0)"
        )
    yield pg_url


def _count(conn: psycopg.Connection[tuple[object, ...]], task: str) -> int:
    row = conn.execute("SELECT count(*) FROM runs WHERE task_id = %s", [task]).fetchone()
    assert row is not None
    return int(row[0])


def test_a_run_of_a_missing_task_is_refused_with_the_constraints_error(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RUN, [None])  # a run of no task is fine
        with pytest.raises(psycopg.errors.ForeignKeyViolation) as refused:
            conn.execute(
                "INSERT INTO runs (agent_profile_id, task_id, reason, requested_at)"
                " VALUES ('agent', 'a', 'r', 0), ('agent', 'zz', 'r', 0), ('agent', 'b', 'r', 0)"
            )
        assert refused.value.diag.constraint_name == "runs_task_id_fkey"
        assert refused.value.diag.message_detail == 'Key (task_id)=(zz) is not present in table "tasks".'
        assert _count(conn, "a") == 0  # the whole statement failed
        conn.execute(RUN, ["a"])
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute("UPDATE runs SET task_id = 'zz' WHERE task_id = 'a'")
        conn.execute("UPDATE runs SET task_id = 'b' WHERE task_id = 'a'")
        assert _count(conn, "b") == 1


def test_deleting_a_task_deletes_its_runs_and_what_refers_to_them(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RUN, ["a"])
        conn.execute(RUN, ["b"])
        conn.execute(
            "INSERT INTO coalesced_keys (idempotency_key, run_id, seen_at)"
            " SELECT 'k', id, 0 FROM runs WHERE task_id = 'a'"
        )
        conn.execute("DELETE FROM tasks WHERE id = 'a'")
        assert (_count(conn, "a"), _count(conn, "b")) == (0, 1)
        assert conn.execute("SELECT count(*) FROM coalesced_keys").fetchone() == (0,)


def test_the_id_of_a_task_with_runs_cannot_change(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RUN, ["a"])
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute("UPDATE tasks SET id = 'c' WHERE id = 'a'")
        conn.execute("UPDATE tasks SET id = 'c' WHERE id = 'b'")  # no run refers to it


def _in_thread(url: str, sql: str, params: list[object]) -> tuple[threading.Thread, list[BaseException]]:
    """Run `sql` in its own session on a thread; what it raised lands in the list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SET lock_timeout = 10000")
                conn.execute(sql, params)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _waits_for_a_lock(url: str, sql: str) -> bool:
    """Whether a session running `sql` (its first three words) waits for a lock, within 5 s."""
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(100):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                [" ".join(sql.split()[:3]) + "%"],
            ).fetchone()
            if row is not None and row[0] == 1:
                return True
            time.sleep(0.05)
    return False


def test_a_task_deleted_while_a_run_of_it_commits_waits_for_it_and_takes_the_run_along(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as inserting:
        inserting.execute("BEGIN")
        inserting.execute(RUN, ["a"])
        delete = "DELETE FROM tasks WHERE id = %s"
        thread, errors = _in_thread(url, delete, ["a"])
        assert _waits_for_a_lock(url, delete)  # the insert's lock on its task
        inserting.execute("COMMIT")
        thread.join(10)
        assert not thread.is_alive() and errors == []
        assert _count(inserting, "a") == 0


def test_a_run_of_a_task_being_deleted_fails_once_the_delete_commits(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as deleting:
        deleting.execute("BEGIN")
        deleting.execute("DELETE FROM tasks WHERE id = 'a'")
        thread, errors = _in_thread(url, RUN, ["a"])
        assert _waits_for_a_lock(url, RUN)
        deleting.execute("COMMIT")
        thread.join(10)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], psycopg.errors.ForeignKeyViolation)
        assert _count(deleting, "a") == 0
