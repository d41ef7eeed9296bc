"""A real full disk mid fan-out commits nothing, and a retry once space returns is exact.

Two real limits: a file-size limit (`RLIMIT_FSIZE`) in a child process, which every OS user can set, and,
where the test may mount one (root), a size-capped tmpfs volume filled to the last byte. The in-process
variant with `max_page_count` is in tests/store/test_storage_faults.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import FakeClock, ok, send
from storage_support import REVIEWERS, assert_reviewed_once, board, small_cache, state

from onceflow.actors.runtime.startup import open_runtime

CHILD = Path(__file__).with_name("storage_full_child.py")


def stored(db: Path) -> dict[str, int]:
    """Row counts read straight from the file by a fresh connection, after the runtime has closed."""
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("runs", "decisions", "step_entries")
        }
    finally:
        conn.close()


def test_file_size_limit_mid_fanout_commits_nothing_and_retry_is_exact(tmp_path: Path) -> None:
    db = tmp_path / "board.db"
    child = subprocess.run(
        [sys.executable, str(CHILD), str(db)], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report: dict[str, Any] = json.loads(child.stdout)
    before = report["before"]
    assert before["task"]["step_id"] == "work" and len(before["decisions"]) == 1 and before["runs"] == []

    for attempt in report["attempts"]:
        reply = attempt["reply"]
        assert not reply["ok"], attempt["headroom"]
        # EFBIG after a short write is SQLITE_IOERR_WRITE (ENOSPC would be SQLITE_FULL): typed, retryable.
        assert reply["error"]["code"] in ("storage_io", "storage_full") and reply["error"]["retryable"], reply
        assert attempt["state"] == before, f"a partial commit with {attempt['headroom']} bytes to spare"

    assert report["retry"]["ok"], report["retry"]
    assert_reviewed_once(report["after_retry"])
    assert stored(db) == {"runs": len(REVIEWERS), "decisions": 0, "step_entries": 1}


@contextlib.contextmanager
def small_volume(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where`; skips the test where mounting is not permitted."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-capped tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(volume: Path, leave: int) -> Path:
    """Grow a filler file until the volume is full (ENOSPC), then give `leave` bytes back; return it."""
    filler = volume / "filler"
    with filler.open("ab", buffering=0) as out:
        for chunk in (b"\0" * 4096, b"\0"):
            with contextlib.suppress(OSError):
                while True:
                    out.write(chunk)
    os.truncate(filler, filler.stat().st_size - leave)
    return filler


async def test_full_volume_mid_fanout_answers_storage_full_commits_nothing_and_retry_is_exact(
    tmp_path: Path, clock: FakeClock
) -> None:
    with small_volume(tmp_path / "volume", "4m") as volume:
        db = volume / "board.db"
        async with open_runtime(db, clock=clock) as rt:
            await board(rt)
            before = await state(rt)
            await rt.services.store.transact(small_cache)
            wal = Path(f"{db}-wal")
            end = wal.stat().st_size  # each attempt writes from here: a failed one left no frame
            for leave in (0, 40 * 1024, 80 * 1024, 120 * 1024):  # at the first spill, then mid fan-out
                # The WAL file keeps the space a failed attempt grew it by: count that as given back.
                filler = fill(volume, max(0, leave - (wal.stat().st_size - end)))
                reply = await send(rt, {"type": "turn_complete", "task_id": "T1"})
                assert not reply.ok and reply.error is not None
                assert (reply.error.code, reply.error.retryable) == ("storage_full", True), reply.error
                assert await state(rt) == before, f"a partial commit with {leave} bytes to spare"

            filler.unlink()  # space returns
            await ok(rt, {"type": "turn_complete", "task_id": "T1"})
            assert_reviewed_once(await state(rt))
        assert stored(db) == {"runs": len(REVIEWERS), "decisions": 0, "step_entries": 1}
