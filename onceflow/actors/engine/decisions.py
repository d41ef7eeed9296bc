"""The quorum guards a decision is counted and re-evaluated by. Trio thread (pure rules over rows): handed
to the store's `decisions.record` as its `DecisionRules`, and read by the task actor to re-evaluate a
step's guards after a vote. Source: kandev-engine-notes.md, "Quorum guards".
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from onceflow.actors.engine.quorum import Threshold, parse_threshold, seat_role, why_not_counted
from onceflow.protocol.workflow import ActionDecl, MoveConfig, Step, Trigger
from onceflow.store.records import Decision, Participant


@attrs.frozen
class GuardedMove:
    """A guarded transition of a step: its declaration and its `wait_for_quorum` role and threshold."""

    action: ActionDecl
    role: str
    threshold: Threshold


def quorum_guards(step: Step) -> list[GuardedMove]:
    """The step's guarded on_turn_complete transitions a decision re-evaluates, in declared order. A
    requires_approval transition never moves on a decision, so it is left out."""
    guarded = []
    for action in step.events.actions(Trigger.on_turn_complete):
        config = action.config
        if isinstance(config, MoveConfig) and config.guard is not None and not config.requires_approval:
            guard = config.guard
            guarded.append(GuardedMove(action, guard.role, parse_threshold(guard.threshold)))
    return guarded


class QuorumRules:
    """`store.decisions.DecisionRules` as `quorum` states them: a role-less decision takes its seat's role
    (`quorum.seat_role`), and it counts when a guarded transition of its step takes it into account
    (`quorum.why_not_counted`)."""

    def seat_role(
        self,
        rows: Sequence[Participant],
        *,
        task_id: str,
        step_id: str,
        decider_type: str,
        decider_id: str,
        participant_id: int | None,
    ) -> str | None:
        return seat_role(
            rows,
            task_id=task_id,
            step_id=step_id,
            decider_type=decider_type,
            decider_id=decider_id,
            participant_id=participant_id,
        )

    def not_counted(self, decision: Decision, step: Step, rows: Sequence[Participant]) -> str | None:
        guards = [(guard.role, guard.threshold) for guard in quorum_guards(step)]
        return why_not_counted(decision, guards, rows)


QUORUM_RULES = QuorumRules()
"""The rules every recorded decision is judged by."""
