"""A named SAVEPOINT as a context manager: the block's writes are rolled back if it raises.

Used where one part of a transaction may fail on its own without undoing the rest (one action of a segment,
a two-write enqueue). The exception still propagates; only the block's writes are undone.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def savepoint(conn: sqlite3.Connection, name: str) -> Iterator[None]:
    """Run the block inside `SAVEPOINT name`; ROLLBACK TO it if the block raises, RELEASE it either way."""
    conn.execute(f"SAVEPOINT {name}")
    try:
        yield
    except BaseException:
        conn.execute(f"ROLLBACK TO {name}")
        raise
    finally:
        conn.execute(f"RELEASE {name}")
