"""The runtime: a supervisor nursery over the store actor, the ledger actor and one actor per task.

`open_runtime` opens the store (taking the database's OS lock), starts the ledger, loads the registered
workflows, runs the recovery scan, and only then serves commands. Commands naming a task go to that task's
actor: an idle task's command runs on its asker's own Trio task, and an actor task is spawned only for
the commands queued behind a busy one (or to keep it warm); the rest are handled here. A task actor that
raises is logged at ERROR with its task id and restarted on the same mailbox; the others keep running.
Leaving the context closes every mailbox, lets the actors (and commands still running on their askers'
tasks) drain what is queued, then closes the store.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import outcome
import trio
from pydantic import BaseModel, ValidationError

from onceflow.actors.engine.actions import DEFAULT_EXECUTORS, Executor
from onceflow.actors.engine.core import Engine
from onceflow.actors.engine.promotion import Promotion, may_promote
from onceflow.actors.engine.recovery import recover_open_entries
from onceflow.actors.kernel import task_rows
from onceflow.actors.kernel.groups import raise_single
from onceflow.actors.kernel.ledger import LedgerActor
from onceflow.actors.kernel.mailbox import Envelope, Mailbox, ReplySlot, reply_to
from onceflow.actors.kernel.operation_locks import TaskLocks
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import Services, WorkflowRegistry, find_step
from onceflow.actors.runtime.epoch_sweep import SWEEP_INTERVAL, recover_at_start, sweep_forever
from onceflow.actors.runtime.outcome import OutcomeSupervisor
from onceflow.actors.task.actor import TaskActor
from onceflow.logs import get_logger
from onceflow.protocol import commands as c
from onceflow.protocol.codec import decode_command, validation_error
from onceflow.protocol.coordinator import Coordinator, RetryPolicy
from onceflow.protocol.durations import seconds
from onceflow.protocol.errors import (
    NotFoundError,
    OnceflowError,
    ShuttingDownError,
    WorkflowInvalidError,
    shown,
)
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.protocol.host import BaseHost, Host
from onceflow.protocol.workflow import (
    ALLOWED_ACTIONS,
    IMPORT_ALLOWED_ACTIONS,
    Workflow,
    WorkflowError,
    load_workflow_text,
)
from onceflow.store import epochs, participants, review_runs, runs, tasks, workflows
from onceflow.store import wip as store_wip
from onceflow.store.workflows import StoredWorkflow
from onceflow.store.writer import DEFAULT_BUSY_TIMEOUT, Durability, open_store

log = get_logger("onceflow.supervisor")

SWITCH_INTERVAL = 0.00005
"""Seconds: the GIL switch interval `onceflow serve` runs with (`open_runtime`'s `switch_interval`): short
enough that the store's writer thread gets the GIL back soon after SQLite's work, so it runs beside the Trio
thread instead of after it (bench/dispatch.py, issue 14)."""


@attrs.frozen
class _TaskMessage:
    command: Any


class Runtime:
    """The embedding API: `await rt.send(command)` returns a `Reply`; `rt.subscribe()` streams events."""

    def __init__(
        self,
        services: Services,
        nursery: trio.Nursery,
        hub: EventHub,
        outcomes: OutcomeSupervisor,
        actor_idle_timeout: float = 0.0,
    ) -> None:
        self.services = services
        self.actor_idle_timeout = seconds("actor_idle_timeout", actor_idle_timeout, allow_zero=True)
        self._outcomes = outcomes
        self.engine = Engine(services)
        self._nursery = nursery
        self._hub = hub
        self._mailboxes: dict[str, Mailbox[_TaskMessage]] = {}  # the live actors (busy, or warm)
        self._closing = False
        self._lent: set[trio.CancelScope] = set()  # commands running on their askers' own tasks (`_ask`)
        self._lenders_done = trio.Event()  # set once shutdown began and no command is lent any more
        nursery.start_soon(self._guard_lent)

    @property
    def epoch(self) -> str:
        """This runtime start's epoch (random, never reused), as written into in_progress markers."""
        return self.services.store.epoch

    @property
    def live_actors(self) -> int:
        """How many task actors are alive now (idle ones are evicted after `actor_idle_timeout` seconds)."""
        return len(self._mailboxes)

    def subscribe(self) -> trio.MemoryReceiveChannel[Event]:
        """A stream of every event emitted from now on; it ends when the runtime closes."""
        return self._hub.subscribe()

    async def send(self, command: c.Command | BaseModel | dict[str, Any] | str | bytes) -> Reply:
        """Apply one command and return its reply. Never raises (but for cancellation): the reply says what
        failed.

        A malformed, oversized or unknown message — any bytes at all — gets `ok: false` with
        `error.code == "invalid_message"` and `error.field` naming the field when one is to blame; the
        runtime keeps serving and nothing is applied. Anything unexpected is logged at ERROR with its
        traceback and answered `internal` (issue 11, "`Runtime.send` never raises, whatever the bytes").
        A storage fault (the database busy past the busy timeout, a full disk, an I/O error, a read-only or
        corrupt file) gets `storage_<kind>` with `error.retryable` saying whether sending the same command
        again later can help (issue 11, items 2 and 4).
        """
        name = "unknown"
        out = Outbox(self._hub)
        try:
            parsed = command if isinstance(command, c.COMMAND_TYPES) else decode_command(command)
            name = getattr(parsed, "type", type(parsed).__name__)
            if self._closing:
                raise ShuttingDownError("the runtime is shutting down")
            task_id = c.task_id_of(parsed)
            if task_id is None:
                result = await self._handle_here(parsed, out)
            else:
                result, out = await self._ask(task_id, _TaskMessage(parsed))
        except OnceflowError as exc:
            return out.reply(name, error=_error_info(exc))
        except ValidationError as exc:
            return out.reply(name, error=_error_info(validation_error(exc)))
        except _Refused as refused:
            return refused.out.reply(name, error=_error_info(refused.error))
        except _ActorFailure as failure:
            return failure.out.reply(name, error=failure.info)
        except Exception as exc:
            log.error("command_failed", command=name, cause=shown(exc), exc_info=True)
            info = ErrorInfo(code="internal", message=f"{name} failed: {shown(exc)}")
            return out.reply(name, error=info)
        return out.reply(name, result=result)

    async def _ask(self, task_id: str, message: _TaskMessage) -> Any:
        """Have the task's actor handle `message`: queued behind the actor's current command when it is
        busy (or warm, under a positive `actor_idle_timeout`), else run at once on the asker's own task.

        The second case spawns nothing: the asker lends its task to the actor. The routing-table entry is
        the actor's busy flag (later messages queue in its mailbox) and the command runs shielded, so a
        cancelled asker still completes it, as a spawned actor would (its cancellation is delivered once the
        command is done). Whatever queued meanwhile is handed to a spawned actor; an empty mailbox is evicted
        at once (timeout 0) or kept warm by a spawned actor. Issue 14, item "No per-message actor churn".

        Raises ShuttingDownError once shutdown has begun and the task has no actor; re-raises the command's
        failure as `_Refused` or `_ActorFailure`, as `Mailbox.ask` does.
        """
        mailbox = self._mailboxes.get(task_id)
        if mailbox is not None:
            return await mailbox.ask(message)
        if self._closing:  # a mailbox opened now would never be closed: shutdown would wait on it forever
            raise ShuttingDownError("the runtime is shutting down")
        mailbox = self._mailboxes[task_id] = Mailbox()
        slot = ReplySlot()
        token = epochs.CURRENT_TASK.set(task_id)  # its transactions hold the task's lock (issue 15)
        try:
            with trio.CancelScope(shield=True) as scope:  # cancelled by `_guard_lent` alone
                self._lent.add(scope)
                try:
                    await self._serve(TaskActor(task_id, self.engine, TaskLocks()), Envelope(message, slot))
                except _Restart as restart:
                    log.error("task_actor_crashed", task_id=task_id, cause=restart.cause)
                finally:
                    self._hand_over(task_id, mailbox)
        finally:
            epochs.CURRENT_TASK.reset(token)
            self._lent.discard(scope)
            if self._closing and not self._lent:
                self._lenders_done.set()
        if slot.result is None:  # the runtime itself was cancelled mid-command (`_guard_lent`)
            raise ShuttingDownError("the runtime is shutting down")
        return slot.result.unwrap()

    async def _guard_lent(self) -> None:
        """Keep the task nursery open while commands are lent (shutdown serves what queues behind them),
        and cancel them when the runtime itself is cancelled, as it would cancel spawned actors."""
        try:
            await self._lenders_done.wait()
        finally:
            for scope in self._lent:
                scope.cancel()
            with trio.CancelScope(shield=True):  # they may still hand a queued mailbox to a spawned actor
                await self._lenders_done.wait()

    def _hand_over(self, task_id: str, mailbox: Mailbox[_TaskMessage]) -> None:
        """After a lent command: a spawned actor serves what queued (or waits warm); else evict at once.

        No checkpoint separates the emptiness check from the eviction, so nothing can slip in between."""
        if mailbox.empty and not self.actor_idle_timeout:
            if self._mailboxes.get(task_id) is mailbox:
                del self._mailboxes[task_id]
            mailbox.close()
        else:
            self._nursery.start_soon(self._supervise_task, task_id, mailbox)

    async def _supervise_task(self, task_id: str, mailbox: Mailbox[_TaskMessage]) -> None:
        """Run the task's actor (spawned by `_hand_over`); restart it after a crash, on the same mailbox;
        evict it once idle.

        An actor whose mailbox stays empty for `actor_idle_timeout` seconds is evicted: its mailbox leaves the
        routing table and it exits, holding nothing (no command runs, so no operation lock is held); the next
        message for the task spawns a fresh one. Nothing the actor needs lives only in memory.
        Every transaction the actor requests runs under the task's lock on PostgreSQL (issue 15 item 2).
        """
        epochs.CURRENT_TASK.set(task_id)
        while True:
            locks = TaskLocks()  # owned by this incarnation of the actor
            try:
                while True:
                    envelope = await self._next_envelope(mailbox)
                    if envelope is not None:
                        # Each command pins the engine current at its start (a reconfiguration may follow).
                        await self._serve(TaskActor(task_id, self.engine, locks), envelope)
                    elif mailbox.empty and self._mailboxes.get(task_id) is mailbox:
                        del self._mailboxes[task_id]  # no checkpoint since the check: nothing can slip in
                        mailbox.close()
                        return
            except trio.EndOfChannel:
                return
            except _Restart as restart:
                log.error("task_actor_crashed", task_id=task_id, cause=restart.cause)

    async def _next_envelope(self, mailbox: Mailbox[_TaskMessage]) -> Envelope[_TaskMessage] | None:
        """The next queued envelope, or None after `actor_idle_timeout` seconds without one.

        A queued envelope is taken without waiting: a receive under an expired deadline would be cancelled
        even with one queued. With a timeout of 0 (the default) an empty mailbox returns None at once, with no
        cancel scope and no Cancelled raised and caught per message (issue 14: ~10 % of an entry's CPU).
        Raises trio.EndOfChannel once the mailbox is closed and drained.
        """
        try:
            return mailbox.receive_nowait()
        except trio.WouldBlock:
            if self.actor_idle_timeout == 0:
                return None
        with trio.move_on_after(self.actor_idle_timeout):  # only the wait, never a command
            return await mailbox.receive()
        return None

    async def _serve(self, actor: TaskActor, envelope: Envelope[_TaskMessage]) -> None:
        out = Outbox(self._hub)
        try:
            result = await actor.handle(envelope.message.command, out)
        except OnceflowError as exc:
            reply_to(envelope, outcome.Error(_Refused(exc, out)))
        except Exception as exc:
            info = ErrorInfo(code="internal", message=f"task actor failed: {exc!r}")
            reply_to(envelope, outcome.Error(_ActorFailure(info, out)))
            raise _Restart(repr(exc)) from exc
        else:
            reply_to(envelope, outcome.Value((result, out)))

    async def _handle_here(self, command: Any, out: Outbox) -> Any:
        store, now = self.services.store, self.services.now()
        match command:
            case c.RegisterWorkflow():
                return await self.register_workflow(
                    command.yaml, command.source, import_path=command.import_path
                )
            case c.AddParticipant():  # template-level (per-task ones are routed to the task)
                workflow = self.services.workflows.get(command.workflow_id or "")
                find_step(workflow, command.step_id)
                participant_id = await store.transact(
                    lambda conn: participants.add_participant(
                        conn,
                        workflow_id=workflow.id,
                        step_id=command.step_id,
                        task_id=None,
                        role=command.role,
                        agent_profile_id=command.agent_profile_id,
                        decision_required=command.decision_required,
                        position=command.position,
                    )
                )
                return {"participant_id": participant_id}
            case c.RemoveParticipant():
                removed = await store.transact(
                    lambda conn: participants.remove_participant(conn, command.participant_id)
                )
                if not removed:
                    raise NotFoundError(
                        f"participant {command.participant_id} does not exist", field="participant_id"
                    )
                return {"removed": True}
            case c.ClaimRun():
                run = await store.transact(lambda conn: runs.claim_run(conn, command.agent_profile_id, now))
                return None if run is None else runs.run_as_dict(run)
            case c.FinishRun():
                done = await store.transact(
                    lambda conn: runs.finish_run(conn, command.run_id, command.status, now)
                )
                if not done:
                    raise NotFoundError(f"no claimed run {command.run_id}", field="run_id")
                return {"run_id": command.run_id, "status": command.status}
            case c.ListRuns():
                rows = await store.transact(
                    lambda conn: runs.list_runs(
                        conn,
                        task_id=command.task_id,
                        agent_profile_id=command.agent_profile_id,
                        status=command.status,
                    )
                )
                return [runs.run_as_dict(row) for row in rows]
            case c.ListTasks():
                page, more = await store.transact(
                    lambda conn: tasks.list_tasks(
                        conn, after_task_id=command.after_task_id, limit=command.limit
                    )
                )
                return {
                    "tasks": [tasks.task_as_dict(task) for task in page],
                    "next_after_task_id": page[-1].id if more else None,
                }
            case c.ListReviewRuns():
                return await store.transact(
                    lambda conn: review_runs.list_review_runs(conn, task_id=command.task_id)
                )
            case c.OutcomeReady() | c.CoordinatorAck() | c.GetOutcome():
                return await self._outcomes.handle(command, out)
        raise TypeError(f"unroutable command {type(command).__name__}")

    async def register_workflow(self, text: str, source: str, *, import_path: bool = False) -> dict[str, Any]:
        """Validate, persist and register (or replace) a workflow template: a reconfiguration.

        Returns its id and step ids. Raises WorkflowInvalidError (`field` names the offending field).
        """
        stored = StoredWorkflow("", source, text, import_path)
        workflow = await trio.to_thread.run_sync(_parse, stored)  # never stall the other tasks
        now = self.services.now()
        stored = attrs.evolve(stored, workflow_id=workflow.id)
        await self.services.store.transact(
            lambda conn: workflows.save_workflow(
                conn, workflow_id=workflow.id, name=workflow.name, stored=stored, now=now
            )
        )
        registry = WorkflowRegistry(dict(self.services.workflows.workflows))
        registry.put(workflow)
        self.reconfigure(workflows=registry)
        return {"workflow_id": workflow.id, "steps": [step.id for step in workflow.ordered_steps]}

    def reconfigure(
        self,
        *,
        host: Host | None = None,
        executors: Mapping[str, Executor] | None = None,
        workflows: WorkflowRegistry | None = None,
    ) -> None:
        """Rebuild the engine and its facade with a new host, executors or workflows.

        Everything is rebuilt except the store and the ledger: the new `Services` receives this runtime's
        ledger as a required argument, so a dispatch still holding the old facade marks into the same ledger
        a later dispatch reads (operation-ledger-lifetime.md AC-L1, AC-R3, AC-B3).
        """
        old = self.services
        self.services = Services(
            store=old.store,
            ledger=old.ledger,
            host=host if host is not None else old.host,
            workflows=workflows if workflows is not None else WorkflowRegistry(dict(old.workflows.workflows)),
            promotions=old.promotions,
            executors=executors if executors is not None else old.executors,
            clock=old.clock,
            task_rows=old.task_rows,
        )
        self.engine = Engine(self.services)

    async def promote_all(self) -> int:
        """Start-up promotion: every step admits while it has room (E3). Steps without a WIP limit are
        included: a task queued at a step whose limit was since removed is admitted here.

        Only a step with a candidate (`wip.may_promote`, against one read of where tasks stand) costs a
        transaction: a 1,000-step template with few tasks restarts in one read, not 1,000 (issue 11).
        """
        occupied = await self.services.store.transact(store_wip.occupied_steps)
        promoted = 0
        for workflow in list(self.services.workflows.workflows.values()):
            for step in workflow.ordered_steps:
                if may_promote(workflow, step, occupied):
                    count = await self.engine.promote(workflow, step)
                    if count:  # a task admitted here may now be pulled by a step this one feeds
                        occupied.add((workflow.id, step.id, True))
                    promoted += count
        return promoted

    async def _forward_promotions(self, promotions: trio.MemoryReceiveChannel[Promotion]) -> None:
        """Route each committed promotion to its task's actor, which dispatches the entry's on_enter."""
        async for promotion in promotions:
            if not self._closing:  # after shutdown starts, the next start's recovery scan finishes it
                self._nursery.start_soon(self._deliver_promotion, promotion)

    async def _deliver_promotion(self, promotion: Promotion) -> None:
        """Dispatch a committed promotion's entry; a refusal (a storage fault now refuses instead of crashing
        the actor) is logged, and the entry stays open for the next start's recovery scan."""
        try:
            await self._ask(promotion.task_id, _TaskMessage(promotion))
        except _Refused as refused:
            log.warning(
                "promotion_dispatch_refused",
                task_id=promotion.task_id,
                step_id=promotion.step_id,
                code=refused.error.code,
                cause=refused.error.message,
            )
        except (OnceflowError, _ActorFailure, trio.ClosedResourceError):
            pass  # shutting down, or the crash was logged by the actor's supervision

    async def _load_workflows(self) -> None:
        for stored in await self.services.store.transact(workflows.all_workflows):
            try:
                self.services.workflows.put(await trio.to_thread.run_sync(_parse, stored))
            except WorkflowInvalidError as exc:
                log.error("stored_workflow_invalid", workflow_id=stored.workflow_id, cause=exc.message)

    def _close(self) -> None:
        self._closing = True
        for mailbox in self._mailboxes.values():
            mailbox.close()
        if not self._lent:
            self._lenders_done.set()


class _Refused(Exception):
    """A task actor refused a command (an OnceflowError) — carried with the events emitted before it."""

    def __init__(self, error: OnceflowError, out: Outbox) -> None:
        super().__init__(error.message)
        self.error, self.out = error, out


class _ActorFailure(Exception):
    def __init__(self, info: ErrorInfo, out: Outbox) -> None:
        super().__init__(info.message)
        self.info, self.out = info, out


class _Restart(Exception):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _parse(stored: StoredWorkflow) -> Workflow:
    allowed = IMPORT_ALLOWED_ACTIONS if stored.import_path else ALLOWED_ACTIONS
    try:
        return load_workflow_text(stored.definition, stored.source, allowed_actions=allowed)
    except WorkflowError as exc:
        raise WorkflowInvalidError(str(exc), field=exc.field or None) from None


def _error_info(exc: OnceflowError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, field=exc.field, retryable=exc.retryable)


@asynccontextmanager
async def open_runtime(
    db_path: str | os.PathLike[str],
    *,
    host: Host | None = None,
    durability: Durability = Durability.FULL,
    max_batch: int = 64,
    clock: Callable[[], float] = time.time,
    executors: Mapping[str, Executor] = DEFAULT_EXECUTORS,
    coordinator: Coordinator | None = None,
    redelivery_interval: float = 60.0,
    retry_policy: RetryPolicy | None = None,
    actor_idle_timeout: float = 0.0,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    epoch_sweep_interval: float = SWEEP_INTERVAL,
    task_row_cache: int = task_rows.DEFAULT_CAPACITY,
    switch_interval: float | None = None,
) -> AsyncIterator[Runtime]:
    """Open a runtime on a SQLite file, or a `postgresql://` URL, and serve until the context exits.

    `max_batch` bounds group commit: up to that many queued transactions share one COMMIT, each in its own
    savepoint, and none is answered before the COMMIT is durable. `clock` returns Unix seconds for persisted
    timestamps; `executors` maps engine-owned action types to their executors (an action type without one is
    reported, never silently skipped). The ledger is created here, before the runtime object, and lives
    exactly as long as the runtime. `coordinator` delivers outcomes (`outcome_ready`), redelivering every
    `redelivery_interval` seconds until acknowledged, each cycle's attempts following `retry_policy` (None:
    the spec's, `RetryPolicy()`; AC-CO-18); unfinished outcomes resume at once. Without one, outcomes are
    stored, pending. A task's actor is evicted after `actor_idle_timeout` seconds with an empty mailbox (0,
    the default: as soon as it is empty), so an idle task costs no actor memory (issue 7; bench/memory.py:
    ~0.6 KiB of peak RSS per idle task at 0); an idle task's next command runs on its sender's own Trio task,
    spawning nothing (issue 14). A positive timeout keeps chatty tasks' actors warm. `busy_timeout` is how
    many seconds a transaction waits for another connection's write lock; past it the command is answered
    `storage_busy` (retryable). Every storage fault (busy, full disk, I/O, read-only, corrupt) is answered as
    a typed `storage_<kind>` error, and the transaction that met it commits nothing (issue 11, items 2 and 4).
    Raises DatabaseOwnedError at once when another runtime owns the file; ValueError, before anything is
    opened, for a `redelivery_interval` that is not finite and positive or an `actor_idle_timeout` that is not
    finite and >= 0, or a `busy_timeout` that is not finite and > 0 (issue 11, section 5: a NaN interval
    redelivered in a hot loop); a `RetryPolicy` validates itself when built. Whatever ends the runtime (a
    failure to open, or the body's own exception) surfaces as itself, not wrapped in the runtime's nurseries'
    ExceptionGroups; only several causes at once stay a group (issue 11, section 5). On PostgreSQL (issue 15)
    several runtimes may serve one database: each command's transactions hold its task's lock, and every
    `epoch_sweep_interval` seconds the runtime finishes the open entries whose epoch is dead or that hold no
    live claim after `GRACE_INTERVALS` of them, and runs the start-up promotion
    (actors/runtime/epoch_sweep.py); no file lock is taken, so DatabaseOwnedError never applies.
    `task_row_cache` is how many task rows a move may start from without reading them
    (actors/kernel/task_rows.py: the admission's compare-and-set verifies the row, a mismatch falls back to a
    fresh read; issue 14); 0 turns it off, and it is always off on PostgreSQL, where other runtimes write rows
    too. A negative size is a ValueError before anything is opened. `switch_interval`, when given, is the
    interpreter's GIL switch interval in seconds (`sys.setswitchinterval`) while the runtime is open, the
    previous one restored on exit. It is process-wide, so the host decides: the store's writer thread releases
    the GIL while SQLite works, and with Python's default (0.005 s) the Trio thread keeps it that long before
    the writer may go on, so the two threads barely overlap. `onceflow serve` sets `SWITCH_INTERVAL`
    (bench/dispatch.py: ~1.35x entries per second at 64 tasks; issue 14). Not finite or <= 0 is a ValueError
    before anything is opened.
    """
    redelivery_interval = seconds("redelivery_interval", redelivery_interval)
    actor_idle_timeout = seconds("actor_idle_timeout", actor_idle_timeout, allow_zero=True)
    busy_timeout = seconds("busy_timeout", busy_timeout)
    epoch_sweep_interval = seconds("epoch_sweep_interval", epoch_sweep_interval)
    rows = task_rows.TaskRows(task_row_cache)
    previous_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(seconds("switch_interval", switch_interval))
    try:
        async with (
            open_store(
                db_path, durability=durability, max_batch=max_batch, busy_timeout=busy_timeout
            ) as store,
            trio.open_nursery() as nursery,
        ):
            ledger = LedgerActor()
            nursery.start_soon(ledger.run)
            promotions, promoted = trio.open_memory_channel[Promotion](math.inf)
            services = Services(
                store=store,
                ledger=ledger,
                host=host or BaseHost(),
                workflows=WorkflowRegistry(),
                promotions=promotions,
                executors=executors,
                clock=clock,
                task_rows=task_rows.TaskRows() if store.postgres else rows,
            )
            hub = EventHub()
            outcome_supervisor = OutcomeSupervisor(
                store,
                hub,
                coordinator,
                redelivery_interval=redelivery_interval,
                retry_policy=retry_policy or RetryPolicy(),
                clock=clock,
            )
            try:
                await nursery.start(outcome_supervisor.run)
                async with trio.open_nursery() as task_nursery:
                    sweep: trio.CancelScope | None = None
                    runtime = Runtime(services, task_nursery, hub, outcome_supervisor, actor_idle_timeout)
                    task_nursery.start_soon(runtime._forward_promotions, promoted)
                    try:
                        await runtime._load_workflows()
                        if store.postgres:  # other runtimes may serve these tasks meanwhile
                            await recover_at_start(runtime.services, hub)
                        else:
                            await recover_open_entries(runtime.services, hub)
                        await runtime.promote_all()
                        if store.postgres:  # others may die while we run: finish what their epochs left
                            sweep = await task_nursery.start(
                                sweep_forever,
                                runtime.services,
                                hub,
                                epoch_sweep_interval,
                                runtime.promote_all,
                            )
                        yield runtime
                    finally:
                        if sweep is not None:
                            sweep.cancel()
                        runtime._close()  # the task nursery then waits for every actor to drain its mailbox
                        promotions.close()
            finally:
                outcome_supervisor.close()
                ledger.close()
                hub.close()
    except BaseExceptionGroup as group:
        raise_single(group)  # a single cause surfaces as itself (issue 11, section 5)
    finally:
        if switch_interval is not None:
            sys.setswitchinterval(previous_interval)
