"""on_enter dispatch for one step entry: the ownership partition, markers and the stop rule.

On E1-E3 and E5 the session-scoped actions go to the host at fixed positions (reset first, configure second,
auto_start last), engine-owned actions run in declared order between them. On E4 (switch_workflow) every
action runs in declared order and configure_session only warns. On every path a failed reset_agent_context
stops the entry's later session actions, not its engine-owned ones (issue 16 item 1). A recovery
re-dispatch runs engine-owned actions only (AC-B8). Each engine-owned action is claimed by compare-and-set
on its marker with the runtime's epoch; a database-effect action claims, applies and completes in one
transaction, and a run of them shares one (a segment), which is the admitting transaction itself when no
host action comes first.
Source: on-enter-action-dispatch.md, "The ownership partition" and "Execution model".
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence
from typing import Literal

import attrs

from onceflow.actors.engine.actions import ActionContext, DiagnosticNote, Effect, publish_effect
from onceflow.actors.engine.session import SessionOutcome, request_session_action
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.logs import get_logger
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ENGINE_ACTION_TYPES, SESSION_ACTION_TYPES, ActionDecl, Step, Workflow
from onceflow.store import faults, review_runs, step_entries
from onceflow.store.records import Marker, StepEntry, TaskRecord
from onceflow.store.savepoint import savepoint, undone_alone
from onceflow.store.step_entries import EntryKey

log = get_logger("onceflow.on_enter")

_LEADING = ("reset_agent_context", "configure_session")


_ORDERS: dict[tuple[int, str], tuple[Sequence[ActionDecl], tuple[tuple[int, ActionDecl], ...]]] = {}
"""Memo of `dispatch_order` by (id of the declaration, path), holding the declaration so its id stays its
own; cleared when it holds 4,096 (re-registered templates bring new declarations)."""


def dispatch_order(declaration: Sequence[ActionDecl], path: EntryPath) -> list[tuple[int, ActionDecl]]:
    """The (position, action) sequence one entry executes; positions index the whole declared list.

    E4 keeps declared order. Elsewhere: reset_agent_context then configure_session (each at most once,
    AC-H8), the rest in declared order, auto_start_agent last. `recovery` keeps engine-owned actions only.
    A declaration that is a tuple (a loaded template's, immutable) is planned once per path (~10 us per
    call otherwise, twice per entry: issue 14).
    """
    if not isinstance(declaration, tuple):
        return _order(declaration, path)
    memo = _ORDERS.get((id(declaration), path))
    if memo is None or memo[0] is not declaration:
        if len(_ORDERS) >= 4096:
            _ORDERS.clear()
        memo = _ORDERS[(id(declaration), path)] = (declaration, tuple(_order(declaration, path)))
    return list(memo[1])


def _order(declaration: Sequence[ActionDecl], path: EntryPath) -> list[tuple[int, ActionDecl]]:
    indexed = list(enumerate(declaration))
    if path == "recovery":
        return [(p, a) for p, a in indexed if a.type in ENGINE_ACTION_TYPES]
    if path == "E4":  # declared order, no hoisting (AC-A13); reset/configure still at most once (AC-H8)
        firsts = {kind: next((p for p, a in indexed if a.type == kind), None) for kind in _LEADING}
        return [(p, a) for p, a in indexed if a.type not in _LEADING or firsts[a.type] == p]
    leading = [next(((p, a) for p, a in indexed if a.type == kind), None) for kind in _LEADING]
    middle = [(p, a) for p, a in indexed if a.type not in (*_LEADING, "auto_start_agent")]
    trailing = next(((p, a) for p, a in indexed if a.type == "auto_start_agent"), None)
    return [pa for pa in (*leading, *middle, trailing) if pa is not None]


def close_entry(
    conn: sqlite3.Connection, key: EntryKey, declaration: Sequence[ActionDecl], reason: str, now: float
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


def finish_if_terminal(conn: sqlite3.Connection, key: EntryKey, declaration: Sequence[ActionDecl]) -> None:
    """Flag the entry terminal once every engine-owned position of `declaration` has a terminal marker."""
    marks = step_entries.markers(conn, key)
    if all(
        p in marks and marks[p].state in step_entries.TERMINAL_STATES
        for p, a in enumerate(declaration)
        if a.type in ENGINE_ACTION_TYPES
    ):
        step_entries.mark_terminal(conn, key)


@attrs.frozen
class ActionRun:
    """One engine action of a segment: its claim outcome and, when this dispatcher ran it, its effect;
    `claim` None means the executor raised (`error`) and only its savepoint was rolled back."""

    position: int
    action: ActionDecl
    claim: step_entries.ClaimOutcome | None
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


ChunkKind = Literal["session", "segment", "external"]


@attrs.define
class OnEnterDispatch:
    """Runs the on_enter declaration of `step` for one entry of `task` (key None: no engine actions).

    Consecutive engine actions that have executors form a segment: one store request claims, applies and
    completes each (each in its own savepoint), with the digest check before the first and the terminal
    flag after the last when nothing external follows. Session actions and external engine actions
    (no executor, run_code_review) split segments, since they wait on the host.
    """

    services: Services
    task: TaskRecord
    workflow: Workflow
    step: Step
    key: EntryKey | None
    path: EntryPath
    out: Outbox

    async def run(self, first: SegmentResult | None = None) -> None:
        """Dispatch the entry. `first` is the result of the leading segment when the admitting transaction
        already ran it (see `leading_segment`); it is published and dispatch goes on after it."""
        declaration = self.step.events.on_enter  # read once for the whole dispatch
        chunks, last_engine = self._plan()
        start = 0
        digest_pending = self.key is not None
        if first is not None:
            if not self.publish_segment(first):
                return
            start, digest_pending = 1, False
        elif digest_pending and (not chunks or chunks[0][0] != "segment"):
            if not await self._digest_matches(declaration):
                return
            digest_pending = False
        reset_failed = False
        for index, (kind, actions) in enumerate(chunks[start:], start):
            if kind == "session":
                position, action = actions[0]
                if reset_failed and not self._unowned(action):
                    continue  # named in the session_actions_skipped_after_failed_reset warning
                outcome = await self._session_action(position, action)
                if action.type == "reset_agent_context" and outcome == "failed":
                    reset_failed = True
                    self._skipping_after_failed_reset(position, chunks[index + 1 :])
                continue
            assert self.key is not None
            if kind == "external":
                if await self._external_action(self.key, *actions[0]) == "stop":
                    return
                continue
            finish = index == last_engine
            now, key = self.services.now(), self.key
            segment = functools.partial(
                self.segment, key=key, actions=actions, now=now, check_digest=digest_pending, finish=finish
            )
            result = await self.services.store.transact(segment)
            digest_pending = False
            if not self.publish_segment(result):
                return
        if self.key is not None and (last_engine < 0 or chunks[last_engine][0] == "external"):
            await self._finish_if_terminal(self.key, declaration)

    def leading_segment(self) -> tuple[list[tuple[int, ActionDecl]], bool] | None:
        """The dispatch's first chunk when it is a segment, and whether it is also its last engine chunk.

        An admitting transaction may run it (with `segment`, no digest check: the declaration is the one the
        entry was allocated from) so the step change and its first effects share one commit; None when the
        dispatch starts with a host action, which must come first.
        """
        chunks, last_engine = self._plan()
        if not chunks or chunks[0][0] != "segment":
            return None
        return chunks[0][1], last_engine == 0

    def _plan(self) -> tuple[list[tuple[ChunkKind, list[tuple[int, ActionDecl]]]], int]:
        """The chunks of this entry's dispatch order and the index of the last engine chunk (-1: none)."""
        chunks = self.chunks(dispatch_order(self.step.events.on_enter, self.path))
        engine_chunks = [i for i, (kind, _) in enumerate(chunks) if kind != "session"]
        return chunks, engine_chunks[-1] if engine_chunks else -1

    def chunks(
        self, order: Sequence[tuple[int, ActionDecl]]
    ) -> list[tuple[ChunkKind, list[tuple[int, ActionDecl]]]]:
        """Split the dispatch order into session actions, segments and external engine actions (each
        session or external chunk holds one action). Engine actions are dropped when there is no entry."""
        chunks: list[tuple[ChunkKind, list[tuple[int, ActionDecl]]]] = []
        for position, action in order:
            kind: ChunkKind
            if action.type in SESSION_ACTION_TYPES:
                kind = "session"
            elif self.key is None:
                continue
            else:
                kind = "segment" if action.type in self.services.executors else "external"
            if kind == "segment" and chunks and chunks[-1][0] == "segment":
                chunks[-1][1].append((position, action))
            else:
                chunks.append((kind, [(position, action)]))
        return chunks

    def segment(
        self,
        conn: sqlite3.Connection,
        key: EntryKey,
        actions: Sequence[tuple[int, ActionDecl]],
        now: float,
        *,
        check_digest: bool,
        finish: bool,
        entry: StepEntry | None = None,
        marks: dict[int, Marker] | None = None,
    ) -> SegmentResult:
        """Run a segment inside the caller's transaction (writer thread; no Trio, nothing published).

        `entry` and `marks` are the entry and its markers when the caller already read them in this
        transaction (the recovery scan does); otherwise they are read here.

        Each action is claimed by compare-and-set with this runtime's epoch, applied and completed in its
        own savepoint: an executor that raises rolls back only itself (transient: no marker, the entry stays
        open for the next start, AC-B9(f)) and stops the entry only if it is clear_decisions (AC-C2, AC-C3).
        A live peer's claim stops the entry (the stop rule).

        Raises:
            sqlite3.Error: an error that ended the transaction (`faults.ends_transaction`: disk full, I/O):
                no later action runs outside it, and the caller's whole request fails (issue 11, item 4).
        """
        if check_digest:
            recorded = self._mismatch(conn, key, now, entry)
            if recorded is not None:
                return SegmentResult(mismatch=recorded)
        runs: list[ActionRun] = []
        epoch = self.services.store.epoch
        # Read once: in this transaction only this segment writes them, one position at a time. No
        # in_progress row is written for an action applied and finished here: nobody could ever read it.
        marks = step_entries.markers(conn, key) if marks is None else marks
        for position, action in actions:
            clearing = action.type == "clear_decisions"
            try:
                with savepoint(conn, "action"):
                    claim = step_entries.claim_outcome(marks.get(position), epoch)
                    effect = None
                    if claim == "claimed":
                        executor = self.services.executors[action.type]
                        effect = executor(conn, self.context(key, position, now), action)
                        step_entries.finish_marker(
                            conn, key, position, action.type, effect.state, effect.detail, now
                        )
            except Exception as exc:
                if faults.ends_transaction(conn, exc):  # the segment's transaction is gone: fail it whole
                    raise
                runs.append(ActionRun(position, action, None, error=repr(exc)))
                if clearing:
                    return SegmentResult(tuple(runs), stopped=True)
                continue
            runs.append(ActionRun(position, action, claim, effect))
            if claim == "live_peer" or (clearing and effect is not None and effect.state == "failed"):
                return SegmentResult(tuple(runs), stopped=True)
        if not finish:
            return SegmentResult(tuple(runs))
        try:  # one UPDATE: if it fails, nothing of it was written and the actions above still stand
            with undone_alone(conn, "finish"):
                declaration = self.step.events.on_enter
                engine_positions = {p for p, a in enumerate(declaration) if a.type in ENGINE_ACTION_TYPES}
                if engine_positions == {run.position for run in runs if run.claim is not None}:
                    step_entries.mark_terminal(conn, key)  # this segment brought every position to terminal
                else:
                    finish_if_terminal(conn, key, declaration)
        except Exception as exc:
            if faults.ends_transaction(conn, exc):
                raise
            return SegmentResult(tuple(runs), finish_error=repr(exc))
        return SegmentResult(tuple(runs))

    def publish_segment(self, result: SegmentResult) -> bool:
        """Publish a committed segment's events and diagnostics in position order; False if the entry
        must go no further (closed on a digest mismatch, or stopped)."""
        assert self.key is not None
        if result.mismatch is not None:
            self._declaration_changed(result.mismatch)
            return False
        for run in result.runs:
            if run.claim is None:
                self.out.diagnostic(
                    "error",
                    "on_enter_action_failed",
                    workflow_id=self.workflow.id,
                    step_id=self.key.step_id,
                    task_id=self.key.task_id,
                    action_type=run.action.type,
                    position=run.position,
                    cause=run.error,
                )
            elif run.effect is not None:
                self._publish(run.position, run.action, run.effect)
        if result.finish_error:
            log.error(
                "entry_terminal_write_failed",
                task_id=self.key.task_id,
                step_id=self.key.step_id,
                entry_seq=self.key.entry_seq,
                cause=result.finish_error,
            )
        return not result.stopped

    def context(self, key: EntryKey, position: int, now: float) -> ActionContext:
        """The executor context of one position: on_enter runs carry the entry-scoped idempotency key."""
        return ActionContext(
            task=self.task,
            step_id=self.step.id,
            step_name=self.step.name,
            trigger="on_enter",
            key_for=lambda agent, digest: (
                f"on_enter:{key.task_id}:{key.step_id}:{key.entry_seq}:{position}:{agent}:{digest}"
            ),
            exclude_from_coalescing=True,
            now=now,
        )

    def _mismatch(
        self, conn: sqlite3.Connection, key: EntryKey, now: float, entry: StepEntry | None = None
    ) -> str | None:
        """Compare the recorded digest with the declaration read now; on a mismatch close the entry
        declaration_changed and return the recorded digest."""
        declaration = self.step.events.on_enter
        entry = step_entries.get_entry(conn, key) if entry is None else entry
        current = step_entries.declaration_digest([a.type for a in declaration])
        if entry is None or entry.declaration_digest == current:
            return None
        with savepoint(conn, "close"):  # several writes: all of them or none
            close_entry(conn, key, declaration, "declaration_changed", now)
        return entry.declaration_digest

    async def _digest_matches(self, declaration: Sequence[ActionDecl]) -> bool:
        assert self.key is not None
        key, now = self.key, self.services.now()
        recorded = await self.services.store.transact(lambda conn: self._mismatch(conn, key, now))
        if recorded is None:
            return True
        self._declaration_changed(recorded)
        return False

    def _declaration_changed(self, recorded: str) -> None:
        assert self.key is not None
        self.out.diagnostic(
            "warning",
            "declaration_changed",
            workflow_id=self.workflow.id,
            step_id=self.key.step_id,
            task_id=self.key.task_id,
            recorded_digest=recorded,
            current_digest=step_entries.declaration_digest([a.type for a in self.step.events.on_enter]),
        )

    def not_executed(self, action: ActionDecl, reason: str) -> DiagnosticNote:
        """The AC-A6 WARNING for an action that reaches no executor on this entry path."""
        return DiagnosticNote(
            "warning",
            "action_not_executed",
            {
                "workflow_id": self.workflow.id,
                "step_id": self.step.id,
                "step_name": self.step.name,
                "action_type": action.type,
                "task_id": self.task.id,
                "entry_path": self.path,
                "reason": reason,
            },
        )

    def _unowned(self, action: ActionDecl) -> bool:
        """configure_session has no owner on E4 (AC-A2(i)): it is never requested there, only warned."""
        return self.path == "E4" and action.type == "configure_session"

    async def _session_action(self, position: int, action: ActionDecl) -> SessionOutcome | None:
        """Request one session action from the host; None when it has no owner on this path (AC-A6)."""
        if self._unowned(action):
            note = self.not_executed(action, "no_owner_on_entry_path")
            self.out.diagnostic(note.level, note.code, **note.fields)
            return None
        return await request_session_action(
            self.services,
            self.task,
            action,
            self.out,
            step_id=self.step.id,
            trigger="on_enter",
            position=position,
            entry_seq=self.key.entry_seq if self.key is not None else None,
            path=self.path,
        )

    def _skipping_after_failed_reset(
        self, reset_position: int, rest: Sequence[tuple[ChunkKind, list[tuple[int, ActionDecl]]]]
    ) -> None:
        """Warn that the session actions after a failed reset_agent_context will not be requested.

        The agent must not resume on a context that was never cleared, so configure_session, plan mode,
        session mode and auto_start_agent of this entry are not asked for; engine-owned actions still run
        (AC-A10, AC-C3). Nothing durable is written: session actions hold no marker and recovery never
        requests them (AC-B8), so a skipped one cannot come back for this entry. Source: issue 16 item 1,
        resolving AC-D1 (reset before auto_start, Kandev stops at a failed reset) against AC-C3.
        """
        skipped = [
            {"position": p, "action": a.type}
            for kind, actions in rest
            if kind == "session"
            for p, a in actions
            if not self._unowned(a)
        ]
        if not skipped:
            return
        self.out.diagnostic(
            "warning",
            "session_actions_skipped_after_failed_reset",
            workflow_id=self.workflow.id,
            task_id=self.task.id,
            step_id=self.step.id,
            entry_seq=self.key.entry_seq if self.key is not None else None,
            entry_path=self.path,
            reset_position=reset_position,
            skipped=skipped,
        )

    async def _external_action(
        self, key: EntryKey, position: int, action: ActionDecl
    ) -> Literal["next", "stop"]:
        """Claim first, act outside the database, then complete.

        run_code_review records its review-run row with the claim, then asks the host to start the pass with
        the entry identity and the row's id (a re-claim after a crash reuses the row: issue 12 item 7); a
        failed start is recorded on the row and warned, and neither blocks the entry nor fails the action
        (AC-A8). Any other engine-owned type without an executor is skipped(no_executor) with the AC-A6
        warning. A crash between claim and completion re-runs the action on recovery (at-least-once).
        """
        store, now = self.services.store, self.services.now()
        reviewing = action.type == "run_code_review"
        agent: str | None = getattr(action.config, "agent_profile_id", None)

        def claim(conn: sqlite3.Connection) -> tuple[step_entries.ClaimOutcome, int | None]:
            # The epoch is read in the writer: on PostgreSQL a reconnect may have replaced it (issue 15).
            outcome = step_entries.claim_marker(conn, key, position, action.type, store.epoch, now)
            if outcome != "claimed" or not reviewing:
                return outcome, None
            return outcome, review_runs.record_review_run(
                conn,
                task_id=key.task_id,
                step_id=key.step_id,
                entry_seq=key.entry_seq,
                position=position,
                agent_profile_id=agent,
                now=now,
            )

        outcome, review_run = await self.services.store.transact(claim)
        if outcome != "claimed":
            return "stop" if outcome == "live_peer" else "next"  # the stop rule; a terminal one never re-runs
        if store.fenced:  # self-fencing (issue 15): our epoch may be declared dead before the host acts
            return "stop"  # the claim stays; a live runtime finishes it once this epoch is dead
        effect = Effect("skipped", "no_executor", diagnostics=(self.not_executed(action, "no_executor"),))
        start_failure: str | None = None
        if reviewing:
            assert review_run is not None
            try:
                await self.services.host.start_code_review(
                    task_id=self.task.id,
                    step_id=self.step.id,
                    entry_seq=key.entry_seq,
                    review_run_id=review_run,
                    agent_profile_id=agent,
                )
                effect = Effect("done")
            except Exception as exc:
                start_failure = repr(exc)
                effect = Effect(
                    "done",
                    "start_failed",
                    diagnostics=(
                        DiagnosticNote(
                            "warning",
                            "code_review_start_failed",
                            {"task_id": self.task.id, "step_id": self.step.id, "cause": start_failure},
                        ),
                    ),
                )
        final, finished_at = effect, self.services.now()

        def complete(conn: sqlite3.Connection) -> None:
            if review_run is not None and start_failure is not None:
                review_runs.mark_start_failed(conn, review_run, start_failure)
            step_entries.finish_marker(
                conn, key, position, action.type, final.state, final.detail, finished_at
            )

        await self.services.store.transact(complete)
        self._publish(position, action, effect)
        return "next"

    def _publish(self, position: int, action: ActionDecl, effect: Effect) -> None:
        failure = None
        # the fan-out's contract is AC-C1 alone; publish_effect reads `failure` only for a failed effect
        if effect.state == "failed" and action.type != "queue_run_for_each_participant":
            failure = DiagnosticNote(
                "error",
                "on_enter_action_failed",
                {
                    "workflow_id": self.workflow.id,
                    "step_id": self.step.id,
                    "task_id": self.task.id,
                    "action_type": action.type,
                    "cause": effect.detail,
                },
            )
        publish_effect(
            self.out,
            effect,
            task_id=self.task.id,
            step_id=self.step.id,
            trigger="on_enter",
            position=position,
            kind=action.type,
            failure=failure,
        )

    async def _finish_if_terminal(self, key: EntryKey, declaration: Sequence[ActionDecl]) -> None:
        await self.services.store.transact(lambda conn: finish_if_terminal(conn, key, declaration))
