"""The runtime's supervisor: routing commands to task actors, restarting crashed actors, evicting idle
ones, and shutting down. Trio thread.

Commands naming a task go to that task's actor: an idle task's command runs on its asker's own Trio task,
and an actor task is spawned only for the commands queued behind a busy one (or to keep it warm); the rest
go to the runtime-level handlers (actors/runtime/handlers.py). A task actor that raises is logged at ERROR
with its task id and restarted on the same mailbox; the others keep running. Closing closes every mailbox
and lets the actors (and commands still running on their askers' tasks) drain what is queued.
`open_runtime` (actors/runtime/startup.py) builds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import outcome
import trio
from opentelemetry.context import Context
from pydantic import BaseModel, ValidationError
from trio.lowlevel import enable_ki_protection

from onceflow.actors.engine.engine import Engine
from onceflow.actors.engine.promotion import promote_all
from onceflow.actors.kernel.event_window import EventStream
from onceflow.actors.kernel.mailbox import Envelope, Mailbox, reply_to
from onceflow.actors.kernel.operation_locks import TaskLocks
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import Announced, Services, WorkflowRegistry
from onceflow.actors.runtime import handlers
from onceflow.actors.runtime.handlers import RuntimeResult
from onceflow.actors.runtime.outcome import OutcomeSupervisor
from onceflow.actors.runtime.worker import RunWorker
from onceflow.actors.task.actor import TaskActor, TaskMessage, TaskResult
from onceflow.observability import tracing
from onceflow.observability.logs import get_logger
from onceflow.protocol import commands as c
from onceflow.protocol.codec import command_type, decode_command, parse_json, validation_error
from onceflow.protocol.coordinator import Coordinator
from onceflow.protocol.durations import seconds
from onceflow.protocol.errors import OnceflowError, ShuttingDownError, shown
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.protocol.host import Host
from onceflow.protocol.results import WorkflowRegistered
from onceflow.store.backends import epochs
from onceflow.store.entries.executors import Executor
from onceflow.store.entries.wip import Promotion

log = get_logger("onceflow.supervisor")


class Runtime:
    """The embedding API: `await rt.send(command)` returns a `Reply`; `rt.events()` (with seqs, resumable)
    and `rt.subscribe()` stream events."""

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
        self._mailboxes: dict[str, Mailbox[TaskMessage]] = {}  # the live actors (busy, or warm)
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

    @property
    def hub(self) -> EventHub:
        """Where this runtime's events are published (its subscribers' streams)."""
        return self._hub

    @enable_ki_protection
    def attach_coordinator(self, coordinator: Coordinator) -> None:
        """Start delivering outcomes through `coordinator`, for a runtime opened without one (`onceflow
        serve`'s host role: a connection registered the coordinator capability): the unfinished outcomes
        are resumed as at a start (`OutcomeSupervisor.attach`). Raises RuntimeError if it has one."""
        self._outcomes.attach(coordinator)

    @enable_ki_protection
    def subscribe(self) -> trio.MemoryReceiveChannel[Event]:
        """A stream of every event emitted from now on, without seqs (unbounded: a reader that stops
        reading holds every later event); it ends when the runtime closes. `events` resumes instead."""
        return self._hub.subscribe()

    @enable_ki_protection
    def events(self, after: int | None = None) -> EventStream:
        """The events with their `event_seq`s, for `async for item in rt.events(after=seq)`: a
        `SequencedEvent` per event, in seq order, each once, from just after `after` (the last seq the
        reader processed; None: from now on). The runtime replays those it still holds (its last
        `event_window` events) and goes on live; an `EventGap(after, next)` comes first when some after
        `after` are gone (older than the window, from before a restart) and wherever the reader later
        falls more than the window behind: read the durable state (`get_task`, `task_history`,
        `list_runs`) and carry on. `stream.next_seq` is where it starts. Never holds the runtime back,
        holds nothing to close; it ends when the runtime closes, after the events published before.

        Raises:
            ProtocolError: `after` is not an integer in 0..2**63-1 (field `after`).
        """
        return EventStream(self._hub, after)

    def runs(
        self,
        agent_profile_id: str | Sequence[str] | None,
        *,
        lease_seconds: float | None = None,
        wait_seconds: float = 60.0,
        until_idle: bool = False,
        cancel_superseded: bool = True,
    ) -> RunWorker:
        """A worker over the runs queue for one agent profile, several (claimed fairly) or any (None)
        (actors/runtime/worker.py `RunWorker`):

            async with rt.runs("reviewer") as runs:
                async for run in runs:
                    async with run:  # renews the lease meanwhile; finishes (or fails) the run on leaving
                        ...

        Raises:
            ProtocolError: a bad `agent_profile_id`, `lease_seconds` or `wait_seconds` (0 only with
                `until_idle`), naming the field.
        """
        return RunWorker(
            self,
            self._hub,
            agent_profile_id,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
            until_idle=until_idle,
            cancel_superseded=cancel_superseded,
        )

    @enable_ki_protection
    async def send(self, command: c.Command | BaseModel | dict[str, Any] | str | bytes) -> Reply:
        """Apply one command and return its reply. Never raises (but for cancellation): the reply says what
        failed.

        A malformed, oversized or unknown message — any bytes at all — gets `ok: false` with
        `error.code == "invalid_message"` and `error.field` naming the field when one is to blame, and its
        `command` is the `type` it read whenever it read one (`protocol.codec.command_type`); the runtime
        keeps serving and nothing is applied. Anything unexpected is logged at ERROR with its
        traceback and answered `internal`. A storage fault (the database busy past the busy timeout, a full
        disk, an I/O error, a read-only or corrupt file) gets `storage_<kind>` with `error.retryable` saying
        whether sending the same command again later can help; the transaction that met it committed
        nothing.

        A cancelled `send` does not cancel its command: a task's command runs to completion shielded, its
        commits stand, and the cancellation is delivered when it is done (`trio.Cancelled` is raised instead
        of the reply). A `send` made in an already-cancelled scope raises `trio.Cancelled` before anything
        runs: every `send` is a cancel point, so a caller looping on it stops. A caller that gave up does
        not know the outcome; every command is safe to send again (operation ids, idempotency keys,
        decision receipts and compare-and-set moves make a repeat a no-op or an idempotent replay), and
        `get_task` tells where the task stands. A KeyboardInterrupt never lands inside `send` (nor anywhere in
        the runtime, whose Trio-side code is KI-protected): Trio raises it in the host's main task at a
        checkpoint (docs/embedding.md, "Stopping: cancellation and Ctrl-C").

        Traced (a recording tracer, onceflow/observability/tracing.py), a command that parsed is the span
        `onceflow.command <type>`, child of the command's `traceparent` when it carries one, else of the
        span current where `send` was called; a refusal sets its status ERROR, a cancellation ends it too.
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller starts nothing
        name = "unknown"
        out: Outbox | None = None  # the command's events, once it has run (none for a refusal before)
        span: tracing.CommandSpan | None = None  # with a recording tracer: the command's span (current)
        try:
            if c.is_command(command):
                parsed = command
            else:
                data = parse_json(command) if isinstance(command, (str, bytes)) else command
                name = command_type(data)  # a refusal names the type it read, even an unknown one
                parsed = decode_command(data)
            name = getattr(parsed, "type", type(parsed).__name__)
            tracer = self.services.tracing.tracer()
            if tracer is not None:
                span = tracing.CommandSpan(tracer, parsed, name)
            if self._closing:
                raise ShuttingDownError("the runtime is shutting down")
            routed = c.route(parsed)
            result: TaskResult | RuntimeResult
            if isinstance(routed, tuple):
                result, out = await self._ask(*routed)
            else:
                out = Outbox(self._hub)
                result = await handlers.handle(self, self._outcomes, routed, out)
            reply = out.reply(name, result=result)
        except OnceflowError as exc:
            reply = self._events(out).reply(name, error=_error_info(exc))
        except ValidationError as exc:
            reply = self._events(out).reply(name, error=_error_info(validation_error(exc)))
        except _Refused as refused:
            reply = refused.out.reply(name, error=_error_info(refused.error))
        except _ActorFailure as failure:
            reply = failure.out.reply(name, error=failure.info)
        except Exception as exc:
            log.error("command_failed", command=name, cause=shown(exc), exc_info=True)
            info = ErrorInfo(code="internal", message=f"{name} failed: {shown(exc)}")
            reply = self._events(out).reply(name, error=info)
        except BaseException as exc:  # a cancellation: the span ends saying so, the context is restored
            if span is not None:
                span.finish(None, exc)
            raise
        if span is not None:
            span.finish(reply)
        # A cancellation that arrived while the command ran shielded (a lent command, `_ask`) is delivered
        # here: without a checkpoint a caller looping on `send` in a cancelled scope would never stop.
        await trio.lowlevel.checkpoint_if_cancelled()
        return reply

    def _events(self, out: Outbox | None) -> Outbox:
        """`out`, or an empty outbox for a command refused before it ran."""
        return out if out is not None else Outbox(self._hub)

    async def _ask(self, task_id: str, message: TaskMessage) -> tuple[TaskResult, Outbox]:
        """Have the task's actor handle `message`: queued behind the actor's current command when it is
        busy (or warm, under a positive `actor_idle_timeout`), else run at once on the asker's own task.

        The second case spawns nothing: the asker lends its task to the actor. The routing-table entry is
        the actor's busy flag (later messages queue in its mailbox) and the command runs shielded, so a
        cancelled asker still completes it, as a spawned actor would (its cancellation is delivered once the
        command is done). Whatever queued meanwhile is handed to a spawned actor; an empty mailbox is evicted
        at once (timeout 0) or kept warm by a spawned actor: no actor task per message.

        Raises ShuttingDownError once shutdown has begun and the task has no actor; re-raises the command's
        failure as `_Refused` or `_ActorFailure`, as `Mailbox.ask` does.
        """
        mailbox = self._mailboxes.get(task_id)
        if mailbox is not None:  # the actor's task is another: the message carries the trace context
            context = tracing.current() if self.services.tracing.tracer() is not None else None
            return cast(tuple[TaskResult, Outbox], await mailbox.ask(message, context))
        if self._closing:  # a mailbox opened now would never be closed: shutdown would wait on it forever
            raise ShuttingDownError("the runtime is shutting down")
        mailbox = self._mailboxes[task_id] = Mailbox()
        answer: outcome.Outcome[tuple[TaskResult, Outbox]] | None = None
        token = epochs.CURRENT_TASK.set(task_id)  # on PostgreSQL its transactions hold the task's lock
        try:
            with trio.CancelScope(shield=True) as scope:  # cancelled by `_guard_lent` alone
                self._lent.add(scope)
                try:
                    answer, crash = await self._handled(TaskActor(task_id, self.engine, TaskLocks()), message)
                    if crash is not None:
                        log.error("task_actor_crashed", task_id=task_id, cause=crash)
                finally:
                    self._hand_over(task_id, mailbox)
        finally:
            epochs.CURRENT_TASK.reset(token)
            self._lent.discard(scope)
            if self._closing and not self._lent:
                self._lenders_done.set()
        if answer is None:  # the runtime itself was cancelled mid-command (`_guard_lent`)
            raise ShuttingDownError("the runtime is shutting down")
        return answer.unwrap()

    @enable_ki_protection
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

    def _hand_over(self, task_id: str, mailbox: Mailbox[TaskMessage]) -> None:
        """After a lent command: a spawned actor serves what queued (or waits warm); else evict at once.

        No checkpoint separates the emptiness check from the eviction, so nothing can slip in between."""
        if mailbox.empty and not self.actor_idle_timeout:
            if self._mailboxes.get(task_id) is mailbox:
                del self._mailboxes[task_id]
            mailbox.close()
        else:
            self._nursery.start_soon(self._supervise_task, task_id, mailbox)

    @enable_ki_protection
    async def _supervise_task(self, task_id: str, mailbox: Mailbox[TaskMessage]) -> None:
        """Run the task's actor (spawned by `_hand_over`); restart it after a crash, on the same mailbox;
        evict it once idle.

        An actor whose mailbox stays empty for `actor_idle_timeout` seconds is evicted: its mailbox leaves the
        routing table and it exits, holding nothing (no command runs, so no operation lock is held); the next
        message for the task spawns a fresh one. Nothing the actor needs lives only in memory.
        Every transaction the actor requests runs under the task's lock on PostgreSQL.
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

    async def _next_envelope(self, mailbox: Mailbox[TaskMessage]) -> Envelope[TaskMessage] | None:
        """The next queued envelope, or None after `actor_idle_timeout` seconds without one.

        A queued envelope is taken without waiting: a receive under an expired deadline would be cancelled
        even with one queued. With a timeout of 0 (the default) an empty mailbox returns None at once, with no
        cancel scope and no Cancelled raised and caught per message (~10 % of an entry's CPU).
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

    async def _serve(self, actor: TaskActor, envelope: Envelope[TaskMessage]) -> None:
        """Handle one envelope and answer it (`_handled`). Raises `_Restart` after an unexpected failure, for
        the supervisor to restart."""
        answer, crash = await self._handled(actor, envelope.message, envelope.context)
        reply_to(envelope, answer)
        if crash is not None:
            raise _Restart(crash)

    async def _handled(
        self, actor: TaskActor, message: TaskMessage, context: Context | None = None
    ) -> tuple[outcome.Outcome[tuple[TaskResult, Outbox]], str | None]:
        """Handle one message (under the asker's trace `context` when it was queued): its answer, (result,
        outbox) or the refusal or failure with the events emitted before it, and for an unexpected failure
        its cause (else None): the actor is then restarted."""
        out = Outbox(self._hub)
        try:
            if context is None:  # lent (the asker's own task), or not traced
                result = await actor.handle(message, out)
            else:
                with tracing.attached(context):  # the asker's: it was queued
                    result = await actor.handle(message, out)
        except OnceflowError as exc:
            return outcome.Error(_Refused(exc, out)), None
        except Exception as exc:
            info = ErrorInfo(code="internal", message=f"task actor failed: {exc!r}")
            return outcome.Error(_ActorFailure(info, out)), repr(exc)
        return outcome.Value((result, out)), None

    @enable_ki_protection
    async def register_workflow(
        self, text: str, source: str, *, import_path: bool = False
    ) -> WorkflowRegistered:
        """Validate, persist and register (or replace) a workflow template (`handlers.register_workflow`)."""
        return await handlers.register_workflow(self, text, source, import_path=import_path)

    @enable_ki_protection
    async def ask_task(self, task_id: str, message: TaskMessage) -> TaskResult:
        """Have the task's actor handle `message` (queued behind its current command) and return its result.
        Raises the command's OnceflowError, or ShuttingDownError once shutdown has begun."""
        try:
            result, _ = await self._ask(task_id, message)
        except _Refused as refused:
            raise refused.error from None
        except _ActorFailure as failure:
            raise RuntimeError(failure.info.message) from None
        return result

    @enable_ki_protection
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
            workflows=workflows if workflows is not None else old.workflows.copy(),
            promotions=old.promotions,
            executors=executors if executors is not None else old.executors,
            clock=old.clock,
            task_rows=old.task_rows,
            run_policy=old.run_policy,
            run_signals=old.run_signals,
            tracing=old.tracing,
        )
        self.engine = Engine(self.services)

    @enable_ki_protection
    async def promote_all(self) -> int:
        """Start-up promotion of every step (`promotion.promote_all`); how many tasks were promoted."""
        return await promote_all(self.services)

    @enable_ki_protection
    async def forward_promotions(self, promotions: trio.MemoryReceiveChannel[Announced]) -> None:
        """Route each committed promotion to its task's actor, which dispatches the entry's on_enter."""
        async for promotion, context in promotions:
            if not self._closing:  # after shutdown starts, the next start's recovery scan finishes it
                self._nursery.start_soon(self._deliver_promotion, promotion, context)

    @enable_ki_protection
    async def _deliver_promotion(self, promotion: Promotion, context: Context | None) -> None:
        """Dispatch a committed promotion's entry (traced under `context`, the promoting command's); a
        refusal (a storage fault now refuses instead of crashing the actor) is logged, and the entry stays
        open for the next start's recovery scan."""
        try:
            with tracing.attached(context):
                await self._ask(promotion.task_id, promotion)
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

    @enable_ki_protection
    def close(self) -> None:
        """Begin shutdown: refuse new commands, close every mailbox (its actor drains what is queued)."""
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


def _error_info(exc: OnceflowError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, field=exc.field, retryable=exc.retryable)
