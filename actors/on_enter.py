"""on_enter dispatch for one step entry: the ownership partition, markers and the stop rule.

On E1-E3 and E5 the session-scoped actions go to the host at fixed positions (reset first, configure second,
auto_start last), engine-owned actions run in declared order between them. On E4 (switch_workflow) every
action runs in declared order and configure_session only warns. A recovery re-dispatch runs engine-owned
actions only (AC-B8). Each engine-owned action is claimed by compare-and-set on its marker with the
runtime's epoch; a database-effect action claims, applies and completes in one transaction.
Source: on-enter-action-dispatch.md, "The ownership partition" and "Execution model".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Literal

import attrs
import structlog

from onceflow.actors.actions import ActionContext, DiagnosticNote, Effect, publish_effect
from onceflow.actors.outbox import Outbox
from onceflow.actors.services import Services
from onceflow.actors.session import request_session_action
from onceflow.protocol.events import EntryPath
from onceflow.protocol.workflow import ENGINE_ACTION_TYPES, SESSION_ACTION_TYPES, ActionDecl, Step, Workflow
from onceflow.store import review_runs, step_entries
from onceflow.store.records import TaskRecord
from onceflow.store.step_entries import EntryKey

log = structlog.get_logger("onceflow.on_enter")

_LEADING = ("reset_agent_context", "configure_session")


def dispatch_order(declaration: Sequence[ActionDecl], path: EntryPath) -> list[tuple[int, ActionDecl]]:
    """The (position, action) sequence one entry executes; positions index the whole declared list.

    E4 keeps declared order. Elsewhere: reset_agent_context then configure_session (each at most once,
    AC-H8), the rest in declared order, auto_start_agent last. `recovery` keeps engine-owned actions only.
    """
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


@attrs.frozen
class _Run:
    """What one engine-action transaction found: the claim outcome and, if it ran, its effect."""

    claim: step_entries.ClaimOutcome
    effect: Effect | None = None


@attrs.define
class OnEnterDispatch:
    """Runs the on_enter declaration of `step` for one entry of `task` (key None: no engine actions)."""

    services: Services
    task: TaskRecord
    workflow: Workflow
    step: Step
    key: EntryKey | None
    path: EntryPath
    out: Outbox

    async def run(self) -> None:
        declaration = self.step.events.on_enter  # read once for the whole dispatch
        if self.key is not None and not await self._digest_matches(declaration):
            return
        for position, action in dispatch_order(declaration, self.path):
            if action.type in SESSION_ACTION_TYPES:
                await self._session_action(position, action)
                continue
            if self.key is None:
                continue
            outcome = await self._engine_action(self.key, position, action)
            if outcome == "stop":
                return
        if self.key is not None:
            await self._finish_if_terminal(self.key, declaration)

    async def _digest_matches(self, declaration: Sequence[ActionDecl]) -> bool:
        assert self.key is not None
        key = self.key
        current = step_entries.declaration_digest([a.type for a in declaration])

        def check(conn: sqlite3.Connection) -> str | None:
            entry = step_entries.get_entry(conn, key)
            if entry is None or entry.declaration_digest == current:
                return None
            close_entry(conn, key, declaration, "declaration_changed", self.services.now())
            return entry.declaration_digest

        recorded = await self.services.store.transact(check)
        if recorded is None:
            return True
        self.out.diagnostic(
            "warning",
            "declaration_changed",
            workflow_id=self.workflow.id,
            step_id=key.step_id,
            task_id=key.task_id,
            recorded_digest=recorded,
            current_digest=current,
        )
        return False

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

    async def _session_action(self, position: int, action: ActionDecl) -> None:
        if self.path == "E4" and action.type == "configure_session":  # no owner on E4 (AC-A2(i), AC-A6)
            note = self.not_executed(action, "no_owner_on_entry_path")
            self.out.diagnostic(note.level, note.code, **note.fields)
            return
        await request_session_action(self.services, self.task, self.step.id, action, self.path, self.out)

    async def _engine_action(
        self, key: EntryKey, position: int, action: ActionDecl
    ) -> Literal["next", "stop"]:
        epoch, now = self.services.store.epoch, self.services.now()
        ctx = ActionContext(
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

        executor = self.services.executors.get(action.type)
        if executor is not None:

            def apply(conn: sqlite3.Connection) -> _Run:
                claim = step_entries.claim_marker(conn, key, position, action.type, epoch, now)
                if claim != "claimed":
                    return _Run(claim)
                effect = executor(conn, ctx, action)
                step_entries.finish_marker(conn, key, position, action.type, effect.state, effect.detail, now)
                return _Run(claim, effect)

            try:
                run = await self.services.store.transact(apply)
            except Exception as exc:  # transient: nothing committed, the entry stays open for the next start
                self.out.diagnostic(
                    "error",
                    "on_enter_action_failed",
                    workflow_id=self.workflow.id,
                    step_id=key.step_id,
                    task_id=key.task_id,
                    action_type=action.type,
                    position=position,
                    cause=repr(exc),
                )
                return "stop" if action.type == "clear_decisions" else "next"  # AC-C2 vs AC-C3
        else:
            run = await self._external_action(key, position, action, epoch)
        if run.claim == "live_peer":
            return "stop"  # the stop rule: a live peer owns this entry; it will finish every position
        if run.effect is None:
            return "next"  # already terminal: never re-executed
        self._publish(position, action, run.effect)
        if action.type == "clear_decisions" and run.effect.state == "failed":
            return "stop"
        return "next"

    async def _external_action(self, key: EntryKey, position: int, action: ActionDecl, epoch: str) -> _Run:
        """Claim first, act outside the database, then complete.

        run_code_review records its review-run row with the claim, then asks the host to start the pass; a
        failed start is recorded on the row and warned, and neither blocks the entry nor fails the action
        (AC-A8). Any other engine-owned type without an executor is skipped(no_executor) with the AC-A6
        warning. A crash between claim and completion re-runs the action on recovery (at-least-once).
        """
        now = self.services.now()
        reviewing = action.type == "run_code_review"

        def claim(conn: sqlite3.Connection) -> tuple[step_entries.ClaimOutcome, int | None]:
            outcome = step_entries.claim_marker(conn, key, position, action.type, epoch, now)
            if outcome != "claimed" or not reviewing:
                return outcome, None
            return outcome, review_runs.record_review_run(
                conn, task_id=key.task_id, step_id=key.step_id, now=now
            )

        outcome, review_run = await self.services.store.transact(claim)
        if outcome != "claimed":
            return _Run(outcome)
        effect = Effect("skipped", "no_executor", diagnostics=(self.not_executed(action, "no_executor"),))
        start_failure: str | None = None
        if reviewing:
            agent: str | None = getattr(action.config, "agent_profile_id", None)
            try:
                await self.services.host.start_code_review(
                    task_id=self.task.id, step_id=self.step.id, agent_profile_id=agent
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
        final = effect

        def complete(conn: sqlite3.Connection) -> None:
            if review_run is not None and start_failure is not None:
                review_runs.mark_start_failed(conn, review_run, start_failure)
            step_entries.finish_marker(
                conn, key, position, action.type, final.state, final.detail, self.services.now()
            )

        await self.services.store.transact(complete)
        return _Run(outcome, effect)

    def _publish(self, position: int, action: ActionDecl, effect: Effect) -> None:
        failure = None
        if action.type != "queue_run_for_each_participant":  # the fan-out's contract is AC-C1 alone
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
        positions = {p for p, a in enumerate(declaration) if a.type in ENGINE_ACTION_TYPES}

        def finish(conn: sqlite3.Connection) -> None:
            marks = step_entries.markers(conn, key)
            if all(p in marks and marks[p].state in step_entries.TERMINAL_STATES for p in positions):
                step_entries.mark_terminal(conn, key)

        await self.services.store.transact(finish)
