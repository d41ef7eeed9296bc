"""WIP-limit admission and promotion: entry path E3.

Admission: a move or transition into a full step lands the task queued there (not an entry: no record,
no on_enter). Promotion, run when a slot frees or a feeder gets work or at start-up, admits one task at a
time into a step with room, each claim in its own transaction with its step-entry record:
1. a task queued in place at the step is admitted where it stands (shape (b): no step field changes);
2. else a task admitted at the step's feeder (`pull_from_step_id`) is pulled in;
3. else, for a full step this one feeds, a task queued there moves here to wait, admitted and still tagged
   for its target — the record names this step, the one it actually occupies.
Pulls do not cascade to the feeder's own feeder. Sources: kandev-engine-notes.md "WIP limits";
on-enter-action-dispatch.md, write-site inventory sites 4-7 and "Allocation inputs".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import attrs

from onceflow.protocol.workflow import ENGINE_ACTION_TYPES, Step, Workflow
from onceflow.store import step_entries, wip
from onceflow.store.step_entries import EntryKey


@attrs.frozen
class Promotion:
    """A task admitted by a promotion; `key` is None when the landing step allocates no record."""

    task_id: str
    workflow_id: str
    step_id: str
    key: EntryKey | None


def allocate_for(
    conn: sqlite3.Connection, *, task_id: str, workflow_id: str, step: Step, path: str, now: float
) -> EntryKey | None:
    """Allocate the step-entry record for an admission to `step`, if its on_enter needs one (AC-E5).

    The declaration is the caller's resolved `Step`, read once; nothing here parses YAML.
    """
    declaration = step.events.on_enter
    if not any(action.type in ENGINE_ACTION_TYPES for action in declaration):
        return None
    return step_entries.allocate_entry(
        conn,
        task_id=task_id,
        step_id=step.id,
        workflow_id=workflow_id,
        digest=step_entries.declaration_digest([action.type for action in declaration]),
        entry_path=path,
        now=now,
    )


def _claims(
    conn: sqlite3.Connection, workflow: Workflow, step: Step
) -> Iterator[tuple[str, str, bool, str | None]]:
    """Candidates in rule order, as (task, from step, admitted there?, queued_for tag); queried lazily."""
    yield wip.queued_in_place(conn, workflow.id, step.id) or "", step.id, False, None
    if step.pull_from_step_id:
        feeder = step.pull_from_step_id
        yield wip.feeder_candidate(conn, workflow.id, feeder, step.id) or "", feeder, True, None
    for target in workflow.fed_by(step.id):
        if not wip.has_room(conn, workflow.id, target.id, target.wip_limit, serialize=False):  # admits none
            yield wip.queued_in_place(conn, workflow.id, target.id) or "", target.id, False, target.id


def may_promote(workflow: Workflow, step: Step, occupied: set[tuple[str, str, bool]]) -> bool:
    """Whether rules 1-3 can find any candidate for `step`, given `occupied` (`store.wip.occupied_steps`:
    (workflow, step, admitted?) triples). False means promoting the step would find nobody to admit."""

    def holds(step_id: str, admitted: bool) -> bool:
        return (workflow.id, step_id, admitted) in occupied

    return (
        holds(step.id, False)
        or (step.pull_from_step_id is not None and holds(step.pull_from_step_id, True))
        or any(holds(target.id, False) for target in workflow.fed_by(step.id))
    )


def promote_one(conn: sqlite3.Connection, workflow: Workflow, step: Step, now: float) -> Promotion | None:
    """Admit the next candidate into `step` (rules 1-3 of the module doc) inside the caller's transaction."""
    if not wip.has_room(conn, workflow.id, step.id, step.wip_limit):
        return None
    for task_id, from_step, admitted, tag in _claims(conn, workflow, step):
        if task_id and wip.admit(
            conn,
            task_id=task_id,
            from_step_id=from_step,
            expected_admitted=admitted,
            step_id=step.id,
            queued_for_step_id=tag,
            now=now,
        ):
            key = allocate_for(conn, task_id=task_id, workflow_id=workflow.id, step=step, path="E3", now=now)
            return Promotion(task_id, workflow.id, step.id, key)
    return None
