"""A named SAVEPOINT as a context manager: the block's writes are rolled back if it raises. Writer thread.

Used where one part of a transaction may fail on its own without undoing the rest (one action of a segment,
a two-write enqueue). The exception still propagates; only the block's writes are undone. When the error
ended the whole transaction (`faults.ends_transaction`) there is no savepoint left to roll back to: the
exception propagates untouched and nothing more is executed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.urls import on_postgres


@contextmanager
def savepoint(conn: Connection, name: str) -> Iterator[None]:
    """Run the block inside `SAVEPOINT name`; ROLLBACK TO and RELEASE it if the block raises, RELEASE it
    if not.

    Raises:
        whatever the block raised; after an error that ended the transaction, without touching `conn`.
        faults.DatabaseFault: (aborted) the block returned but the transaction is gone (an error inside it
            was swallowed after SQLite rolled everything back), so its writes cannot be kept.
    """
    conn.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException as exc:
        if not faults.ends_transaction(conn, exc):
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
        raise
    if not conn.in_transaction:
        raise faults.DatabaseFault("aborted", f"the transaction ended inside savepoint {name}")
    conn.execute(f"RELEASE {name}")


@contextmanager
def undone_alone(conn: Connection, name: str) -> Iterator[None]:
    """For a block that is atomic by itself on SQLite (one statement, or its own savepoint) whose error the
    caller catches and goes on from: nothing more on SQLite, where a failed statement undoes only itself and
    the transaction goes on; `savepoint(conn, name)` on PostgreSQL, where any error aborts the whole
    transaction until it is rolled back to a savepoint (so the same rules hold on both backends).

    Raises:
        whatever the block raised (on PostgreSQL after rolling back to the savepoint).
    """
    if not on_postgres(conn):
        yield
        return
    with savepoint(conn, name):
        yield


REQUEST_SAVEPOINT = "request"
"""The savepoint `StoreActor` opens around every request (store/writer.py, `_commit`)."""


class request_savepoint:  # lower case: used like the function `savepoint`
    """Like `savepoint`, but rolling back to the writer's own per-request savepoint instead of opening one:
    two statements fewer on the common entry's fast path. Only for a block that is the first write of its
    request: a rollback undoes everything the request wrote before it. The request's savepoint stays open
    (ROLLBACK TO keeps it), so the request goes on writing after a rollback. A class, not a generator context
    manager: it runs once per common entry in the writer thread.

    Raises:
        whatever the block raised; after an error that ended the transaction, without touching `conn`.
        faults.DatabaseFault: (aborted) the block returned but the transaction is gone.
    """

    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            if not faults.ends_transaction(self.conn, exc):
                self.conn.execute(f"ROLLBACK TO {REQUEST_SAVEPOINT}")
            return  # the exception propagates
        if not self.conn.in_transaction:
            raise faults.DatabaseFault("aborted", "the transaction ended inside the request's first block")
