"""Retention: deleting resolved history past its time, in bounded batches. Writer thread: `prune_batch`
runs inside the caller's transaction; each call deletes at most `limit` rows per kind, so it never holds the
writer for long (the runtime's retention task and `onceflow prune` call it until it finds nothing).

What goes, once older than the retention (seconds, never below the 24 h key window: protocol/runs.py):
- resolved runs (finished, failed, cancelled: by `finished_at`, oldest ids first: no index holds resolved
  runs by time, so a pass's last batch reads the table once), with the coalesced keys merged into them.
  A key is honoured while its run is unresolved and 24 h after it resolves (store/runs/runs.py
  `key_honoured`), so a run resolved longer ago than the retention holds no honoured key: a redelivery
  inside the window is a no-op whatever was pruned;
- terminal step entries (their markers cascade) whose markers too are older than the retention (an entry
  a recovery scan just finished is kept a whole retention) and that are not the latest of their (task,
  step): the latest is kept, since the next entry's `entry_seq` is one more than it (a reused number would
  reuse run keys), and no open entry is ever deleted (the recovery scan needs them); code-review launches
  of the same entries go with them;
- decisions superseded by a later one of the same seat and decider (the latest of each still counts);
- decision receipts (a redelivered decision within the window is still recognised);
- acknowledged coordinator outcomes (by `acknowledged_at`), their acknowledgements cascading;
- task history items (store/tasks/history.py, by `at`) but each task's latest, which keeps its numbering going
  (the history's run items go with their runs);
- ended host calls (store/outcomes/host_calls.py, by `answered_at`), which a task's history shows too.
"""

from __future__ import annotations

import attrs

from onceflow.store.backends.clock import judge
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.urls import on_postgres

KINDS = (
    "runs",
    "step_entries",
    "review_runs",
    "decisions",
    "decision_receipts",
    "outcomes",
    "history",
    "host_calls",
)
"""What `prune_batch` deletes, in its order (the `onceflow.retention.deleted` metric's `kind`)."""

_RUNS = (
    "DELETE FROM runs WHERE id IN (SELECT id FROM runs WHERE status IN ('finished', 'failed', 'cancelled')"
    " AND finished_at < ? ORDER BY id LIMIT ?)"
)
_LATEST = (
    "(SELECT MAX(l.entry_seq) FROM step_entries AS l"
    " WHERE l.task_id = {t}.task_id AND l.step_id = {t}.{step})"
)
_ENTRIES = (
    "DELETE FROM step_entries WHERE (task_id, step_id, entry_seq) IN"
    " (SELECT e.task_id, e.step_id, e.entry_seq FROM step_entries AS e"
    " WHERE e.terminal = 1 AND e.created_at < ?1"
    f" AND e.entry_seq < {_LATEST.format(t='e', step='step_id')}"
    " AND NOT EXISTS (SELECT 1 FROM step_entry_markers AS m WHERE m.task_id = e.task_id"
    " AND m.step_id = e.step_id AND m.entry_seq = e.entry_seq AND m.updated_at >= ?1)"
    " ORDER BY e.created_at LIMIT ?2)"
)
_REVIEW_RUNS = (
    "DELETE FROM task_review_runs WHERE id IN (SELECT r.id FROM task_review_runs AS r WHERE r.created_at < ?"
    f" AND r.entry_seq < {_LATEST.format(t='r', step='workflow_step_id')} LIMIT ?)"
)
_DECISIONS = (
    "DELETE FROM decisions WHERE id IN (SELECT d.id FROM decisions AS d WHERE d.created_at < ? AND EXISTS"
    " (SELECT 1 FROM decisions AS n WHERE n.task_id = d.task_id AND n.step_id = d.step_id AND n.id > d.id"
    " AND n.participant_id IS NOT DISTINCT FROM d.participant_id AND n.role = d.role"
    " AND n.decider_type = d.decider_type AND n.decider_id = d.decider_id) LIMIT ?)"
)
_RECEIPTS = (
    "DELETE FROM decision_receipts WHERE (task_id, step_id, external_id) IN"
    " (SELECT task_id, step_id, external_id FROM decision_receipts WHERE created_at < ? LIMIT ?)"
)
_OUTCOMES = (
    "DELETE FROM outcomes WHERE outcome_id IN (SELECT outcome_id FROM outcomes WHERE phase = 'acknowledged'"
    " AND acknowledged_at < ? LIMIT ?)"
)
_HISTORY = (
    "DELETE FROM task_history WHERE (task_id, seq) IN (SELECT h.task_id, h.seq FROM task_history AS h"
    " WHERE h.at < ? AND h.seq < (SELECT MAX(l.seq) FROM task_history AS l WHERE l.task_id = h.task_id)"
    " ORDER BY h.at LIMIT ?)"
)
_HOST_CALLS = (
    "DELETE FROM host_calls WHERE id IN (SELECT id FROM host_calls WHERE answered_at < ?"
    " ORDER BY answered_at LIMIT ?)"
)
_MINUTES = "DELETE FROM run_minutes WHERE minute < CAST(? / 60 AS INTEGER)"
"""SQLite: the hourly rates' minutes (store/runs/flow.py `_SINCE`) older than the retention. At most one row a
minute, so no batch; a count is exact while the clock never steps back by more than the retention."""
_STATEMENTS = (_RUNS, _ENTRIES, _REVIEW_RUNS, _DECISIONS, _RECEIPTS, _OUTCOMES, _HISTORY, _HOST_CALLS)


@attrs.frozen
class Pruned:
    """Rows one batch deleted, per kind (`KINDS`); `full` when some kind hit the limit (more may be left)."""

    deleted: dict[str, int]
    full: bool

    @property
    def total(self) -> int:
        """Rows deleted, every kind."""
        return sum(self.deleted.values())


def prune_batch(conn: Connection, now: float, retention: float, limit: int) -> Pruned:
    """Delete at most `limit` rows of each kind older than `now - retention` (module docstring); times
    are Unix seconds, `now` the runtime's clock (on PostgreSQL the server's clock, read once: the age
    that decides is the one the key windows are judged by, store/backends/clock.py). `retention` is checked by
    the caller (protocol/runs.py `retention_seconds`)."""
    cutoff = judge(conn, now) - retention
    deleted = {
        kind: conn.execute(sql, (cutoff, limit)).rowcount
        for kind, sql in zip(KINDS, _STATEMENTS, strict=True)
    }
    if not on_postgres(conn):
        conn.execute(_MINUTES, (cutoff,))
    return Pruned(deleted, any(count >= limit for count in deleted.values()))
