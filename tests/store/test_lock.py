"""The database ownership lock: one runtime per database file, across threads of one process and processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from onceflow.store.backends.lock import DatabaseOwnedError, acquire_database_lock

# Runs in a second process: try the same lock, report the outcome on stdout.
CHILD = """
import sys
from pathlib import Path
from onceflow.store.backends.lock import DatabaseOwnedError, acquire_database_lock
try:
    acquire_database_lock(Path(sys.argv[1])).release()
except DatabaseOwnedError as exc:
    print("owned:", exc)
else:
    print("acquired")
"""


def run_child(db_path: Path) -> str:
    """Try the lock on `db_path` (unresolved) from another process; "acquired" or "owned: <message>"."""
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


def test_the_lock_is_on_the_database_file_itself_and_released_on_release(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    lock = acquire_database_lock(db)
    assert db.is_file() and db.stat().st_size == 0  # created empty: SQLite reads it as a new database
    assert lock.identity == (db.stat().st_dev, db.stat().st_ino)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.db"]  # no sidecar file
    lock.release()
    lock.release()  # idempotent
    with acquire_database_lock(db):
        pass


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


def other_names(db: Path) -> list[Path]:
    """A hard link, a symlink and a roundabout relative spelling of `db`, all one file."""
    linked, symlinked = db.with_name("linked.db"), db.with_name("symlinked.db")
    os.link(db, linked)
    symlinked.symlink_to(db.name)
    (db.parent / "sub").mkdir()
    return [linked, symlinked, db.parent / "sub" / ".." / db.name]


def test_every_name_of_an_owned_database_is_refused_in_process(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with acquire_database_lock(db):
        names = other_names(db)
        for name in names:
            with pytest.raises(DatabaseOwnedError, match="already owned") as info:
                acquire_database_lock(name)
            assert str(name) in str(info.value)
            assert f"pid {os.getpid()}" in str(info.value)
    for name in names:  # released: every name is free again
        with acquire_database_lock(name):
            pass


def test_every_name_of_an_owned_database_is_refused_from_another_process(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with acquire_database_lock(db):
        names = other_names(db)
        for name in names:
            out = run_child(name)
            assert out.startswith("owned:"), (name, out)
            assert "already owned by another onceflow runtime" in out
    assert [run_child(name) for name in names] == ["acquired"] * len(names)
