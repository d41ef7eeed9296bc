"""One readable line per protocol event (the CLI's trace output). Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onceflow.protocol import events as e

ENTRY_PATHS = {
    "E1": "transition",
    "E2": "manual move",
    "E3": "WIP promotion",
    "E4": "switch_workflow",
    "E5": "task update/start",
    "recovery": "recovery",
}
"""How a task entered a step (the spec's entry paths E1-E5)."""


_CONTROLS: dict[int, str] = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))},
    **{ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"},
    # line/paragraph separators and the bidirectional overrides ("Trojan Source") reorder or break lines too
    **{code: f"\\u{code:04x}" for code in (0x061C, 0x200E, 0x200F, 0x2028, 0x2029)},
    **{code: f"\\u{code:04x}" for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))},
}


def escape_controls(text: str) -> str:
    """`text` with every control character written as a backslash escape (`\\n`, `\\x1b`, `\\u202e`).

    For human output: an id holding a newline can no longer forge a trace line, nor an ANSI escape drive the
    terminal. Idempotent: the result holds no control character.
    """
    return text.translate(_CONTROLS)


def describe(event: e.Event) -> str:
    """A short human-readable description of an event, control characters escaped (`escape_controls`)."""
    return escape_controls(_describe(event))


def _describe(event: e.Event) -> str:
    from onceflow.protocol import (
        events as e,
    )  # the models only when an event is shown (`escape_controls`: never)

    match event:
        case e.TaskCreated():
            return f"task {event.task_id} created in {event.workflow_id} at {event.step_id}"
        case e.Transition():
            return f"transition {event.from_step} -> {event.to_step} ({event.trigger})"
        case e.StepEntered():
            seq = f" entry #{event.entry_seq}" if event.entry_seq is not None else ""
            return f"entered {event.step_id}{seq} by {ENTRY_PATHS[event.entry_path]} ({event.entry_path})"
        case e.TaskQueued():
            return f"queued at {event.step_id}: the step is at its WIP limit (not an entry yet)"
        case e.GuardEvaluated():
            verdict = "met" if event.satisfied else "not met"
            return (
                f"guard {event.role} {event.threshold} -> {event.target_step}: {verdict}"
                f" ({event.approvals}/{event.seats} approvals, {event.reason})"
            )
        case e.ActionOutcome():
            detail = f" ({event.detail})" if event.detail else ""
            return f"{event.trigger}[{event.position}] {event.kind}: {event.outcome}{detail}"
        case e.RunQueued():
            return f"run #{event.run_id} queued for {event.agent_profile_id} ({event.reason})"
        case e.RunSuppressed():
            return f"run for {event.agent_profile_id} suppressed (same key as #{event.existing_run_id})"
        case e.RunCoalesced():
            return f"run #{event.run_id} for {event.agent_profile_id} coalesced (x{event.coalesced_count})"
        case e.RunClaimed():
            return f"run #{event.run_id} claimed by {event.agent_profile_id} (attempt {event.attempt})"
        case e.RunFinished():
            superseded = ", its entry left meanwhile" if event.superseded else ""
            return f"run #{event.run_id} finished{superseded}"
        case e.RunRetryScheduled():
            return f"run #{event.run_id} failed ({event.error}); retry {event.retries} scheduled"
        case e.RunFailed():
            return f"run #{event.run_id} failed for good ({event.reason})"
        case e.RunCancelled():
            return f"run #{event.run_id} cancelled ({event.reason})"
        case e.RunLeaseExpired():
            return f"run #{event.run_id}'s lease expired: queued again"
        case e.RunRateLimited():
            return (
                f"run for {event.agent_profile_id} ({event.reason}) refused: {event.limit}"
                f" {event.limit_value} reached"
            )
        case e.RunClaimHeld():
            held = f" ({event.limit_scope} {event.limit_id or ''} max {event.max_concurrent})".replace(
                "  ", " "
            )
            return f"claim held: {event.reason}{held if event.reason == 'at_capacity' else ''}"
        case e.RunRequeued():
            return f"run #{event.run_id} handed back by {event.agent_profile_id}: queued again"
        case e.FlowChanged():
            target = f" {event.id}" if event.id else ""
            return f"flow {event.change}: {event.scope}{target}"
        case e.DecisionRecorded():
            return f"decision by {event.decider_id} at {event.step_id}: {event.decision}"
        case e.DecisionsCleared():
            return f"decisions cleared at {event.step_id} ({event.deleted} removed)"
        case e.SessionAction():
            return f"host asked: {event.action} (session {event.session_id})"
        case e.HostCallUnanswered():
            return (
                f"host call {event.call_id}: {event.status} after {event.attempts} offer(s) ({event.message})"
            )
        case e.Diagnostic():
            fields = " ".join(f"{k}={v}" for k, v in event.fields.items())
            return f"{event.level}: {event.code} {fields}".rstrip()
    return event.model_dump_json()
