"""on_enter dispatch for one step entry: the ownership partition, the host's actions and the stop rule.
Trio thread: it plans, asks the host and publishes; the store executes what it is handed
(store/entries/segment.py).

The order of an entry's actions is `order.dispatch_order`'s. On E4 configure_session only warns. On every
path a failed reset_agent_context stops the entry's later session actions, not its engine-owned ones. A
recovery re-dispatch runs engine-owned actions only (AC-B8). Each engine-owned action is claimed by
compare-and-set on its marker with the runtime's epoch; a database-effect action claims, applies and
completes in one transaction, and a run of them shares one (a segment), which is the admitting transaction
itself when no host action comes first. Source: on-enter-action-dispatch.md, "The ownership partition"
and "Execution model".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
from opentelemetry import trace
from opentelemetry.trace import Tracer

from onceflow.actors.engine.order import Chunk, dispatch_order, plan_chunks
from onceflow.actors.engine.publish import publish_effect
from onceflow.actors.engine.session import SessionOutcome, request_session_action
from onceflow.actors.kernel import causation
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services
from onceflow.observability import tracing
from onceflow.observability.logs import get_logger
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ActionDecl, Step, Workflow
from onceflow.store.entries import step_entries
from onceflow.store.entries.executors import DiagnosticNote, Effect
from onceflow.store.entries.segment import (
    Segment,
    SegmentResult,
    claim_external,
    close_if_changed,
    complete_external,
    finish_if_terminal,
    run_segment,
)
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.records import TaskRecord

log = get_logger("onceflow.on_enter")


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

    async def run(self, first: SegmentResult | None = None, admitted: tuple[int, int] | None = None) -> None:
        """Dispatch the entry. `first` is the result of the leading segment when the admitting transaction
        already ran it (see `leading_segment`); it is published and dispatch goes on after it.

        Traced (a recording tracer), each engine-owned action gets a span `onceflow.action <type>`: timed as
        the transaction that ran it for a segment (`admitted`: when the admission that ran `first` started
        and ended, Unix ns), around its claim, host call and completion for an external one."""
        declaration = self.step.events.on_enter  # read once for the whole dispatch
        tracer = self.services.tracing.tracer()
        chunks, last_engine = self._plan()
        start = 0
        digest_pending = self.key is not None
        if first is not None:
            mark = len(self.out.events)
            published = self.publish_segment(first)
            if tracer is not None and admitted is not None:
                tracing.action_spans(tracer, self.out.events[mark:], *admitted, self._ids())
            if not published:
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
                if await self._traced_external(tracer, self.key, *actions[0]) == "stop":
                    return
                continue
            segment = self.segment(actions, check_digest=digest_pending, finish=index == last_engine)
            store = self.services.store
            started = tracing.now() if tracer is not None else 0
            result = await store.transact(run_segment, segment, store, self.services.now())
            digest_pending = False
            mark, ended = len(self.out.events), tracing.now() if tracer is not None else 0
            published = self.publish_segment(result)
            if tracer is not None:
                tracing.action_spans(tracer, self.out.events[mark:], started, ended, self._ids())
            if not published:
                return
        if self.key is not None and (last_engine < 0 or chunks[last_engine][0] == "external"):
            await self._finish_if_terminal(self.key, declaration)

    def segment(
        self, actions: Sequence[tuple[int, ActionDecl]], *, check_digest: bool, finish: bool
    ) -> Segment:
        """What the store executes for `actions` of this entry (store/entries/segment.py `run_segment`)."""
        assert self.key is not None
        return Segment(
            self.task,
            self.step,
            self.key,
            tuple(actions),
            self.services.executors,
            check_digest,
            finish,
            causation.current(),
        )

    def _plan(self) -> tuple[list[Chunk], int]:
        """The chunks of this entry's dispatch order and the index of the last engine chunk (-1: none)."""
        order = dispatch_order(self.step.events.on_enter, self.path)
        return plan_chunks(order, self.services.executors, has_entry=self.key is not None)

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

    async def _digest_matches(self, declaration: Sequence[ActionDecl]) -> bool:
        assert self.key is not None
        key, now = self.key, self.services.now()
        recorded = await self.services.store.transact(close_if_changed, key, declaration, now)
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

    def _skipping_after_failed_reset(self, reset_position: int, rest: Sequence[Chunk]) -> None:
        """Warn that the session actions after a failed reset_agent_context will not be requested.

        The agent must not resume on a context that was never cleared, so configure_session, plan mode,
        session mode and auto_start_agent of this entry are not asked for; engine-owned actions still run
        (AC-A10, AC-C3). Nothing durable is written: session actions hold no marker and recovery never
        requests them (AC-B8), so a skipped one cannot come back for this entry. This resolves AC-D1 (reset
        before auto_start, Kandev stops at a failed reset) against AC-C3.
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

    def _ids(self) -> tracing.Attributes:
        """The attributes this entry's spans share."""
        return tracing.ids(
            task_id=self.task.id,
            step_id=self.step.id,
            entry_seq=self.key.entry_seq if self.key is not None else None,
            entry_path=self.path,
        )

    async def _traced_external(
        self, tracer: Tracer | None, key: EntryKey, position: int, action: ActionDecl
    ) -> Literal["next", "stop"]:
        """`_external_action`, in the span `onceflow.action <type>` when traced."""
        if tracer is None:
            return await self._external_action(key, position, action, None)
        attributes = {**self._ids(), tracing.ACTION_TYPE: action.type, tracing.ACTION_POSITION: position}
        attributes[tracing.TRIGGER] = "on_enter"
        with tracing.span(tracer, f"onceflow.action {action.type}", attributes):
            return await self._external_action(key, position, action, tracer)

    async def _external_action(
        self, key: EntryKey, position: int, action: ActionDecl, tracer: Tracer | None
    ) -> Literal["next", "stop"]:
        """Claim first, act outside the database, then complete.

        run_code_review records its review-run row with the claim, then asks the host to start the pass with
        the entry identity and the row's id (a re-claim after a crash reuses the row); a
        failed start is recorded on the row and warned (`code_review_start_failed`, with the exception's
        `error_type`, `error` message and `cause` repr), and neither blocks the entry nor fails the action
        (AC-A8). Any other engine-owned type without an executor is skipped(no_executor) with the AC-A6
        warning. A crash between claim and completion re-runs the action on recovery (at-least-once).
        """
        store, now = self.services.store, self.services.now()
        reviewing = action.type == "run_code_review"
        agent: str | None = getattr(action.config, "agent_profile_id", None)
        outcome, review_run = await store.transact(claim_external, key, position, action, store, now)
        if outcome != "claimed":
            return "stop" if outcome == "live_peer" else "next"  # the stop rule; a terminal one never re-runs
        if store.fenced:  # self-fencing: our epoch may be declared dead before the host acts
            return "stop"  # the claim stays; a live runtime finishes it once this epoch is dead
        effect = Effect("skipped", "no_executor", diagnostics=(self.not_executed(action, "no_executor"),))
        start_failure: str | None = None
        if reviewing:
            assert review_run is not None
            try:
                call = self.services.host.start_code_review(
                    task_id=self.task.id,
                    step_id=self.step.id,
                    entry_seq=key.entry_seq,
                    review_run_id=review_run,
                    agent_profile_id=agent,
                )
                if tracer is None:
                    await call
                else:
                    attributes = {**self._ids(), "onceflow.review_run_id": review_run}
                    with tracing.span(tracer, "onceflow.host start_code_review", attributes):
                        await call
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
                            {
                                "task_id": self.task.id,
                                "step_id": self.step.id,
                                "cause": start_failure,
                                "error_type": type(exc).__name__,
                                "error": str(exc),
                            },
                        ),
                    ),
                )
        await store.transact(
            complete_external,
            key,
            position,
            action.type,
            effect,
            self.services.now(),
            review_run=review_run,
            start_failure=start_failure,
        )
        self._publish(position, action, effect)
        if tracer is not None:
            span = trace.get_current_span()
            span.set_attribute(tracing.ACTION_OUTCOME, effect.state)
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
        await self.services.store.transact(finish_if_terminal, key, declaration)
