"""Flow control of the runs queue: ceilings and hourly rates (`run_limits`), pauses (`run_pauses`), the gate a
new run passes at enqueue (causation depth, self-triggers, `runs_per_hour`) and the queue's statistics.
Writer thread: every function runs inside the caller's transaction. The claim side (ceilings, pauses and
priorities at claim) is store/runs/run_claims.py's; docs/flow.md states the rules.

Every window is judged by store/backends/clock.py's rule: the caller's `now` on SQLite, the server's clock on
PostgreSQL (`{now}` in the statements).
"""

from __future__ import annotations

from typing import Literal

import attrs

from onceflow.store.backends.clock import Clocked, judge
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.urls import on_postgres

Scope = Literal["agent", "global"]
PauseScope = Literal["agent", "workflow", "task", "all"]

SELF_TRIGGERS = 3
"""The most runs one agent may queue for itself for one reason in one causation chain; the next is refused."""

RATE_WINDOW = 3600.0
"""Seconds `runs_per_hour` counts back over."""

PAUSED = (
    "EXISTS (SELECT 1 FROM run_pauses p WHERE p.scope = 'all'"
    " OR (p.scope = 'agent' AND p.target_id = runs.agent_profile_id)"
    " OR (p.scope = 'task' AND p.target_id = runs.task_id)"
    " OR (p.scope = 'workflow'"
    " AND p.target_id = (SELECT t.workflow_id FROM tasks t WHERE t.id = runs.task_id)))"
)
"""An SQL condition over a `runs` row: a pause holds it (any scope that covers it)."""


@attrs.frozen
class Limit:
    """One row of `run_limits`: `scope` agent (with its `target_id`) or global (`target_id` ""); a limit
    None is no limit."""

    scope: Scope
    target_id: str
    max_concurrent: int | None
    runs_per_hour: int | None


def set_limits(
    conn: Connection, scope: Scope, target_id: str, changes: dict[str, int | None], now: float
) -> Limit:
    """Set the limits named in `changes` (`max_concurrent`, `runs_per_hour`; None removes one) of the
    scope, keeping the other; a scope left with no limit loses its row. The values are checked by the
    command (positive integers). Returns the limits as they now stand."""
    row = conn.execute(
        "SELECT max_concurrent, runs_per_hour FROM run_limits WHERE scope = ? AND target_id = ?",
        (scope, target_id),
    ).fetchone()
    current: dict[str, int | None] = {
        "max_concurrent": None if row is None else row[0],
        "runs_per_hour": None if row is None else row[1],
    }
    current.update(changes)
    limit = Limit(scope, target_id, current["max_concurrent"], current["runs_per_hour"])
    if limit.max_concurrent is None and limit.runs_per_hour is None:
        conn.execute("DELETE FROM run_limits WHERE scope = ? AND target_id = ?", (scope, target_id))
        return limit
    conn.execute(
        "INSERT INTO run_limits (scope, target_id, max_concurrent, runs_per_hour, updated_at)"
        " VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (scope, target_id) DO UPDATE SET"
        " max_concurrent = excluded.max_concurrent, runs_per_hour = excluded.runs_per_hour,"
        " updated_at = excluded.updated_at",
        (scope, target_id, limit.max_concurrent, limit.runs_per_hour, judge(conn, now)),
    )
    return limit


def list_limits(conn: Connection) -> list[Limit]:
    """Every limit set, global first, then agents by id."""
    rows = conn.execute(
        "SELECT scope, target_id, max_concurrent, runs_per_hour FROM run_limits"
        " ORDER BY CASE scope WHEN 'global' THEN 0 ELSE 1 END, target_id"
    ).fetchall()
    return [Limit(*row) for row in rows]


@attrs.frozen
class Ceilings:
    """The ceilings a claim is held to, read (on PostgreSQL locked) in the claim's transaction: the
    agents at theirs (`full`, agent -> ceiling), and the global one when reached (`global_full`)."""

    full: dict[str, int]
    global_full: int | None = None


_CEILINGS = "SELECT scope, target_id, max_concurrent FROM run_limits WHERE max_concurrent IS NOT NULL"
_LIVE = Clocked.of("status = 'claimed' AND lease_expires_at > {now}", "?1")


