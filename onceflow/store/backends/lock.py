"""The OS lock that makes one onceflow runtime the sole owner of a database file, whatever its name. Either
thread: taken by `open_store` before the writer starts.

Exactly one runtime owns a database at a time; a second one fails at once rather than waiting
(on-enter-action-dispatch.md, "Epoch": the ownership lock is what makes an epoch other than ours
definitionally stale). Ownership is keyed by the file's identity, not its name: a lock on a sidecar
`<db>.lock` let a hard link to a live database open a second owner, with its own WAL, whose writes the first
owner then lost. The lock is `flock(LOCK_EX | LOCK_NB)` on a descriptor of the database file itself, so every
name of the file (hard link, symlink, another relative path) meets the same lock.

Why flock and not fcntl: SQLite locks the same file with POSIX fcntl locks, and on Linux flock and fcntl
locks are independent, so ours never blocks SQLite's. POSIX locks have one trap: closing *any* descriptor of
the file drops every fcntl lock the process holds on it. So a process never opens (and closes) a descriptor
of a database it already owns: this module remembers the (device, inode) of every database the process
owns and refuses a second acquire from that table before opening anything. flock locks belong to an open
file description, so a second process is refused by the kernel. onceflow's own connection is always closed
before its descriptor; a host that keeps sqlite3 connections of its own to the file in the same process
should know that closing ours (at release, or after a refused acquire) drops their fcntl locks, as closing
any descriptor of the file does (sqlite.org, "How To Corrupt An SQLite Database File", 2.2).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from pathlib import Path
from types import TracebackType

from onceflow.observability.logs import get_logger

log = get_logger(__name__)

_Identity = tuple[int, int]  # (st_dev, st_ino)


class DatabaseOwnedError(RuntimeError):
    """Another onceflow runtime (in this process or another) owns the database file."""


class DatabaseLock:
    """A held lock on the database file `db_path`. Release it with `release()` or by leaving its `with` block.

    `identity` is the file's (device, inode). Releasing twice is harmless. Release only once the database's
    SQLite connection is closed (closing our descriptor drops this process's fcntl locks on the file).
    """

    def __init__(self, db_path: Path, identity: _Identity, fd: int) -> None:
        self.db_path = db_path
        self.identity = identity
        self._fds = [fd]

    def release(self) -> None:
        """Forget the ownership and close the descriptors (closing the last one releases the flock)."""
        with _owned_guard:
            if _owned.get(self.identity) is self:
                del _owned[self.identity]
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        if fds:
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


_owned: dict[_Identity, DatabaseLock] = {}
"""Every database this process owns, by (device, inode)."""
_owned_guard = threading.Lock()


def acquire_database_lock(db_path: Path) -> DatabaseLock:
    """Take exclusive ownership of the database file `db_path`, without waiting.

    Creates the file, empty, if missing (SQLite treats an empty file as a new database); its directory must
    exist. Every name of one file shares one lock: a hard link or symlink to an owned database is refused.

    Raises:
        DatabaseOwnedError: another runtime owns the file; the message names `db_path` and the owner's pid
            when it can be found (this process, or Linux's /proc/locks).
        OSError: the file cannot be opened (a missing directory, a directory, no permission), is not a
            regular file, or cannot be locked for another reason.
    """
    with _owned_guard:
        with contextlib.suppress(FileNotFoundError):
            before = os.stat(db_path)
            if (before.st_dev, before.st_ino) in _owned:  # checked before opening: see the module docstring
                raise _owned_error(db_path, os.getpid())
        fd = os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            opened = os.fstat(fd)
            identity = (opened.st_dev, opened.st_ino)
            owner = _owned.get(identity)
            if owner is not None:  # the name was pointed at a file we own between stat and open
                owner._fds.append(fd)  # never close it while the owner's SQLite holds fcntl locks
                raise _owned_error(db_path, os.getpid())
            if not stat.S_ISREG(opened.st_mode):
                raise OSError(f"{db_path} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _owned_error(db_path, _flock_owner(identity)) from None
        except DatabaseOwnedError:
            raise
        except BaseException:
            os.close(fd)
            raise
        lock = _owned[identity] = DatabaseLock(db_path, identity, fd)
    log.debug("database_lock_acquired", path=str(db_path), pid=os.getpid())
    return lock


def _owned_error(db_path: Path, pid: int | None) -> DatabaseOwnedError:
    who = f" (pid {pid})" if pid is not None else ""
    return DatabaseOwnedError(f"database {db_path} is already owned by another onceflow runtime{who}")


def _flock_owner(identity: _Identity) -> int | None:
    """The pid holding a flock on the file, from /proc/locks (Linux); None when it cannot be told."""
    device, inode = identity
    wanted = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/locks", encoding="ascii") as locks:
        for line in locks:
            fields = line.split()
            if fields[1] == "FLOCK" and fields[5] == wanted:  # "N: FLOCK ADVISORY WRITE pid dev:ino ..."
                return int(fields[4])
    return None
