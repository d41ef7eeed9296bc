"""The OS lock that makes one onceflow runtime the sole owner of a database file.

Exactly one runtime owns a database at a time; a second one fails at once rather than waiting
(on-enter-action-dispatch.md, "Epoch": the ownership lock is what makes an epoch other than ours
definitionally stale). The lock is `flock(LOCK_EX | LOCK_NB)` on the sidecar file `<db path>.lock`, which
holds the owner's pid for the error message. flock locks belong to an open file description, so a second
acquire inside the same process conflicts too. The sidecar is never deleted: unlinking it on release would let
two later runtimes lock two different inodes of the same name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from types import TracebackType

from onceflow.logs import get_logger

log = get_logger(__name__)


class DatabaseOwnedError(RuntimeError):
    """Another onceflow runtime (in this process or another) holds the database's lock file."""


class DatabaseLock:
    """A held lock on `<db_path>.lock`. Release it with `release()` or by leaving its `with` block.

    `db_path` is the database file, `lock_path` the sidecar holding the lock. Releasing twice is harmless.
    """

    def __init__(self, db_path: Path, lock_path: Path, fd: int) -> None:
        self.db_path = db_path
        self.lock_path = lock_path
        self._fd: int | None = fd

    def release(self) -> None:
        """Clear the pid and drop the lock (closing the descriptor releases the flock)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        log.debug("database_lock_released", path=str(self.db_path))

    def __enter__(self) -> DatabaseLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def acquire_database_lock(db_path: Path) -> DatabaseLock:
    """Take exclusive ownership of `db_path` for this runtime, without waiting.

    Creates `<db_path>.lock` if missing (its directory must exist) and writes this process's pid into it.

    Raises:
        DatabaseOwnedError: the lock is held by another runtime; the message names the database path and
            the owner's pid when the lock file has one.
        OSError: the lock file cannot be opened or locked for any other reason.
    """
    lock_path = db_path.with_name(db_path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read_pid(fd)
        os.close(fd)
        who = f" (pid {owner})" if owner is not None else ""
        raise DatabaseOwnedError(
            f"database {db_path} is already owned by another onceflow runtime{who}; lock file {lock_path}"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    log.debug("database_lock_acquired", path=str(db_path), pid=os.getpid())
    return DatabaseLock(db_path, lock_path, fd)


def _read_pid(fd: int) -> int | None:
    # The owner may not have written its pid yet (or wrote it elsewhere); absence is not an error.
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None
