"""The startup recovery scan: finish the step entries a crash left open.

Once per start, after the store opens and before any command is served, one query selects every
non-terminal entry in (task_id, step_id, entry_seq) order. An entry the task has left is closed
skipped(step_left); an older entry of a step the task re-entered is closed skipped(superseded); an entry
whose workflow or step no longer resolves is closed skipped(unresolvable); an entry whose clear_decisions
failed is closed as it stands; the rest are re-dispatched
(engine-owned actions only, terminal positions skipped, stale in_progress markers re-claimed by epoch).
The scan never stops the runtime from starting: a failing record is logged at ERROR and left open.
Source: on-enter-action-dispatch.md, "Recovery" and AC-B9.
"""

from __future__ import annotations

import sqlite3

import structlog

from onceflow.actors.on_enter import OnEnterDispatch, close_entry
from onceflow.actors.outbox import Outbox
from onceflow.actors.services import Services
from onceflow.protocol.workflow import ActionDecl
from onceflow.store import step_entries, tasks
from onceflow.store.records import StepEntry
from onceflow.store.step_entries import EntryKey

log = structlog.get_logger("onceflow.recovery")


def _close(
    conn: sqlite3.Connection, key: EntryKey, declaration: tuple[ActionDecl, ...], reason: str, now: float
) -> None:
    close_entry(conn, key, declaration, reason, now)
    if reason != "clear_failed":  # a claim left by a dead runtime on a position no longer declared
        step_entries.skip_claimed_markers(conn, key, reason, now)


async def recover_open_entries(services: Services, out: Outbox) -> int:
    """Run the scan; returns how many entries were re-dispatched. Never raises."""
    try:
        entries = await services.store.transact(step_entries.open_entries)
    except Exception as exc:
        log.error("recovery_scan_query_failed", cause=repr(exc))
        return 0
    redispatched = 0
    for entry, latest in entries:
        try:
            redispatched += await _recover(services, entry, latest, out)
        except Exception as exc:
            log.error(
                "recovery_entry_failed",
                task_id=entry.task_id,
                step_id=entry.step_id,
                entry_seq=entry.entry_seq,
                cause=repr(exc),
            )
    return redispatched


async def _recover(services: Services, entry: StepEntry, latest: int, out: Outbox) -> int:
    key = EntryKey(entry.task_id, entry.step_id, entry.entry_seq)
    task = await services.store.transact(lambda conn: tasks.find_task(conn, entry.task_id))
    workflow = services.workflows.workflows.get(entry.workflow_id)
    step = workflow.step(entry.step_id) if workflow is not None and workflow.has_step(entry.step_id) else None
    declaration: tuple[ActionDecl, ...] = ()
    if task is None or workflow is None or step is None:
        reason = "unresolvable"
    elif task.step_id != entry.step_id or task.workflow_id != entry.workflow_id:
        reason, declaration = "step_left", step.events.on_enter
    elif latest != entry.entry_seq:  # the greatest over every entry of the pair, open or not
        reason, declaration = "superseded", step.events.on_enter
    elif await _clear_failed(services, key, step.events.on_enter):
        reason = "clear_failed"  # terminal as it stands: its later actions never reached a dispatcher (AC-C2)
    else:
        await OnEnterDispatch(services, task, workflow, step, key, "recovery", out).run()
        return 1
    now = services.now()
    await services.store.transact(lambda conn: _close(conn, key, declaration, reason, now))
    level = "warning" if reason == "unresolvable" else "info"
    out.diagnostic(
        level, f"recovery_{reason}", task_id=entry.task_id, step_id=entry.step_id, entry_seq=entry.entry_seq
    )
    return 0


async def _clear_failed(services: Services, key: EntryKey, declaration: tuple[ActionDecl, ...]) -> bool:
    marks = await services.store.transact(lambda conn: step_entries.markers(conn, key))
    return any(
        action.type == "clear_decisions" and position in marks and marks[position].state == "failed"
        for position, action in enumerate(declaration)
    )
