"""Seating a participant: the one rule for template-level and per-task seats. Trio thread."""

from __future__ import annotations

from onceflow.actors.kernel.services import Services
from onceflow.protocol import commands as c
from onceflow.protocol.results import ParticipantAdded
from onceflow.protocol.workflow import Workflow, find_step
from onceflow.store.entries import participants


async def add_participant(
    services: Services, command: c.AddParticipant, *, workflow: Workflow, task_id: str | None
) -> ParticipantAdded:
    """Seat `command`'s participant at its step of `workflow`: for every task of the workflow (`task_id`
    None, a template-level row) or for `task_id` alone (a per-task row, which wins over a template row of
    the same role and agent). The same seat sent again (every field identical) adds nothing and answers
    the existing row's id with `already_existed` true. Raises NotFoundError (field step_id) when the
    workflow has no such step."""
    find_step(workflow, command.step_id)
    participant_id, existed = await services.store.transact(
        participants.seat_participant,
        workflow_id=workflow.id,
        step_id=command.step_id,
        task_id=task_id,
        role=command.role,
        agent_profile_id=command.agent_profile_id,
        decision_required=command.decision_required,
        position=command.position,
    )
    return ParticipantAdded(participant_id=participant_id, already_existed=existed)
