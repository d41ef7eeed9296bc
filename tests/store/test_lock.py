"""The database ownership lock: one runtime per database file, across threads of one process and processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from onceflow.store.lock import DatabaseOwnedError, acquire_database_lock

# Runs in a second process: try the same lock, report the outcome on stdout.
CHILD = """
import sys
from pathlib import Path
from onceflow.store.lock import DatabaseOwnedError, acquire_database_lock
try:
    acquire_database_lock(Path(sys.argv[1])).release()
except DatabaseOwnedError as exc:
    print("owned:", exc)
else:
    print("acquired")
"""


def run_child(db_path: Path) -> str:
    # Same import path as this process; cwd elsewhere so the checkout's top-level dirs cannot shadow it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(db_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=db_path.parent,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]  # structlog may print above the verdict


def test_lock_writes_pid_and_clears_it_on_release(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    lock = acquire_database_lock(db)
    assert lock.lock_path == tmp_path / "o.db.lock"
    assert lock.lock_path.read_text().strip() == str(os.getpid())
    lock.release()
    lock.release()  # idempotent
    assert lock.lock_path.read_text() == ""


def test_second_acquire_in_same_process_conflicts(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with acquire_database_lock(db):
        with pytest.raises(DatabaseOwnedError, match="already owned by another onceflow runtime") as info:
            acquire_database_lock(db)
        message = str(info.value)
        assert str(db) in message
        assert f"pid {os.getpid()}" in message
    with acquire_database_lock(db):  # released on leaving the block
        pass


def test_other_process_is_refused_while_held_and_admitted_after(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with acquire_database_lock(db):
        out = run_child(db)
        assert out.startswith("owned:")
        assert "already owned by another onceflow runtime" in out
        assert f"pid {os.getpid()}" in out
    assert run_child(db) == "acquired"
