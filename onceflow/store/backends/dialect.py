"""The two SQL dialects the store speaks, and statements written once per dialect where they differ. Pure:
asked on the writer thread (and at import, where the statement tables are built).

Most statements are the same text on both backends: written once, with SQLite's `?` / `?NNN` placeholders,
which the PostgreSQL connection maps to psycopg's `%s` (store/backends/postgres.py; the parameter style is
the one thing it changes, nothing else in a statement's text). Where the dialects differ, a statement is
written in both forms side by side, as an `Sql` pair built at import from the few `Dialect` forms below:

- a JSON array parameter as rows (`json_rows`): SQLite's `json_each(?)`, PostgreSQL's
  `json_array_elements(_text)` with its 0-based ordinality as `key`;
- a NULL-safe comparison with a parameter (`same` / `differs`): `IS ?` / `IS NOT DISTINCT FROM ?`;
- a join whose order is fixed (`join`): SQLite's `CROSS JOIN ... ON` (its planner keeps the order), a plain
  `JOIN ... ON` on PostgreSQL (whose CROSS JOIN takes no ON);
- the write transaction's start (`begin`): `BEGIN IMMEDIATE` / `BEGIN`.

Upserts (`ON CONFLICT`) and `RETURNING` are written once: both backends take them. Times that PostgreSQL
reads from its own clock are `clock.Clocked` pairs (store/backends/clock.py); PostgreSQL-only statements
(row locks, `= ANY(array)`, advisory locks) are written where they are used, behind `on_postgres`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs

from onceflow.store.backends.connection import Connection


@attrs.frozen
class Dialect:
    """The forms of one backend's SQL that differ from the other's (module docstring)."""

    name: Literal["sqlite", "postgresql"]
    begin: str
    """The statement that starts the writer's transaction (taking SQLite's write lock at once)."""
    join: str
    """A join written `a {join} b ON ...` whose order SQLite must keep: CROSS JOIN on SQLite, JOIN on
    PostgreSQL."""
    same: str
    """NULL-safe equality with what follows (`x {same} ?`)."""
    differs: str
    """NULL-safe inequality with what follows (`x {differs} ?`)."""

    @property
    def postgres(self) -> bool:
        return self.name == "postgresql"

    def json_rows(self, param: str, alias: str = "_each", *, scalars: bool = False) -> str:
        """A FROM item: the elements of the JSON array parameter `param` (`?3`) as rows `(key, value)` named
        `alias`, `key` the 0-based index. `scalars`: `value` is compared as text (an array of strings);
        else it is JSON, read into with `->>` (both backends' operator)."""
        if not self.postgres:
            return f"json_each({param}) AS {alias}"
        each = "json_array_elements_text" if scalars else "json_array_elements"
        return (
            f"(SELECT value, ordinality - 1 AS key FROM {each}(CAST({param} AS json))"
            f" WITH ORDINALITY AS _e (value, ordinality)) AS {alias}"
        )


SQLITE = Dialect("sqlite", "BEGIN IMMEDIATE", "CROSS JOIN", "IS", "IS NOT")
POSTGRES = Dialect("postgresql", "BEGIN", "JOIN", "IS NOT DISTINCT FROM", "IS DISTINCT FROM")


def dialect_of(conn: object) -> Dialect:
    """The dialect of an open store connection: `PgConnection.dialect`, else SQLite's (a sqlite3 connection,
    or a wrapper around one)."""
    dialect = getattr(conn, "dialect", SQLITE)
    return dialect if isinstance(dialect, Dialect) else SQLITE


@attrs.frozen
class Sql:
    """One statement in both dialects, side by side; `on(conn)` picks the text for `conn`'s backend."""

    sqlite: str
    postgres: str

    @classmethod
    def of(cls, make: Callable[[Dialect], str]) -> Sql:
        """The statement `make` writes for each dialect (called twice, at import)."""
        return cls(make(SQLITE), make(POSTGRES))

    def on(self, conn: Connection) -> str:
        """The statement's text for `conn`'s backend."""
        return self.postgres if dialect_of(conn).postgres else self.sqlite
