"""The runtime-level commands: templates and their versions (actors/runtime/versions.py), template-level
seats, the runs queue (actors/runtime/runs.py),
the task list, a task's history, review runs and coordinator outcomes. Trio thread: each is a store request
(a template is parsed on a worker thread).
"""

from __future__ import annotations

from typing import Protocol, TypeAlias

from onceflow.actors.engine.participants import add_participant
from onceflow.actors.kernel.outbox import Outbox
from onceflow.actors.kernel.services import Services, WorkflowRegistry
from onceflow.actors.runtime import flow as flow_commands
from onceflow.actors.runtime import runs as run_commands
from onceflow.actors.runtime import versions
from onceflow.actors.runtime.host_broker import HostBroker
from onceflow.actors.runtime.outcome import OutcomeSupervisor
from onceflow.actors.task.migrate import MigrateTask
from onceflow.observability.logs import get_logger
from onceflow.protocol import commands as c
from onceflow.protocol.errors import NotFoundError
from onceflow.protocol.results import (
    AckQueued,
    AlreadyApplied,
    ClaimedRun,
    FinishOutcome,
    HistoryPage,
    HostCallInfo,
    HostCallPage,
    LimitInfo,
    MigrationResult,
    OutcomeInfo,
    OutcomeReceived,
    ParticipantAdded,
    ParticipantList,
    ParticipantRemoved,
    PauseList,
    PauseResult,
    QueueStatsResult,
    ResumeResult,
    ReviewRunPage,
    RunCancelledResult,
    RunInfo,
    RunPage,
    RunRenewed,
    RunRequeued,
    RunRetried,
    TaskPage,
    WorkflowList,
    WorkflowRegistered,
    WorkflowText,
)
from onceflow.store.entries import participants, review_runs
from onceflow.store.outcomes import host_calls
from onceflow.store.runs import runs
from onceflow.store.tasks import history, tasks

log = get_logger("onceflow.supervisor")

RuntimeResult: TypeAlias = (
    WorkflowRegistered
    | ParticipantAdded
    | ParticipantRemoved
    | ClaimedRun
    | RunRenewed
    | FinishOutcome
    | RunCancelledResult
    | RunRequeued
    | RunRetried
    | RunInfo
    | LimitInfo
    | PauseResult
    | ResumeResult
    | PauseList
    | QueueStatsResult
    | RunPage
    | TaskPage
    | ReviewRunPage
    | HistoryPage
    | HostCallPage
    | OutcomeReceived
    | AckQueued
    | OutcomeInfo
    | MigrationResult
    | AlreadyApplied
    | WorkflowList
    | WorkflowText
    | ParticipantList
    | None
)
"""A runtime-level command's reply result (None: `claim_run` found no run)."""


class Reconfigurable(Protocol):
    """What registering a template changes: the runtime's services (its workflows), by reconfiguring."""

    @property
    def services(self) -> Services: ...

    def reconfigure(self, *, workflows: WorkflowRegistry | None = None) -> None: ...

    async def ask_task(self, task_id: str, message: MigrateTask) -> object: ...


async def handle(
    runtime: Reconfigurable, outcomes: OutcomeSupervisor, command: c.RuntimeCommand, out: Outbox
) -> RuntimeResult:
    """Apply one runtime-level command; raises OnceflowError subclasses for refused ones (each handler below
    names its own)."""
    services = runtime.services
    store = services.store
    match command:
        case c.RegisterWorkflow():
            return await versions.register_workflow(
                runtime, command.yaml, command.source, import_path=command.import_path
            )
        case c.AddParticipant():  # template-level: a per-task one is routed to its task
            workflow = services.workflows.get(command.workflow_id or "")
            return await add_participant(services, command, workflow=workflow, task_id=None)
        case c.RemoveParticipant():
            if not await store.transact(participants.remove_participant, command.participant_id):
                raise NotFoundError(
                    f"participant {command.participant_id} does not exist", field="participant_id"
                )
            return ParticipantRemoved(removed=True)
        case c.ClaimRun():
            return await run_commands.claim(services, command, out)
        case c.RenewRun():
            return await run_commands.renew(services, command)
        case c.FinishRun():
            return await run_commands.finish(services, command, out)
        case c.CancelRun():
            return await run_commands.cancel(services, command, out)
        case c.RequeueRun():
            return await run_commands.requeue(services, command, out)
        case c.RetryRun():
            return await run_commands.retry(services, command, out)
        case c.GetRun():
            return await run_commands.get(services, command)
        case c.SetLimits():
            return await flow_commands.set_limits(services, command, out)
        case c.Pause():
            return await flow_commands.pause(services, command, out)
        case c.Resume():
            return await flow_commands.resume(services, command, out)
        case c.ListPauses():
            return await flow_commands.list_pauses(services)
        case c.QueueStats():
            return await flow_commands.queue_stats(services)
        case c.ListRuns():
            rows, more = await store.transact(
                runs.runs_page,
                after_id=command.after_run_id,
                limit=command.limit,
                task_id=command.task_id,
                agent_profile_id=command.agent_profile_id,
                status=command.status,
            )
            return RunPage(runs=rows, next_after_run_id=rows[-1]["id"] if more else None)
        case c.ListTasks():
            page, more = await store.transact(
                tasks.list_tasks, after_task_id=command.after_task_id, limit=command.limit
            )
            return TaskPage(
                tasks=[tasks.task_info(task) for task in page],
                next_after_task_id=page[-1].id if more else None,
            )
        case c.ListReviewRuns():
            passes, more = await store.transact(
                review_runs.review_runs_page,
                task_id=command.task_id,
                after_id=command.after_review_run_id,
                limit=command.limit,
            )
            return ReviewRunPage(
                review_runs=passes, next_after_review_run_id=passes[-1]["id"] if more else None
            )
        case c.TaskHistory():
            if isinstance(services.host, HostBroker):
                await services.host.flushed()  # the host calls that ended are in the history
            return await store.transact(history.task_page, command.task_id, command.after, command.limit)
        case c.ListHostCalls():
            return await list_host_calls(services, command)
        case c.MigrateTasks():
            return await versions.migrate_tasks(runtime, command)
        case c.ListWorkflows():
            return await versions.list_workflows(services)
        case c.GetWorkflow():
            return await versions.get_workflow(services, command)
        case c.ListParticipants():
            return await versions.list_participants(services, command)
        case c.OutcomeReady() | c.CoordinatorAck() | c.GetOutcome():
            return await outcomes.handle(command, out)


async def list_host_calls(services: Services, command: c.ListHostCalls) -> HostCallPage:
    """`list_host_calls`: a page of the recorded calls (store/outcomes/host_calls.py) and, on the last page,
    the calls the host role still waits on (`HostBroker.pending`; none when the runtime's host is in
    process)."""
    broker = services.host if isinstance(services.host, HostBroker) else None
    if broker is not None:
        await broker.flushed()  # a call that ended before this command is listed
    calls: list[HostCallInfo] = []
    next_after_id = None
    if command.status != "pending":
        calls, next_after_id = await services.store.transact(
            host_calls.page,
            status=command.status,
            task_id=command.task_id,
            kind=command.kind,
            after_id=command.after_id,
            limit=command.limit,
        )
    if next_after_id is None and command.status in (None, "pending") and broker is not None:
        calls += broker.pending(task_id=command.task_id, kind=command.kind)
    return HostCallPage(calls=calls, next_after_id=next_after_id)


register_workflow = versions.register_workflow
load_workflows = versions.load_workflows
parse = versions.parse