def ceilings(conn: Connection, agents: list[str] | None, now: float) -> Ceilings:
    """Which of `agents` (None: every agent) are at their ceiling, and whether the global one is reached:
    live claims (claimed, lease not expired) counted against each `max_concurrent`.

    On PostgreSQL the limit rows are locked `FOR UPDATE` (in one order), so claimers of an agent with a
    ceiling, on any runtime, count and claim one after the other: a ceiling is one ceiling, not one per
    runtime. A claim with no ceiling to respect costs this one query and locks nothing."""
    postgres = on_postgres(conn)
    sql, args = _CEILINGS, list[object]()
    if agents is not None:
        marks = ", ".join(f"?{i + 1}" for i in range(len(agents)))
        sql += f" AND (scope = 'global' OR target_id IN ({marks}))"
        args.extend(agents)
    if postgres:
        sql += " ORDER BY scope, target_id FOR UPDATE"
    rows = conn.execute(sql, args).fetchall()
    if not rows:
        return Ceilings({})
    live = _LIVE.on(conn)
    found: dict[str, int] = {}
    global_full = None
    for scope, target, ceiling in rows:
        if scope == "global":
            (count,) = conn.execute(f"SELECT COUNT(*) FROM runs WHERE {live}", (now,)).fetchone()
            if int(count) >= ceiling:
                global_full = int(ceiling)
        else:
            found[str(target)] = int(ceiling)
    if not found:
        return Ceilings({}, global_full)
    marks = ", ".join(f"?{i + 2}" for i in range(len(found)))
    counts = dict(
        conn.execute(
            f"SELECT agent_profile_id, COUNT(*) FROM runs WHERE {live} AND agent_profile_id IN ({marks})"
            " GROUP BY agent_profile_id",
            (now, *found),
        ).fetchall()
    )
    full = {agent: ceiling for agent, ceiling in found.items() if int(counts.get(agent, 0)) >= ceiling}
    return Ceilings(full, global_full)


def touch_turn(conn: Connection, agent_profile_id: str) -> None:
    """Record that `agent_profile_id` was just served a run by a claim across agents: its turn becomes the
    latest (a counter, not a time, so claims in one clock tick still take turns)."""
    conn.execute(
        "INSERT INTO run_turns (agent_profile_id, turn) VALUES (?1, (SELECT COALESCE(MAX(turn), 0) + 1"
        " FROM run_turns)) ON CONFLICT (agent_profile_id) DO UPDATE SET turn = excluded.turn",
        (agent_profile_id,),
    )


# --- pauses ---------------------------------------------------------------------------------------------


@attrs.frozen
class Pause:
    """A pause: `scope` and its `target_id` ("" for all), why, and since when (Unix seconds)."""

    scope: PauseScope
    target_id: str
    reason: str
    paused_at: float


def pause(conn: Connection, scope: PauseScope, target_id: str, reason: str, now: float) -> tuple[Pause, bool]:
    """Pause the scope (its runs are not handed out until `resume`); (the pause, whether it is new). Pausing
    a paused scope keeps its first pause."""
    inserted = conn.execute(
        "INSERT INTO run_pauses (scope, target_id, reason, paused_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (scope, target_id) DO NOTHING",
        (scope, target_id, reason, judge(conn, now)),
    ).rowcount
    row = conn.execute(
        "SELECT scope, target_id, reason, paused_at FROM run_pauses WHERE scope = ? AND target_id = ?",
        (scope, target_id),
    ).fetchone()
    return Pause(*row), inserted == 1


def resume(conn: Connection, scope: PauseScope, target_id: str) -> bool:
    """Lift the scope's pause; False when it was not paused."""
    return (
        conn.execute("DELETE FROM run_pauses WHERE scope = ? AND target_id = ?", (scope, target_id)).rowcount
        == 1
    )


def list_pauses(conn: Connection) -> list[Pause]:
    """Every pause, oldest first."""
    rows = conn.execute(
        "SELECT scope, target_id, reason, paused_at FROM run_pauses ORDER BY paused_at, scope, target_id"
    ).fetchall()
    return [Pause(*row) for row in rows]


# --- the enqueue gate -----------------------------------------------------------------------------------


