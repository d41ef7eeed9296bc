"""What a task's command handlers share. Trio thread."""

from __future__ import annotations

import attrs

from onceflow.actors.engine.engine import Engine
from onceflow.actors.kernel.operation_locks import TaskLocks
from onceflow.actors.kernel.services import Services
from onceflow.store.records import TaskRecord
from onceflow.store.writer import StoreActor


@attrs.frozen
class TaskContext:
    """One command's view of its task: the task's id, the engine current at the command's start (a
    reconfiguration may follow; the command keeps its engine), and the actor's per-operation locks."""

    task_id: str
    engine: Engine
    locks: TaskLocks

    @property
    def services(self) -> Services:
        return self.engine.services

    @property
    def store(self) -> StoreActor:
        return self.engine.services.store

    async def load(self) -> TaskRecord:
        """The task's committed row. Raises NotFoundError (field task_id)."""
        return await self.engine.load_task(self.task_id)
