"""What names a database: a SQLite file path, or a `postgresql://` URL; and which one a connection is. Pure.

Kept apart from store/backends/postgres.py so that telling the two apart never imports psycopg: a SQLite
runtime never loads it.
"""

from __future__ import annotations

import re
from pathlib import Path


def is_postgres_url(target: object) -> bool:
    """Whether `target` names a PostgreSQL database (`postgresql://…` or `postgres://…`), not a file."""
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def on_postgres(conn: object) -> bool:
    """Whether an open store connection is PostgreSQL's (`PgConnection.dialect`, store/backends/dialect.py),
    not SQLite's: a wrapped sqlite3 connection stays SQLite."""
    return getattr(getattr(conn, "dialect", None), "name", "sqlite") == "postgresql"


def redacted(url: str) -> str:
    """`url` with any password replaced by `***`, for logs and error messages."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def database_arg(text: str) -> Path | str:
    """An argparse `type` for `--db`: a PostgreSQL URL as given, anything else as a file `Path` (a URL
    through `Path` would lose its `//`)."""
    return text if is_postgres_url(text) else Path(text)
