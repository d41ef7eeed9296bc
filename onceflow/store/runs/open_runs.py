"""How many runs are queued and claimed, per agent profile: what the `onceflow.runs.queued` and
`onceflow.runs.claimed` gauges show (onceflow/observability/metrics.py). Writer thread: runs inside the
caller's transaction.

One grouped count over the unresolved runs, which the partial index `runs_open_by_agent` holds (resolved
history is not read), on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

from onceflow.store.backends.connection import Connection


def count_open_runs(conn: Connection) -> dict[tuple[str, str], int]:
    """{(status, agent_profile_id): runs} for the statuses queued and claimed (a pair with no run is
    absent)."""
    rows = conn.execute(
        "SELECT status, agent_profile_id, COUNT(*) FROM runs WHERE status IN ('queued', 'claimed')"
        " GROUP BY status, agent_profile_id"
    ).fetchall()
    return {(str(status), str(agent)): int(count) for status, agent, count in rows}