@attrs.frozen
class Cause:
    """What caused an enqueue: the run whose work sent the command (`parent_run_id`, None: a root), whether
    a human sent it (`human`: roots a human chain), and the deepest chain allowed (`max_depth`, None: no
    limit, for the runtime's own recovery runs); `exempt`: no limit refuses it (an operator's `retry_run`)."""

    parent_run_id: int | None = None
    human: bool = False
    max_depth: int | None = 8
    exempt: bool = False


@attrs.frozen
class Lineage:
    """Where a new run sits in its causation chain: its parent, depth (a root is 0), chain (the root run's
    id; None for a root: its own), whether a human rooted it, and whether it re-triggers its parent's
    agent (`self_trigger`)."""

    parent_run_id: int | None = None
    depth: int = 0
    chain_id: int | None = None
    human_rooted: bool = False
    self_trigger: bool = False


def lineage(conn: Connection, agent_profile_id: str, cause: Cause | None) -> Lineage:
    """The lineage of a run for `agent_profile_id` queued under `cause`. A parent no longer stored (pruned)
    starts a new chain, still naming it."""
    if cause is None:
        return Lineage()
    if cause.parent_run_id is None:
        return Lineage(human_rooted=cause.human)
    row = conn.execute(
        "SELECT agent_profile_id, causation_depth, COALESCE(chain_id, id), human_rooted FROM runs"
        " WHERE id = ?",
        (cause.parent_run_id,),
    ).fetchone()
    if row is None:
        return Lineage(cause.parent_run_id, human_rooted=cause.human)
    return Lineage(
        cause.parent_run_id,
        int(row[1]) + 1,
        int(row[2]),
        bool(row[3]),
        self_trigger=row[0] == agent_profile_id,
    )


@attrs.frozen
class Refusal:
    """Why an enqueue was refused: the limit's name (`max_causation_depth`, `self_triggers`,
    `runs_per_hour`, `global_runs_per_hour`) and its value."""

    limit: str
    value: int


_SELF = (
    "SELECT COUNT(*) FROM runs WHERE chain_id = ? AND agent_profile_id = ? AND reason = ?"
    " AND self_trigger = 1 AND rate_limit IS NULL"
)
_RATES = (
    "SELECT scope, runs_per_hour FROM run_limits WHERE runs_per_hour IS NOT NULL"
    " AND (scope = 'global' OR (scope = 'agent' AND target_id = ?))"
)
_SINCE = (
    "id >= COALESCE((SELECT MIN(first_id) FROM run_minutes"
    " WHERE minute >= CAST((?1 - {window}) / 60 AS INTEGER)), 9223372036854775807) AND "
)
"""SQLite: the ids a run requested after `?1 - window` can have. `run_minutes` holds, per minute of
`requested_at`, the smallest id of a run requested in it (its triggers, store/backends/schema.py migration
22), so every such run's id is at least the smallest over the minutes from the window's first on: the count
reads the last hour's runs by id, with no index by agent and time. PostgreSQL keeps `runs_by_agent_time`
(its runtimes' ids are not in commit order, and one row per minute would make them wait on each other)."""
_AGENT_HOUR = Clocked(
    "SELECT COUNT(*) FROM runs WHERE " + _SINCE.format(window="?3") + "agent_profile_id = ?2"
    " AND requested_at > ?1 - ?3 AND rate_limit IS NULL",
    Clocked.of(
        "SELECT COUNT(*) FROM runs WHERE agent_profile_id = ?2 AND requested_at > {now} - ?3"
        " AND rate_limit IS NULL",
        "?1",
    ).postgres,
)
_ALL_HOUR = Clocked(
    "SELECT COUNT(*) FROM runs WHERE " + _SINCE.format(window="?2") + "requested_at > ?1 - ?2"
    " AND rate_limit IS NULL",
    Clocked.of(
        "SELECT COUNT(*) FROM runs WHERE requested_at > {now} - ?2 AND rate_limit IS NULL", "?1"
    ).postgres,
)


