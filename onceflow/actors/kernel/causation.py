"""The causation of the command a task's actor is applying, for the runs its actions queue. Trio thread.

`TaskActor.handle` sets `CAUSE` from the command's `caused_by_run_id` and `actor_kind`
(protocol/causation.py) for as long as the command runs; the engine reads it where it builds an action's
context (actors/engine/triggers.py, actors/engine/on_enter.py), so each run queued records its parent and
passes the flow gate (store/runs/flow.py). Work the runtime does on its own (the recovery scan, a WIP
promotion's entry) runs under no command: its runs start chains of their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from onceflow.store.runs.flow import Cause

CAUSE: contextvars.ContextVar[Cause | None] = contextvars.ContextVar("onceflow_cause", default=None)


@contextlib.contextmanager
def caused_by(command: object, max_depth: int) -> Iterator[None]:
    """Run the block under `command`'s causation (a root's, when it names no run and no human)."""
    parent = getattr(command, "caused_by_run_id", None)
    human = getattr(command, "actor_kind", None) == "human"
    token = CAUSE.set(Cause(parent, human, max_depth))
    try:
        yield
    finally:
        CAUSE.reset(token)


def current() -> Cause | None:
    """The causation of the command being applied (None outside one)."""
    return CAUSE.get()
