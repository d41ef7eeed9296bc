"""An in-process cache of task rows, so a move is one writer request (and at 1 task one commit).

A move used to read its task's row in one transaction and admit it in the next. With a cached row the move
goes straight to the admission, whose compare-and-set verifies the row it started from: the step, the
workflow, the admitted flag and the `admissions` counter (+1 at every step entry, on every path: a row
version for what an entry depends on). Any mismatch rolls back, forgets the row, and the move is read
afresh and decided by the uncached path, host preflight included. So a stale row can cost an extra
`preflight_transition` call (with the stale source step), never a wrong commit: nothing commits from a row
the compare-and-set did not verify.

Only a runtime on SQLite enables it: it owns its file (flock), so every write to a task row is this
process's, and each one outside the admission forgets the row (the task actor's other commands, a WIP
promotion of another task). On PostgreSQL other runtimes write rows too, so the cache is off there.
The cache lives in `Services` (a reconfiguration keeps it), never in a task actor, which is evicted after
each message. A bounded LRU, on SQLite only. Trio thread.
"""

from __future__ import annotations

from collections import OrderedDict

from onceflow.store.records import TaskRecord

DEFAULT_CAPACITY = 16384
"""Rows held by default (~0.5 KiB each: ~8 MiB at most; 0 turns the cache off)."""


class TaskRows:
    """A bounded LRU of `TaskRecord`s by task id; `capacity` 0 holds nothing (off).

    Plain synchronous code, called only from the Trio thread. Raises ValueError for a negative capacity.
    """

    __slots__ = ("_rows", "capacity")

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"task_row_cache must be >= 0 rows, got {capacity}")
        self.capacity = capacity
        self._rows: OrderedDict[str, TaskRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, task_id: str) -> TaskRecord | None:
        """The cached row (to be verified by the admission's compare-and-set), or None."""
        row = self._rows.get(task_id)
        if row is not None:
            self._rows.move_to_end(task_id)
        return row

    def put(self, row: TaskRecord) -> None:
        """Remember `row` as the task's committed row, evicting the least recently used beyond capacity."""
        if not self.capacity:
            return
        self._rows[row.id] = row
        self._rows.move_to_end(row.id)
        if len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def forget(self, task_id: str) -> None:
        """Drop the task's row: something other than the admission may write it."""
        self._rows.pop(task_id, None)