def refusal(
    conn: Connection, agent_profile_id: str, reason: str, line: Lineage, cause: Cause | None, now: float
) -> Refusal | None:
    """The limit a new run would break, or None: deeper than the cause's `max_depth`; a fourth
    self-trigger of the agent for `reason` in the chain (`SELF_TRIGGERS`); the agent's or the global
    `runs_per_hour` reached over the last hour (runs of a human-rooted chain are exempt)."""
    if cause is not None and cause.exempt:
        return None
    if cause is not None and cause.max_depth is not None and line.depth > cause.max_depth:
        return Refusal("max_causation_depth", cause.max_depth)
    if line.self_trigger and line.chain_id is not None:
        (count,) = conn.execute(_SELF, (line.chain_id, agent_profile_id, reason)).fetchone()
        if int(count) >= SELF_TRIGGERS:
            return Refusal("self_triggers", SELF_TRIGGERS)
    if line.human_rooted:
        return None
    for scope, per_hour in conn.execute(_RATES, (agent_profile_id,)).fetchall():
        if scope == "agent":
            (count,) = conn.execute(_AGENT_HOUR.on(conn), (now, agent_profile_id, RATE_WINDOW)).fetchone()
        else:
            (count,) = conn.execute(_ALL_HOUR.on(conn), (now, RATE_WINDOW)).fetchone()
        if int(count) >= int(per_hour):
            return Refusal("runs_per_hour" if scope == "agent" else "global_runs_per_hour", int(per_hour))
    return None


RATES_SET = "SELECT 1 FROM run_limits WHERE runs_per_hour IS NOT NULL LIMIT 1"
"""A row when any `runs_per_hour` is set (`rates_set`)."""


def rates_set(conn: Connection) -> bool:
    """Whether any `runs_per_hour` is set: then every new run is counted at its enqueue (the common entry's
    one-statement insert declines, store/entries/common_entry.py)."""
    return conn.execute(RATES_SET).fetchone() is not None


# --- statistics -----------------------------------------------------------------------------------------


@attrs.frozen
class AgentStats:
    """One agent's line of `queue_stats`: runs queued and claimed, its ceiling, the age of its oldest queued
    run (seconds), whether it is paused (by its own pause or `all`), and enqueues refused in the last hour."""

    agent_profile_id: str
    queued: int
    claimed: int
    max_concurrent: int | None
    runs_per_hour: int | None
    oldest_age: float | None
    paused: bool
    rate_limited_last_hour: int


_OPEN = Clocked.of(
    "SELECT agent_profile_id, SUM(CASE status WHEN 'queued' THEN 1 ELSE 0 END),"
    " SUM(CASE status WHEN 'claimed' THEN 1 ELSE 0 END),"
    " MAX(CASE status WHEN 'queued' THEN {now} - requested_at END)"
    " FROM runs WHERE status IN ('queued', 'claimed') GROUP BY agent_profile_id",
    "?1",
)
_REFUSED = Clocked.of(
    "SELECT agent_profile_id, COUNT(*) FROM runs WHERE rate_limit IS NOT NULL AND requested_at > {now} - ?2"
    " GROUP BY agent_profile_id",
    "?1",
)


def queue_stats(conn: Connection, now: float) -> tuple[list[AgentStats], list[Limit], list[Pause], float]:
    """Per agent (any with an open run, a limit, a pause or a refusal in the last hour), by id; the limits;
    the pauses; and the time judged at (on PostgreSQL the server's clock)."""
    now = judge(conn, now)
    opened = {str(a): (int(q), int(c), o) for a, q, c, o in conn.execute(_OPEN.on(conn), (now,)).fetchall()}
    refused = {str(a): int(n) for a, n in conn.execute(_REFUSED.on(conn), (now, RATE_WINDOW)).fetchall()}
    limits = list_limits(conn)
    pauses = list_pauses(conn)
    per_agent = {limit.target_id: limit for limit in limits if limit.scope == "agent"}
    paused_agents = {p.target_id for p in pauses if p.scope == "agent"}
    all_paused = any(p.scope == "all" for p in pauses)
    agents = sorted(set(opened) | set(refused) | set(per_agent) | paused_agents)
    stats = []
    for agent in agents:
        queued, claimed, oldest = opened.get(agent, (0, 0, None))
        limit = per_agent.get(agent)
        stats.append(
            AgentStats(
                agent,
                queued,
                claimed,
                None if limit is None else limit.max_concurrent,
                None if limit is None else limit.runs_per_hour,
                None if oldest is None else max(float(oldest), 0.0),
                all_paused or agent in paused_agents,
                refused.get(agent, 0),
            )
        )
    return stats, limits, pauses, now
