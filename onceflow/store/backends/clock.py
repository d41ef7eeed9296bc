"""Which clock a statement judges by, and the clamps that make times written under another clock safe.
Writer thread: every function runs inside the caller's transaction.

The rule (docs/guarantees.md, "Time"):
- On SQLite a statement judges by the `now` its caller passes: the runtime's clock (actors/kernel/clock.py),
  anchored to the wall clock when the runtime opened and advanced by Trio's monotonic clock since.
- On PostgreSQL every lease, expiry and age decision reads the database server's clock in the statement
  itself (`SERVER_CLOCK`, the function `onceflow_clock()`: `EXTRACT(EPOCH FROM clock_timestamp())`), so
  runtimes whose own clocks disagree agree on every lease; a decision a function makes in Python reads
  that clock once (`judge`). The runtimes' clocks are anchored to the server's, so the times they stamp
  share its base.
- A time written under an earlier anchor (before a restart) or before the server's clock stepped back may
  lie in the future. Such a time is trusted only so far (`clamp_restart`, at every open; `clamp_leases`,
  at every lease sweep): a lease ends at most its own `wait_seconds` from now, a retry waits at most its
  own delay from now, and a stamp of something that happened (a request, a claim, a finish, a key seen)
  is at most now. A time in the past is never moved: a clock that stepped forward across a restart ends
  what it ends.
"""

from __future__ import annotations

import attrs

from onceflow.store.backends.connection import Connection
from onceflow.store.backends.urls import on_postgres

SERVER_CLOCK = "onceflow_clock()"
"""The database server's clock in a PostgreSQL statement, Unix seconds (store/backends/pg_schema.py creates
it)."""


@attrs.frozen
class Clocked:
    """A statement that judges by a time: in `template`, `{now}` stands for it. On SQLite it is the numbered
    parameter `param` (the caller's `now`); on PostgreSQL the server's clock, and that parameter goes
    unused (store/backends/postgres.py sends only the parameters a statement names). Number every parameter of
    such a statement (`?1`, `?2`, ...)."""

    sqlite: str
    postgres: str

    @classmethod
    def of(cls, template: str, param: str) -> Clocked:
        """`template` with `{now}` read from `param` on SQLite, from `SERVER_CLOCK` on PostgreSQL."""
        return cls(template.format(now=param), template.format(now=SERVER_CLOCK))

    def on(self, conn: Connection) -> str:
        """The statement's text for `conn`'s backend."""
        return self.postgres if on_postgres(conn) else self.sqlite


def server_time(conn: Connection) -> float | None:
    """The database server's clock (Unix seconds) on PostgreSQL; None on SQLite, which has no clock of
    its own (the runtime's is the judge)."""
    if not on_postgres(conn):
        return None
    (now,) = conn.execute(f"SELECT {SERVER_CLOCK}").fetchone()
    return float(now)


def judge(conn: Connection, now: float) -> float:
    """The time a decision made in Python judges by: the server's clock on PostgreSQL, else `now`."""
    server = server_time(conn)
    return now if server is None else server


_LEASES = Clocked.of(
    "UPDATE runs SET lease_expires_at = {now} + wait_seconds WHERE status = 'claimed'"
    " AND lease_expires_at > {now} AND lease_expires_at > {now} + wait_seconds",
    "?1",
)
_RETRIES = Clocked.of(
    "UPDATE runs SET retry_at = {now} + wait_seconds"
    " WHERE status = 'queued' AND retry_at > {now} + wait_seconds",
    "?1",
)
_RUN_STAMPS = Clocked.of(
    "UPDATE runs SET"
    " requested_at = CASE WHEN requested_at > {now} THEN {now} ELSE requested_at END,"
    " claimed_at = CASE WHEN claimed_at > {now} THEN {now} ELSE claimed_at END,"
    " finished_at = CASE WHEN finished_at > {now} THEN {now} ELSE finished_at END"
    " WHERE requested_at > {now} OR claimed_at > {now} OR finished_at > {now}",
    "?1",
)
_KEY_STAMPS = Clocked.of("UPDATE coalesced_keys SET seen_at = {now} WHERE seen_at > {now}", "?1")


def clamp_leases(conn: Connection, now: float) -> int:
    """Cut every lease that ends more than its own `wait_seconds` after now (on SQLite `now`, on
    PostgreSQL the server's clock) to end then; how many were cut. A lease granted before a restart whose
    wall clock went back, or before the server's clock stepped back, so ends when a lease granted now would,
    never an hour later. Runs over the live leases only (`runs_leases`)."""
    return conn.execute(_LEASES.on(conn), (now,)).rowcount


@attrs.frozen
class Clamped:
    """What `clamp_restart` moved: leases cut, retries brought forward, runs and keys whose stamps lay in
    the future."""

    leases: int
    retries: int
    runs: int
    keys: int

    @property
    def total(self) -> int:
        return self.leases + self.retries + self.runs + self.keys


def clamp_restart(conn: Connection, now: float) -> Clamped:
    """At open, trust no runs-queue time written under an earlier clock beyond now (module docstring):
    leases and retries end at most their own wait from now, stamps of what happened lie at most at now.
    Reads the runs and coalesced keys once (a time ahead of now has no index to find it by)."""
    leases = clamp_leases(conn, now)
    retries = conn.execute(_RETRIES.on(conn), (now,)).rowcount
    stamped = conn.execute(_RUN_STAMPS.on(conn), (now,)).rowcount
    keys = conn.execute(_KEY_STAMPS.on(conn), (now,)).rowcount
    return Clamped(leases, retries, stamped, keys)
