"""Durable coordinator outcome delivery: one actor per outcome, and the supervisor that runs them. Trio
thread: every database effect is a store request (store/outcomes/outcomes.py,
store/outcomes/outcome_claims.py).

Gas City's `CoordinatorOutcomeWorkflow` (coordinator-outcome-delivery.md) without a Temporal server: the
state lives in one SQLite row per outcome (`onceflow.store.outcomes.outcomes`), the signals are the
`outcome_ready` and `coordinator_ack` commands, the query is `get_outcome`, the durable timer is a Trio timer,
and the two activities are the host's `Coordinator` callables. The spec has no acceptance-criterion ids; these
are the ids the code and tests use:

- AC-CO-1  an envelope is Gas City's `OutcomeReady` (gascity-wire-format.md), validated field by field with
           its rules (`occurred_at` RFC 3339 UTC, ...); every rejection names the field.
- AC-CO-2  the outcome id is derived from the envelope's content as Gas City derives it; a mismatching id is
           rejected.
- AC-CO-3  the state is queryable; phase pending -> needs-coordinator-ack -> acknowledged, and it stays in
           needs-coordinator-ack until the exact current delivery is acknowledged.
- AC-CO-4  delivery goes through the host's `deliver` with the wire request `{envelope, delivery_cycle}`,
           retried inside one cycle (by default 1 s, x2, cap 10 s, 5 attempts) under the stable id
           `deliver/<outcome_id>/cycle-NNNNNN`, N counting every cycle.
- AC-CO-5  the receipt is `{delivery_ref, coordinator_fence}` (delivery_ref any URI-like string <= 512
           bytes); one for another outcome or work id, or with a malformed fence or ref, fails the cycle.
- AC-CO-6  a successful delivery sets the phase to needs-coordinator-ack with that delivery's fence and
           ref (a new delivery may carry a new fence) and clears the last error; delivered_at is set once.
- AC-CO-7  a failed cycle records `local-delivery-failed`, waits one interval and redelivers, next cycle id.
- AC-CO-8  after a delivery the actor waits for an ack or the redelivery interval (default 60 s); when the
           timer fires it first drains acks that already arrived, and only then redelivers.
- AC-CO-9  an ack matches only if store ref, outcome id, work id and the current fence all match; any
           other ack is counted stale and never completes the outcome.
- AC-CO-10 a matching ack is committed through the host's `acknowledge` (same retry policy, id
           `ack/<outcome_id>/cycle-N`, N the delivery cycle); if that fails, `canonical-acknowledgement-
           failed` is recorded, the actor waits one interval and redelivers.
- AC-CO-11 a repeated identical outcome_ready counts a duplicate; a different envelope under the same id
           records `conflicting-outcome-ready-signal` and changes nothing else.
- AC-CO-12 (the spec's GetVersion patch) from behaviour version 1, while a redelivery is failing an ack for
           the last successful delivery still completes the outcome; version-0 records only sleep.
- AC-CO-13 the record is bounded: counters, never a row per attempt (the spec's Continue-As-New).
- AC-CO-14 a restart resumes every unfinished outcome from its stored state, draining the acks that
           arrived before it first, then redelivering at once.
- AC-CO-15 a committed acknowledgement sets phase acknowledged and acknowledged_at; the actor ends.
- AC-CO-16 an acknowledgement carries `acknowledged_by`, recorded when it completes the outcome and shown by
           get_outcome; afterwards the same `acknowledged_by` again is a no-op, a different one a conflict.
- AC-CO-17 a delivery cycle interrupted by a stop or crash (begun, no receipt or failure recorded) is
           retried at the next start under its own id, before any waiting ack is judged: an ack for the
           fence the retry obtains then completes the outcome and is not counted stale.
- AC-CO-18 the retry policy is a runtime setting (`open_runtime(retry_policy=...)`), validated finite and
           positive.

Without a `Coordinator` the runtime still accepts and stores outcomes (phase pending, a warning diagnostic)
as Temporal accepts a workflow no worker polls yet; the next runtime opened with a coordinator delivers them.

Several runtimes on one PostgreSQL database: an actor delivers only while its runtime holds the
outcome's claim (store/outcomes/outcome_claims.py), checked in each of its transactions, so one outcome is
never delivered or acknowledged by two runtimes at once; every SWEEP_INTERVAL seconds each runtime resumes the
unfinished outcomes nobody claims (their runtime died), from their stored state as at a start (AC-CO-14,
AC-CO-17). An ack sent to a runtime not delivering the outcome waits in the inbox for the one that is, which
drains it when woken or when its redelivery timer fires (AC-CO-8).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.epoch_sweep import SWEEP_INTERVAL
from onceflow.observability import metrics, tracing
from onceflow.observability.logs import get_logger
from onceflow.observability.tracing import Tracing
from onceflow.protocol.coordinator import (
    AcknowledgeRequest,
    Coordinator,
    DeliveryRequest,
    RetryPolicy,
    cycle_label,
)
from onceflow.protocol.durations import seconds
from onceflow.protocol.errors import ConflictError
from onceflow.protocol.outcome import (
    CoordinatorAck,
    GetOutcome,
    OutcomeDelivery,
    OutcomeDeliveryRequest,
    OutcomeEnvelope,
    OutcomeReady,
)
from onceflow.protocol.results import AckQueued, OutcomeInfo, OutcomeReceived
from onceflow.store.outcomes import outcome_claims, outcomes
from onceflow.store.outcomes.outcome_claims import ClaimLostError
from onceflow.store.outcomes.outcomes import OutcomeRecord, PendingAck
from onceflow.store.writer import StoreActor

log = get_logger("onceflow.outcome")

BEHAVIOR_VERSION = 1
"""Stored with every new outcome; a record keeps the rules of the version it was created under."""

ACK_DURING_FAILED_REDELIVERY = 1
"""The version from which an ack is awaited while a redelivery fails (AC-CO-12; 0 = spec DefaultVersion)."""

T = TypeVar("T")


class OutcomeActor:
    """Delivers one outcome until its current delivery is acknowledged (AC-CO-3 .. AC-CO-15).

    `interval` is the redelivery interval in seconds; `retry` the policy inside one cycle; `clock` returns
    Unix seconds for delivered_at and acknowledged_at. Timers are Trio timers, so `trio.testing.MockClock`
    drives them.
    """

    def __init__(
        self,
        outcome_id: str,
        *,
        store: StoreActor,
        coordinator: Coordinator,
        hub: EventHub,
        interval: float,
        retry: RetryPolicy,
        clock: Callable[[], float],
        tracing: Tracing | None = None,
    ) -> None:
        self.outcome_id = outcome_id
        self._tracing = tracing or Tracing()
        self._store = store
        self._coordinator = coordinator
        self._hub = hub
        self._interval = interval
        self._retry = retry
        self._clock = clock
        self._wake = trio.Event()

    def wake(self) -> None:
        """An acknowledgement was committed to the inbox: look at it now rather than at the timer."""
        self._wake.set()

    @enable_ki_protection
    async def run(self) -> None:
        """Deliver until acknowledged, resuming from the stored record; return once acknowledged (AC-CO-14).

        A cycle left in flight by a stop or crash is retried first, and the acks waiting from before are
        judged against the fence it obtains (AC-CO-17). Returns at once, delivering nothing, when another
        runtime holds the outcome's claim (PostgreSQL). Raises ClaimLostError when the claim is lost midway,
        else whatever the store or the clock raise (the supervisor restarts the actor); the host's callables
        never make it raise. A cancellation leaves what was committed: a cycle it interrupts stays in flight
        for the next start.
        """

        record = await self._store.transact(outcome_claims.start, self.outcome_id)
        if record is None or record.phase == outcomes.ACKNOWLEDGED:
            return
        self._record = record
        self._envelope = OutcomeEnvelope.model_validate(self._record.envelope)
        if not self._record.cycle_in_flight:
            ack = await self._take()  # acks that arrived before this start (AC-CO-14)
            if ack is not None and await self._complete(ack):
                return
        while True:
            if not await self._deliver() and not self._awaits_ack_while_redelivery_fails():
                await trio.sleep(self._interval)  # AC-CO-7
                continue
            ack = await self._await_ack()
            if ack is None:
                continue  # the timer fired: redeliver (AC-CO-8)
            if await self._complete(ack):
                return
            await trio.sleep(self._interval)  # AC-CO-10

    def _awaits_ack_while_redelivery_fails(self) -> bool:
        """AC-CO-12: after a successful delivery, a failing redelivery still waits for that delivery's ack."""
        return (
            self._record.behavior_version >= ACK_DURING_FAILED_REDELIVERY
            and self._record.phase == outcomes.NEEDS_ACK
        )

    async def _transact(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(conn, *args)` in a store transaction, provided this runtime still holds the outcome's claim.

        Raises:
            ClaimLostError: it does not (nothing of `fn` ran).
        """
        return await self._store.transact(outcome_claims.while_held, self.outcome_id, fn, *args)

    async def _update(self, fn: Callable[..., OutcomeRecord], *args: Any) -> None:
        before = self._record.phase
        self._record = await self._transact(fn, self.outcome_id, *args)
        if self._record.phase != before:
            metrics.OUTCOMES.add(1, {"phase": self._record.phase})

    async def _deliver(self) -> bool:
        """One delivery cycle (AC-CO-4 .. AC-CO-7); True if the coordinator returned a valid receipt.

        A new cycle, or the one still in flight from before a stop or crash, under its own id (AC-CO-17).
        """
        resumed = self._record.cycle_in_flight
        if not resumed:
            await self._update(outcomes.begin_cycle)
        cycle = cycle_label(self._record.delivery_attempts)
        cycle_id = f"deliver/{self.outcome_id}/{cycle}"
        if resumed:
            self._emit("info", "outcome_cycle_resumed", cycle_id=cycle_id)
        message = OutcomeDeliveryRequest(envelope=self._envelope, delivery_cycle=cycle)
        try:
            raw = await run_cycle(
                self._retry,
                lambda attempt: self._attempt(
                    "deliver",
                    cycle_id,
                    attempt,
                    self._coordinator.deliver(DeliveryRequest(message, cycle_id, attempt)),
                ),
                cycle_id=cycle_id,
            )
            receipt = OutcomeDelivery.model_validate(raw, context={"envelope": self._envelope})
        except Exception as exc:
            await self._update(outcomes.fail_cycle)
            self._emit(
                "warning",
                "outcome_delivery_failed",
                cycle_id=cycle_id,
                error=repr(exc),
                error_type=type(exc).__name__,
            )
            return False
        await self._update(
            outcomes.record_delivery, receipt.delivery_ref, receipt.coordinator_fence, self._clock()
        )
        self._emit(
            "info",
            "outcome_delivered",
            cycle_id=cycle_id,
            coordinator_fence=receipt.coordinator_fence,
            delivery_ref=receipt.delivery_ref,
        )
        return True

    async def _await_ack(self) -> PendingAck | None:
        """Wait up to one interval for the matching ack; None when the timer fired without one (AC-CO-8).

        No timer is pending while the inbox is read, so a store round trip never counts against it.
        """
        deadline = trio.current_time() + self._interval
        while trio.current_time() < deadline:
            self._wake = trio.Event()
            ack = await self._take()
            if ack is not None:
                return ack
            with trio.move_on_at(deadline):
                await self._wake.wait()
        return await self._take()  # acks that arrived just as the timer fired

    async def _take(self) -> PendingAck | None:
        return await self._transact(outcomes.take_matching_ack, self.outcome_id)

    async def _complete(self, ack: PendingAck) -> bool:
        """Commit a matching ack through the host (AC-CO-10); True once acknowledged (AC-CO-15)."""
        cycle_id = f"ack/{self.outcome_id}/{cycle_label(self._record.delivery_attempts)}"
        acknowledgement = ack.acknowledgement()
        try:
            await run_cycle(
                self._retry,
                lambda attempt: self._attempt(
                    "acknowledge",
                    cycle_id,
                    attempt,
                    self._coordinator.acknowledge(AcknowledgeRequest(acknowledgement, cycle_id, attempt)),
                ),
                cycle_id=cycle_id,
            )
        except Exception as exc:
            self._record = await self._transact(outcomes.consume_ack, ack)
            self._emit(
                "warning",
                "outcome_acknowledgement_failed",
                cycle_id=cycle_id,
                error=repr(exc),
                error_type=type(exc).__name__,
            )
            return False
        await self._update(outcome_claims.acknowledge_and_release, ack.acknowledged_by, self._clock())
        self._emit(
            "info",
            "outcome_acknowledged",
            cycle_id=cycle_id,
            coordinator_fence=ack.coordinator_fence,
            acknowledged_by=ack.acknowledged_by,
        )
        return True

    async def _attempt(self, method: str, cycle_id: str, attempt: int, call: Awaitable[T]) -> T:
        """One attempt of the coordinator's `method`: its span `onceflow.coordinator <method>` when traced
        (a raise or a timeout is recorded on it)."""
        tracer = self._tracing.tracer()
        if tracer is None:
            return await call
        attributes: tracing.Attributes = {
            tracing.OUTCOME_ID: self.outcome_id,
            tracing.CYCLE_ID: cycle_id,
            tracing.ATTEMPT: attempt,
        }
        with tracing.span(tracer, f"onceflow.coordinator {method}", attributes):
            return await call

    def _emit(self, level: str, code: str, **fields: Any) -> None:
        Outbox(self._hub).diagnostic(level, code, outcome_id=self.outcome_id, **fields)


async def run_cycle(policy: RetryPolicy, call: Callable[[int], Awaitable[T]], *, cycle_id: str) -> T:
    """Return `call(attempt)` for the first attempt of one cycle that does not raise, retrying as `policy`
    says (AC-CO-4, AC-CO-10, AC-CO-18). A cancellation stops the attempt under way; nothing is recorded
    here (the caller records the cycle).

    Raises:
        Exception: the last attempt's error when every attempt failed (trio.TooSlowError for a timeout).
        trio.TooSlowError: the cycle ran out of time.
    """
    attempt, wait = 1, policy.initial_interval
    with trio.fail_after(policy.cycle_timeout):
        while True:
            try:
                with trio.fail_after(policy.attempt_timeout):
                    return await call(attempt)
            except Exception as exc:
                log.warning("coordinator_attempt_failed", cycle_id=cycle_id, attempt=attempt, error=repr(exc))
                if attempt == policy.maximum_attempts:
                    raise
            await trio.sleep(wait)
            attempt, wait = attempt + 1, min(wait * policy.backoff_coefficient, policy.maximum_interval)


class OutcomeSupervisor:
    """Routes the outcome commands and runs one `OutcomeActor` per unfinished outcome.

    `coordinator` None stores outcomes without delivering them (see the module docstring).
    `redelivery_interval` is in seconds (ValueError unless finite and positive); `retry_policy` governs the
    attempts inside one cycle (AC-CO-18); `clock` returns Unix seconds; `tracing` is where each attempt's
    span goes (`onceflow.coordinator deliver|acknowledge`, under the span current when the outcome's actor
    was started: its `outcome_ready` command's, or none for one resumed at start-up).
    """

    def __init__(
        self,
        store: StoreActor,
        hub: EventHub,
        coordinator: Coordinator | None,
        *,
        redelivery_interval: float,
        retry_policy: RetryPolicy,
        clock: Callable[[], float],
        tracing: Tracing | None = None,
    ) -> None:
        self._store = store
        self._tracing = tracing or Tracing()
        self._hub = hub
        self._coordinator = coordinator
        self._interval = seconds("redelivery_interval", redelivery_interval)
        self._retry = retry_policy
        self._clock = clock
        self._actors: dict[str, OutcomeActor] = {}
        self._cancel = trio.CancelScope()
        self._nursery: trio.Nursery | None = None

    @enable_ki_protection
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Resume every unfinished outcome no other runtime claims (AC-CO-14), report started, and run actors
        until `close`; on PostgreSQL, resume the unclaimed ones again every SWEEP_INTERVAL seconds (their
        runtime died). Without a coordinator it only waits for one (`attach`)."""
        with self._cancel:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._coordinator is not None:
                    await self._resume_unclaimed()
                    nursery.start_soon(self._sweep_forever)
                task_status.started()
                await trio.sleep_forever()

    def attach(self, coordinator: Coordinator) -> None:
        """Start delivering through `coordinator` (a runtime opened without one, whose coordinator connected
        later: `onceflow serve`'s host role): every unfinished outcome no other runtime claims is resumed
        from its stored state, as at a start (AC-CO-14, AC-CO-17), then swept as `run` does. Call it from
        the Trio thread, after `run` started.

        Raises:
            RuntimeError: the supervisor already has a coordinator, or is not running.
        """
        if self._coordinator is not None or self._nursery is None:
            raise RuntimeError("attach: a coordinator is already attached, or the supervisor is not running")
        self._coordinator = coordinator

        @enable_ki_protection
        async def resume_then_sweep() -> None:
            try:
                await self._resume_unclaimed()
            except Exception as exc:  # a storage fault: the sweep (PostgreSQL) or the next start resumes them
                log.warning("outcome_resume_failed", cause=repr(exc))
            await self._sweep_forever()

        self._nursery.start_soon(resume_then_sweep)

    @enable_ki_protection
    async def _sweep_forever(self) -> None:
        if not self._store.postgres:  # one runtime owns a SQLite file: nothing is left unclaimed meanwhile
            return
        while True:
            await trio.sleep(SWEEP_INTERVAL)
            try:
                await self._resume_unclaimed()
            except Exception as exc:  # a storage fault: the next sweep tries again
                log.warning("outcome_sweep_failed", cause=repr(exc))

    async def _resume_unclaimed(self) -> None:
        for outcome_id in await self._store.transact(outcome_claims.unclaimed_unfinished):
            self._spawn(outcome_id)

    def close(self) -> None:
        """Stop every actor (what they committed stays; the next start resumes the rest)."""
        self._cancel.cancel()

    @enable_ki_protection
    async def handle(
        self, command: OutcomeReady | CoordinatorAck | GetOutcome, out: Outbox
    ) -> OutcomeReceived | AckQueued | OutcomeInfo:
        """Apply one outcome command and return its reply result.

        - outcome_ready -> `{outcome_id, received: started|duplicate, phase}` (AC-CO-11).
        - coordinator_ack -> `{outcome_id, queued, phase, acknowledged_by}`; queued False when already
          acknowledged by the same `acknowledged_by` (AC-CO-16).
        - get_outcome -> the outcome's state (`OutcomeRecord.info`, AC-CO-3).

        Raises:
            ConflictError: outcome_ready with a different envelope under a known id (field envelope); the
                conflict is recorded as the outcome's last error (AC-CO-11).
            ConflictError: coordinator_ack for an outcome someone else acknowledged (field acknowledged_by).
            NotFoundError: coordinator_ack or get_outcome for an unknown outcome (field outcome_id).
            BusyError: the outcome's acknowledgement inbox is full (field outcome_id).
        """
        store = self._store
        match command:
            case OutcomeReady(envelope=envelope):
                data = envelope.model_dump(mode="json")
                received, record = await store.transact(
                    outcomes.record_ready, envelope.outcome_id, data, BEHAVIOR_VERSION
                )
                if received == "started":
                    metrics.OUTCOMES.add(1, {"phase": record.phase})
                if received == "conflict":
                    raise ConflictError(
                        f"outcome {envelope.outcome_id} was received with a different envelope",
                        field="envelope",
                    )
                if received == "started" and self._coordinator is None:
                    out.diagnostic(
                        "warning", "outcome_waiting_for_coordinator", outcome_id=envelope.outcome_id
                    )
                elif received == "started":
                    self._spawn(envelope.outcome_id)
                return OutcomeReceived(outcome_id=envelope.outcome_id, received=received, phase=record.phase)
            case CoordinatorAck():
                queued, record = await store.transact(outcomes.enqueue_ack, command)
                actor = self._actors.get(command.outcome_id)
                if queued and actor is not None:
                    actor.wake()
                return AckQueued(
                    outcome_id=command.outcome_id,
                    queued=queued,
                    phase=record.phase,
                    acknowledged_by=record.acknowledged_by,
                )
            case GetOutcome():
                found = await store.transact(outcomes.get, command.outcome_id)
                return found.info()

    def _spawn(self, outcome_id: str) -> None:
        assert self._nursery is not None and self._coordinator is not None
        if outcome_id in self._actors:
            return
        actor = self._actors[outcome_id] = OutcomeActor(
            outcome_id,
            store=self._store,
            coordinator=self._coordinator,
            hub=self._hub,
            interval=self._interval,
            retry=self._retry,
            clock=self._clock,
            tracing=self._tracing,
        )
        self._nursery.start_soon(self._supervise, actor)

    @enable_ki_protection
    async def _supervise(self, actor: OutcomeActor) -> None:
        """Run the actor until acknowledged or claimed by another runtime; after a crash, log it and restart
        it one interval later. An actor whose claim was lost is dropped: the sweep resumes the outcome if
        nobody claims it."""
        while True:
            try:
                await actor.run()
            except ClaimLostError as exc:
                log.warning("outcome_claim_lost", outcome_id=actor.outcome_id, cause=repr(exc))
                del self._actors[actor.outcome_id]
                return
            except Exception as exc:
                log.error("outcome_actor_crashed", outcome_id=actor.outcome_id, cause=repr(exc))
                await trio.sleep(self._interval)
            else:
                del self._actors[actor.outcome_id]
                return
