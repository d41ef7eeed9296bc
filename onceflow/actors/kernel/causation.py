"""The causation of the command a task's actor is applying, for the runs its actions queue. Trio thread.

`TaskActor.handle` sets `CAUSE` from the command's `caused_by_run_id` and `actor_kind`
(protocol/causation.py) for as long as the command runs; the engine reads it where it builds an action's
context (actors/engine/triggers.py, actors/engine/on_enter.py), so each run queued records its parent and
passes the flow gate (store/runs/flow.py). Work the runtime does on its own (the recovery scan, a WIP
promotion's entry) runs under no command: its runs start chains of their own.
"""

from __future__ import annotations

import contextvars

from onceflow.store.runs.flow import Cause

CAUSE: contextvars.ContextVar[Cause | None] = contextvars.ContextVar("onceflow_cause", default=None)


def cause_of(command: object, max_depth: int) -> Cause:
    """`command`'s causation (a root's, when it names no run and no human): what `TaskActor.handle` sets
    `CAUSE` to while it applies the command. A root's is one shared (frozen) instance per `max_depth`: most
    commands name no run, and a new one each cost ~20k instructions with the context manager this was."""
    parent = getattr(command, "caused_by_run_id", None)
    human = getattr(command, "actor_kind", None) == "human"
    if parent is None and not human:
        root = _ROOTS.get(max_depth)
        if root is None:
            root = _ROOTS[max_depth] = Cause(None, False, max_depth)
        return root
    return Cause(parent, human, max_depth)


_ROOTS: dict[int, Cause] = {}


def current() -> Cause | None:
    """The causation of the command being applied (None outside one)."""
    return CAUSE.get()
