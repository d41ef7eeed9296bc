"""Executing an entry's engine-owned on_enter actions: segments, external claims, closing an entry. Writer
thread: every function runs inside the caller's transaction and publishes nothing.

The Trio side (actors/engine/on_enter.py) plans an entry's dispatch and hands this module what to execute:
a `Segment` is a run of consecutive engine actions with executors; each is claimed by compare-and-set on
its marker with the runtime's epoch, applied and completed in its own savepoint, so one request (one
transaction) claims, applies and completes them all. An external action (run_code_review, or an engine
action without an executor) waits on the host, so it is claimed in one transaction (`claim_external`) and
completed in another (`complete_external`). Source: on-enter-action-dispatch.md, "Execution model".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from onceflow.protocol.workflow import ENGINE_ACTION_TYPES, ActionDecl, Step
from onceflow.store.backends import faults
from onceflow.store.backends.connection import Connection
from onceflow.store.backends.epochs import EpochSource
from onceflow.store.backends.savepoint import savepoint, undone_alone
from onceflow.store.entries import review_runs, step_entries
from onceflow.store.entries.executors import ActionContext, Effect, Executor
from onceflow.store.entries.step_entries import ClaimOutcome, EntryKey
from onceflow.store.records import Marker, StepEntry, TaskRecord
from onceflow.store.runs.flow import Cause
from onceflow.store.runs.keys import EntryScope

Order = tuple[tuple[int, ActionDecl], ...]
"""(position, action) pairs in dispatch order; positions index the whole declared list."""


@attrs.frozen
class ActionRun:
    """One engine action of a segment: its claim outcome and, when this dispatcher ran it, its effect;
    `claim` None means the executor raised (`error`) and only its savepoint was rolled back."""

    position: int
    action: ActionDecl
    claim: ClaimOutcome | None
    effect: Effect | None = None
    error: str = ""


@attrs.frozen
class SegmentResult:
    """What one segment transaction did. `mismatch` is the recorded digest when the entry was closed
    declaration_changed instead; `stopped` means the entry's later positions must not run (stop rule,
    AC-C2); `finish_error` is why the terminal flag could not be written (the actions stand, the entry
    stays open for the next start, AC-B9(f))."""

    runs: tuple[ActionRun, ...] = ()
    mismatch: str | None = None
    stopped: bool = False
    finish_error: str = ""


@attrs.frozen
class Segment:
    """Consecutive engine actions of one entry of `task` at `step`, each with an executor in `executors`.

    `check_digest`: compare the entry's recorded declaration digest first (`close_if_changed`); `finish`:
    flag the entry terminal after the last action when every engine position is then terminal (nothing
    external follows)."""

    task: TaskRecord
    step: Step
    key: EntryKey
    actions: Order
    executors: Mapping[str, Executor]
    check_digest: bool
    finish: bool
    cause: Cause | None = None


def entry_context(
    task: TaskRecord, step: Step, key: EntryKey, position: int, now: float, cause: Cause | None = None
) -> ActionContext:
    """The executor context of one on_enter position: its runs carry the entry-scoped idempotency key, and
    `cause` (store/runs/flow.py) when a command caused the entry."""
    return ActionContext(
        task=task,
        step_id=step.id,
        step_name=step.name,
        trigger="on_enter",
        keys=EntryScope(key.task_id, key.step_id, key.entry_seq, position),
        exclude_from_coalescing=True,
        now=now,
        cause=cause,
    )


def run_segment(
    conn: Connection,
    segment: Segment,
    source: EpochSource,
    now: float,
    *,
    entry: StepEntry | None = None,
    marks: dict[int, Marker] | None = None,
) -> SegmentResult:
    """Claim, apply and complete each action of `segment` (`now` Unix seconds; the epoch read from `source`
    here, on the writer thread).

    `entry` and `marks` are the entry and its markers when the caller already read them in this
    transaction (the recovery scan does); otherwise they are read here. Each action is claimed by
    compare-and-set (`step_entries.decide_claim`), applied and completed in its own savepoint: an executor
    that raises rolls back only itself (transient: no marker, the entry stays open for the next start,
    AC-B9(f)) and stops the entry only if it is clear_decisions (AC-C2, AC-C3), unless what it raised is a
    storage fault, which fails the whole request. A live peer's claim stops the entry (the stop rule).

    Raises:
        sqlite3.Error: a storage fault, or an error that ended the transaction (`faults.fails_request`:
            disk full, I/O, a lock held past the busy timeout): no later action runs, and the caller's whole
            request fails.
    """
    key, declaration = segment.key, segment.step.events.on_enter
    if segment.check_digest:
        recorded = close_if_changed(conn, key, declaration, now, entry)
        if recorded is not None:
            return SegmentResult(mismatch=recorded)
    runs: list[ActionRun] = []
    epoch = source.epoch
    # Read once: in this transaction only this segment writes them, one position at a time. No in_progress
    # row is written for an action applied and finished here: nobody could ever read it.
    marks = step_entries.markers(conn, key) if marks is None else marks
    for position, action in segment.actions:
        clearing = action.type == "clear_decisions"
        try:
            with savepoint(conn, "action"):
                claim = step_entries.decide_claim(conn, marks.get(position), epoch)
                effect = None
                if claim == "claimed":
                    context = entry_context(segment.task, segment.step, key, position, now, segment.cause)
                    effect = segment.executors[action.type](conn, context, action)
                    step_entries.finish_marker(
                        conn, key, position, action.type, effect.state, effect.detail, now
                    )
        except Exception as exc:
            if faults.fails_request(conn, exc):  # the database's fault, not the action's: fail it whole
                raise
            runs.append(ActionRun(position, action, None, error=repr(exc)))
            if clearing:
                return SegmentResult(tuple(runs), stopped=True)
            continue
        runs.append(ActionRun(position, action, claim, effect))
        if claim == "live_peer" or (clearing and effect is not None and effect.state == "failed"):
            return SegmentResult(tuple(runs), stopped=True)
    if not segment.finish:
        return SegmentResult(tuple(runs))
    try:  # one UPDATE: if it fails, nothing of it was written and the actions above still stand
        with undone_alone(conn, "finish"):
            engine_positions = {p for p, a in enumerate(declaration) if a.type in ENGINE_ACTION_TYPES}
            if engine_positions == {run.position for run in runs if run.claim is not None}:
                step_entries.mark_terminal(conn, key)  # this segment brought every position to terminal
            else:
                finish_if_terminal(conn, key, declaration)
    except Exception as exc:
        if faults.fails_request(conn, exc):
            raise
        return SegmentResult(tuple(runs), finish_error=repr(exc))
    return SegmentResult(tuple(runs))


def close_entry(
    conn: Connection, key: EntryKey, declaration: Sequence[ActionDecl], reason: str, now: float
) -> None:
    """End an entry without executing it: every engine-owned position of `declaration` (as read now) not
    yet terminal is marked skipped(reason), and the entry is flagged terminal (Execution model)."""
    marks = step_entries.markers(conn, key)
    for position, action in enumerate(declaration):
        marker = marks.get(position)
        if action.type in ENGINE_ACTION_TYPES and (
            marker is None or marker.state not in step_entries.TERMINAL_STATES
        ):
            step_entries.finish_marker(conn, key, position, action.type, "skipped", reason, now)
    step_entries.mark_terminal(conn, key)


def finish_if_terminal(conn: Connection, key: EntryKey, declaration: Sequence[ActionDecl]) -> None:
    """Flag the entry terminal once every engine-owned position of `declaration` has a terminal marker."""
    marks = step_entries.markers(conn, key)
    if all(
        p in marks and marks[p].state in step_entries.TERMINAL_STATES
        for p, a in enumerate(declaration)
        if a.type in ENGINE_ACTION_TYPES
    ):
        step_entries.mark_terminal(conn, key)


def close_if_changed(
    conn: Connection,
    key: EntryKey,
    declaration: Sequence[ActionDecl],
    now: float,
    entry: StepEntry | None = None,
) -> str | None:
    """Compare the entry's recorded declaration digest with `declaration` (read now); on a mismatch close the
    entry declaration_changed (in one savepoint) and return the recorded digest, else None (AC-B9(d))."""
    entry = step_entries.get_entry(conn, key) if entry is None else entry
    current = step_entries.declaration_digest([a.type for a in declaration])
    if entry is None or entry.declaration_digest == current:
        return None
    with savepoint(conn, "close"):  # several writes: all of them or none
        close_entry(conn, key, declaration, "declaration_changed", now)
    return entry.declaration_digest


def claim_external(
    conn: Connection,
    key: EntryKey,
    position: int,
    action: ActionDecl,
    source: EpochSource,
    now: float,
) -> tuple[ClaimOutcome, int | None]:
    """Claim an external action durably (`step_entries.claim_marker`, the epoch read here); for
    run_code_review also record its review-run row (a re-claim after a crash reuses the row). Returns the
    claim outcome and the review run's id (None unless a review was claimed)."""
    outcome = step_entries.claim_marker(conn, key, position, action.type, source.epoch, now)
    if outcome != "claimed" or action.type != "run_code_review":
        return outcome, None
    return outcome, review_runs.record_review_run(
        conn,
        task_id=key.task_id,
        step_id=key.step_id,
        entry_seq=key.entry_seq,
        position=position,
        agent_profile_id=getattr(action.config, "agent_profile_id", None),
        now=now,
    )


def complete_external(
    conn: Connection,
    key: EntryKey,
    position: int,
    kind: str,
    effect: Effect,
    now: float,
    *,
    review_run: int | None = None,
    start_failure: str | None = None,
) -> None:
    """Write an external action's terminal marker; a review whose start failed is recorded on its row."""
    if review_run is not None and start_failure is not None:
        review_runs.mark_start_failed(conn, review_run, start_failure)
    step_entries.finish_marker(conn, key, position, kind, effect.state, effect.detail, now)
