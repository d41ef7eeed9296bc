"""`request_savepoint`: the common entry's block rolled back to the writer's own per-request savepoint.

The writer's fast path for the common entry (its savepoint is the request's, two statements
fewer per entry); and after an error that ended the transaction nothing more is executed).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from onceflow.store.backends import faults
from onceflow.store.backends.savepoint import REQUEST_SAVEPOINT, request_savepoint


def open_request(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE t (x INTEGER)")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(f"SAVEPOINT {REQUEST_SAVEPOINT}")
    return conn


def rows(conn: sqlite3.Connection) -> list[tuple[int]]:
    return conn.execute("SELECT x FROM t ORDER BY x").fetchall()


def test_request_savepoint_keeps_the_block_that_returns(tmp_path: Path) -> None:
    conn = open_request(tmp_path / "db")
    with request_savepoint(conn):
        conn.execute("INSERT INTO t VALUES (1)")
    conn.execute(f"RELEASE {REQUEST_SAVEPOINT}")
    conn.execute("COMMIT")
    assert rows(conn) == [(1,)]


def test_request_savepoint_rolls_back_a_raising_block_and_the_request_goes_on(tmp_path: Path) -> None:
    conn = open_request(tmp_path / "db")
    with pytest.raises(ValueError, match="anomaly"), request_savepoint(conn):
        conn.execute("INSERT INTO t VALUES (1)")
        raise ValueError("anomaly")
    assert conn.in_transaction and rows(conn) == []
    conn.execute("INSERT INTO t VALUES (2)")  # the request's savepoint is still open: it goes on writing
    conn.execute(f"RELEASE {REQUEST_SAVEPOINT}")
    conn.execute("COMMIT")
    assert rows(conn) == [(2,)]


def test_request_savepoint_touches_nothing_after_the_transaction_ended(tmp_path: Path) -> None:
    """A block that ended the transaction: its error propagates untouched (no ROLLBACK TO on a connection
    with no transaction); a block that returns with the transaction gone fails, never kept silently."""
    conn = open_request(tmp_path / "db")
    with pytest.raises(ValueError, match="gone"), request_savepoint(conn):
        conn.execute("ROLLBACK")
        raise ValueError("gone")
    assert not conn.in_transaction
    conn = open_request(tmp_path / "db2")
    with pytest.raises(faults.DatabaseFault, match="transaction ended"), request_savepoint(conn):
        conn.execute("ROLLBACK")
