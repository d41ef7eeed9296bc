"""Digests kept once (`digests`, migration 23): a step entry's declaration digest
(store/entries/step_entries.py) and an on_enter run's config digest (store/runs/keys.py) are stored as the id
of their row, since every entry of one declaration, and every run of one action config, carries the same
hex. Writer thread: every function runs inside the caller's transaction.

A row is never deleted (one per declaration or action config ever seen: a handful per template), so an id
read back always names its digest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from onceflow.store.backends.connection import Connection
from onceflow.store.backends.dialect import Sql

_KEEP = Sql.of(
    lambda d: (
        f"INSERT INTO digests (digest) SELECT value ->> 0 FROM {d.json_rows('?1')} WHERE true"
        " ON CONFLICT (digest) DO NOTHING"
    )
)


_KEEP_ONE = "INSERT INTO digests (digest) VALUES (?) ON CONFLICT (digest) DO NOTHING"


def keep(conn: Connection, digests: Iterable[str]) -> None:
    """Give each of `digests` its row unless it has one (ids for `id_sql` to find), one statement each, in
    their order (the same text on both backends)."""
    for digest in dict.fromkeys(digests):
        conn.execute(_KEEP_ONE, (digest,))


def rows(digests: Iterable[str]) -> str:
    """`keep`'s parameter for `digests`, for a caller that builds it once (a plan); kept in this order (on
    PostgreSQL two runtimes keeping the same new digests wait for each other: a caller keeping several
    gives them in one order, a declaration's before its config digests, sorted)."""
    return json.dumps([[digest] for digest in dict.fromkeys(digests)])


def keep_rows(conn: Connection, prepared: str) -> None:
    """`keep` of a parameter made by `rows`."""
    conn.execute(_KEEP.on(conn), (prepared,))


def id_sql(digest_sql: str) -> str:
    """SQL for the id of the digest `digest_sql` (an SQL expression); NULL when it has no row."""
    return f"(SELECT dg.id FROM digests AS dg WHERE dg.digest = {digest_sql})"


def text_sql(id_sql_: str) -> str:
    """SQL for the digest whose id is `id_sql_` (an SQL expression)."""
    return f"(SELECT dg.digest FROM digests AS dg WHERE dg.id = {id_sql_})"
