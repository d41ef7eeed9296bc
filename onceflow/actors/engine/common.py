"""The common step entry, Trio side: which entries are common, and publishing what the store's one-savepoint
admission did (store/entries/common_entry.py executes it). Trio thread.

An entry is common when its step's on_enter, in its dispatch order on the entry's path, holds nothing but
the built-in `clear_decisions` and `queue_run_for_each_participant` (with a role): nothing waits on the host,
so the admitting request can run the whole entry. Its events are the ones the executors would have
published, in the same order (tests/on_enter/test_common_entry.py compares every reply and log with the
per-action path). Source: on-enter-action-dispatch.md AC-B5, AC-B6, AC-C1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from onceflow.actors.engine.order import dispatch_order
from onceflow.actors.kernel.outbox import Outbox
from onceflow.protocol import trusted
from onceflow.protocol.events import EntryPath, Event
from onceflow.protocol.workflow import ActionDecl, Step
from onceflow.store.entries.common_entry import COMMON_KINDS, Done, Plan, Queued
from onceflow.store.entries.executors import (
    DEFAULT_EXECUTORS,
    Effect,
    Executor,
    fan_out_notes,
    fan_out_reason,
)
from onceflow.store.entries.segment import ActionRun, SegmentResult


def common_order(
    executors: Mapping[str, Executor], step: Step, path: EntryPath
) -> tuple[tuple[int, ActionDecl], ...] | None:
    """The dispatch order of `step` on `path` when every action in it is a built-in clear or fan-out with a
    role, served by the built-in executor (nothing waits on the host), else None. On both backends."""
    order = dispatch_order(step.events.on_enter, path)
    if not order:
        return None
    for _, action in order:
        if action.type not in COMMON_KINDS:
            return None
        if executors.get(action.type) is not DEFAULT_EXECUTORS[action.type]:
            return None
        if action.type == "queue_run_for_each_participant" and not getattr(action.config, "role", ""):
            return None
        if getattr(action.config, "priority", None) is not None:  # the common insert writes the default
            return None
    return tuple(order)


def common_result(
    task_id: str, step: Step, order: Sequence[tuple[int, ActionDecl]], done: Done
) -> SegmentResult:
    """The `SegmentResult` the per-action path builds for an entry that did `done`: the executors' effects,
    events and diagnostics, in position order."""
    actions = dict(order)
    runs = []
    for position, did in done:
        action = actions[position]
        runs.append(ActionRun(position, action, "claimed", _effect(task_id, step, action, did)))
    return SegmentResult(tuple(runs))


def publish_common(out: Outbox, task_id: str, plan: Plan, done: Done) -> None:
    """Publish what a committed common entry did (`Admitted.done`), in dispatch order, as `publish_effect`
    publishes `common_result`'s effects (`OnEnterDispatch.publish_segment`): per position its clear's
    `decisions_cleared` or its fan-out's `run_queued`s and notes, then its `action_outcome`. Built straight
    from `done` (no effect or segment) and published in one `Outbox.emit_all`; every value is the runtime's
    own and typed (ids it wrote, counts, keys): unvalidated."""
    step = plan.step
    step_id = step.id
    events: list[Event] = []
    for (position, action), (_, did) in zip(plan.order, done, strict=True):
        if isinstance(did, int):
            events.append(trusted.decisions_cleared(task_id=task_id, step_id=step_id, deleted=did))
        else:
            why = fan_out_reason(action, "on_enter")
            for agent, run_id, key in did:
                events.append(
                    trusted.run_queued(
                        run_id=run_id,
                        task_id=task_id,
                        step_id=step_id,
                        agent_profile_id=agent,
                        reason=why,
                        idempotency_key=key,
                    )
                )
            role: str = getattr(action.config, "role", "")
            for note in fan_out_notes(task_id, step_id, step.name, role, len(did), len(did)):
                events.append(out.logged(note.level, note.code, note.fields))
        events.append(
            trusted.action_outcome(
                task_id=task_id,
                step_id=step_id,
                trigger="on_enter",
                position=position,
                kind=action.type,
                outcome="done",
                detail="",
            )
        )
    out.emit_all(events)


def _effect(task_id: str, step: Step, action: ActionDecl, did: int | Queued) -> Effect:
    """The executor's effect for one position that did `did`: its clear's `decisions_cleared`, or its
    fan-out's `run_queued`s and notes. Every value is the runtime's own and typed (ids it wrote, counts,
    keys): unvalidated."""
    if isinstance(did, int):
        return Effect(
            "done", events=(trusted.decisions_cleared(task_id=task_id, step_id=step.id, deleted=did),)
        )
    why = fan_out_reason(action, "on_enter")
    events = tuple(
        trusted.run_queued(
            run_id=run_id,
            task_id=task_id,
            step_id=step.id,
            agent_profile_id=agent,
            reason=why,
            idempotency_key=key,
        )
        for agent, run_id, key in did
    )
    role: str = getattr(action.config, "role", "")
    notes = fan_out_notes(task_id, step.id, step.name, role, len(did), len(did))
    return Effect("done", events=events, diagnostics=notes)
