"""Per-operation-id locks: created on first acquire, ref-counted, removed when the last holder releases. Trio
thread.

A caller that commits a deferred transition and then marks its operation id holds the id's lock from before
it loads the task until after the mark, so a concurrent delivery of the same id waits and then sees the
committed state and the mark (evaluate-only-operation-marking.md AC-EO-13). The ledger is a memo, not a
mutex (operation-ledger-lifetime.md AC-S6): this is the mutex.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio


@attrs.define
class _Entry:
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    holders: int = 0


class OperationLocks:
    """A lock per operation id; the map holds only ids someone is holding or waiting for."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @asynccontextmanager
    async def hold(self, operation_id: str) -> AsyncIterator[None]:
        """Hold `operation_id`'s lock for the body; released (and forgotten when unused) even on cancel."""
        entry = self._entries.setdefault(operation_id, _Entry())
        entry.holders += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.holders -= 1
            if entry.holders == 0:
                del self._entries[operation_id]


class TaskLocks:
    """A task actor's per-operation locks: one table per deferring caller, so the two triggers' ids and
    lock lifetimes never couple (evaluate-only-operation-marking.md AC-EO-13). Each table is made on first
    use: a task's command runs with a fresh `TaskLocks` unless an actor task serves it, and most never
    lock."""

    __slots__ = ("_agent_error", "_child_completion")

    def __init__(
        self, agent_error: OperationLocks | None = None, child_completion: OperationLocks | None = None
    ) -> None:
        self._agent_error = agent_error
        self._child_completion = child_completion

    @property
    def agent_error(self) -> OperationLocks:
        if self._agent_error is None:
            self._agent_error = OperationLocks()
        return self._agent_error

    @property
    def child_completion(self) -> OperationLocks:
        if self._child_completion is None:
            self._child_completion = OperationLocks()
        return self._child_completion
