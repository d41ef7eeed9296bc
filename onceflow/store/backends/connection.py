"""The database connection every store function is given: the part of `sqlite3.Connection` the store uses.

Both backends satisfy it: `sqlite3.Connection` itself, and `store.backends.postgres.PgConnection` (psycopg 3
behind the same calls; its errors are psycopg's, and its storage faults `faults.DatabaseFault`). Where the
two dialects' SQL differs, store/backends/dialect.py has both forms. Store functions run on the writer
thread inside the writer's transaction; they never BEGIN, COMMIT or ROLLBACK themselves (savepoints are
theirs to use).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol


class Cursor(Protocol):
    """One statement's answer: its rows and how many rows it changed (an INSERT's generated id comes back
    through its own `RETURNING`)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What a store function may call on its connection. `text_factory` may be set to `bytes` to read text
    undecoded (restore it afterwards); `in_transaction` is False once an error ended the transaction."""

    text_factory: Any

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor: ...

    def close(self) -> None: ...


def scalar(conn: Connection, sql: str, parameters: Sequence[Any] = ()) -> Any:
    """The first column of the first row `sql` answers (None when it answers no row)."""
    row = conn.execute(sql, parameters).fetchone()
    return None if row is None else row[0]
