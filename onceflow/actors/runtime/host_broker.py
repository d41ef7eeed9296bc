"""The host role: a `Host` and an outcome `Coordinator` whose calls are answered by host connections
(`onceflow serve`'s `register_host`), never silently lost. Trio thread.

A connection registers capabilities (protocol/host_calls.py); the broker then routes each call needing one
of them to a live host holding it and waits for that host's `host_reply`, exactly where an in-process `Host`
method or `Coordinator` callable would be awaited, so the on-enter dispatch order (AC-A9, AC-A12), the
no-live-session rule (AC-A10) and the ownership partition (AC-B8: orchestrator-owned actions hold no marker
and are not resurrected after a crash) are those of an in-process host. The rules:

- Until some connection has registered a capability, calls needing it are answered as the default host
  answers them (`BaseHost`: session actions and code-review starts reported done, every transition
  accepted), so clients that never register see what they always saw. The runtime's own start (its
  recovery scan) precedes every registration. The coordinator capability, the first time it is registered,
  attaches the broker to the runtime's outcome supervisor (`OutcomeSupervisor.attach`).
- Once one has, a call is offered to one live host with the capability (the one holding the fewest calls)
  as a `HostCall` line whose deadline is `host_timeout` seconds away, and awaited.
- A host whose connection goes away before answering: the call is offered to the next host with the
  capability under the same call id, at most `MAX_OFFERS` times in all.
- No live host with the capability: the call waits up to `host_wait` seconds for one to register, then
  ends `host_unavailable` (the call reached no executor), raised as `HostUnavailableError` (retryable).
- A host that does not answer by the deadline: `host_timeout`, raised as `HostTimeoutError` (retryable);
  its late answer is refused. The dispatch goes on as after a raising host method: a session action or a
  code-review start is reported failed, a preflight refuses the move (retryable, nothing commits), a
  delivery attempt fails and follows the retry policy.
- An answer `ok: false` raises `HostRefusedError` naming the host and its reason.

Every call that reached a host connection's path ends as one record (store/outcomes/host_calls.py:
`list_host_calls`, a task's history), counted in the `onceflow.host_calls` metric; an unanswered one is also
the event
`host_call_unanswered` and a WARNING log. Records are written by one recorder task in batches, after the
call ended (a crash loses the records of calls that ended since the last batch; never a call's effect).
Elapsed time is Trio's monotonic clock; record times are the runtime's wall clock.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs
import trio

from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.protocol.coordinator import AcknowledgeRequest, Coordinator, DeliveryRequest
from onceflow.protocol.durations import seconds
from onceflow.protocol.errors import (
    ConflictError,
    HostRefusedError,
    HostTimeoutError,
    HostUnavailableError,
    NotFoundError,
    shown,
)
from onceflow.protocol.events import HostCallUnanswered
from onceflow.protocol.host import SessionActionRequest
from onceflow.protocol.host_calls import (
    CAPABILITY,
    CallKind,
    CallStatus,
    Capability,
    HostReply,
    code_review_call_id,
    coordinator_call_id,
    preflight_call_id,
    session_action_call_id,
)
from onceflow.protocol.outcome import OutcomeDelivery
from onceflow.protocol.results import HostCallError, HostCallInfo, HostReplyTaken
from onceflow.protocol.times import rfc3339
from onceflow.store.outcomes import host_calls
from onceflow.store.outcomes.host_calls import EndedCall
from onceflow.store.writer import StoreActor

log = get_logger("onceflow.hosts")

MAX_OFFERS = 5
"""How many times one call is offered, across hosts that went away before answering it."""
RECORD_QUEUE = 4096
"""Ended calls waiting for the recorder; past it an ended call is not recorded (logged, counted `dropped`)."""
RECORD_BATCH = 256
"""Ended calls written in one store request."""
REMEMBERED_ENDINGS = 4096
"""Ended call ids remembered, so a late answer is told how its call ended rather than `not_found`."""


class HostLink(Protocol):
    """What the broker needs of a host connection: `offer` queues one call line without waiting and says
    whether the connection took it (False: it is closing, or the line would overflow its bounds)."""

    def offer(self, frame: bytes) -> bool: ...


@attrs.define(eq=False)
class RegisteredHost:
    """A live host connection: its `host_id`, capabilities and the calls it holds (by id)."""

    host_id: str
    capabilities: frozenset[Capability]
    link: HostLink
    held: set[str] = attrs.field(factory=set)
    live: bool = True


@attrs.define(eq=False)
class _Call:
    call_id: str
    kind: CallKind
    task_id: str | None
    request: dict[str, Any]
    created_at: float  # wall clock, Unix seconds
    started: float  # trio.current_time()
    offers: int = 0
    host: RegisteredHost | None = None  # the host holding it now
    last_host: str | None = None
    deadline: float = 0.0  # trio time by which `host` must answer
    hostless_since: float | None = None
    reply: HostReply | None = None
    wake: trio.Event = attrs.field(factory=trio.Event)

    def notify(self) -> None:
        self.wake.set()


class HostBroker:
    """A `Host` and a `Coordinator` answered by registered host connections (the module docstring's
    rules). `host_timeout`: seconds a host has to answer one offer; `host_wait`: seconds a call waits for a
    host with its capability to be connected; `clock`: Unix seconds for records and deadlines (`clock`,
    settable: serve hands it the runtime's clock once the runtime is open, actors/kernel/clock.py).

    Raises ValueError (naming the setting) for a `host_timeout` or `host_wait` that is not finite and
    positive.
    """

    def __init__(
        self, *, host_timeout: float = 30.0, host_wait: float = 10.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.host_timeout = seconds("host_timeout", host_timeout)
        self.host_wait = seconds("host_wait", host_wait)
        self.clock = clock
        self._hosts: list[RegisteredHost] = []
        self._registered: set[Capability] = set()  # capabilities ever registered: no more default answers
        self._pending: dict[str, _Call] = {}
        self._ended: collections.OrderedDict[str, CallStatus] = collections.OrderedDict()
        self._numbered = 0
        self._stopping = False
        self._hub: EventHub | None = None
        self._records: trio.MemorySendChannel[EndedCall] | None = None
        self._queued = 0  # ended calls handed to the recorder
        self._written = 0  # of which written (or given up on)
        self._progress = trio.lowlevel.ParkingLot()
        self.on_coordinator: Callable[[Coordinator], None] | None = None
        """Called once, with the broker, when the coordinator capability is first registered."""

    # --- connections ------------------------------------------------------------------------------------

    def register(self, capabilities: Iterable[Capability], link: HostLink) -> RegisteredHost:
        """Make `link` a host with `capabilities`: calls waiting for one of them are offered to it at once."""
        self._numbered += 1
        host = RegisteredHost(f"host-{self._numbered}", frozenset(capabilities), link)
        self._hosts.append(host)
        first_coordinator = "coordinator" in host.capabilities and "coordinator" not in self._registered
        self._registered |= host.capabilities
        log.info("host_registered", host_id=host.host_id, capabilities=sorted(host.capabilities))
        for call in self._pending.values():
            if call.host is None and CAPABILITY[call.kind] in host.capabilities:
                call.notify()
        if first_coordinator and self.on_coordinator is not None:
            self.on_coordinator(self)
        return host

    def unregister(self, host: RegisteredHost) -> None:
        """`host`'s connection ended: each call it held is offered to the next host (or waits for one)."""
        if not host.live:
            return
        host.live = False
        self._hosts.remove(host)
        log.info("host_gone", host_id=host.host_id, calls_held=len(host.held))
        for call_id in host.held:
            call = self._pending.get(call_id)
            if call is not None and call.host is host:
                call.host = None
                call.notify()
        host.held.clear()

    def answer(self, host: RegisteredHost, reply: HostReply) -> HostReplyTaken:
        """Take `host`'s answer to one of the calls it holds; the call's dispatch goes on with it.

        Raises:
            NotFoundError: no call of that id waits for an answer (field call_id).
            ConflictError: the call already ended (timed out, answered) or is held by another host (field
                call_id); nothing changes.
        """
        call = self._pending.get(reply.call_id)
        if call is None:
            ended = self._ended.get(reply.call_id)
            if ended is not None:
                raise ConflictError(f"call {reply.call_id!r} already ended: {ended}", field="call_id")
            raise NotFoundError(f"no call {reply.call_id!r} waits for an answer", field="call_id")
        if call.reply is not None:
            raise ConflictError(f"call {reply.call_id!r} is already answered", field="call_id")
        if call.host is not host:
            holder = "no host" if call.host is None else call.host.host_id
            raise ConflictError(
                f"call {reply.call_id!r} is held by {holder}, not {host.host_id}", field="call_id"
            )
        call.reply = reply
        call.notify()
        return {"call_id": reply.call_id, "status": "answered" if reply.ok else "refused"}

    def stop(self) -> None:
        """The server is stopping: a call with no host ends `host_unavailable` at once instead of waiting
        `host_wait` seconds for one (calls a live host holds still wait for its answer)."""
        self._stopping = True
        for call in self._pending.values():
            if call.host is None:
                call.notify()

    def pending(self, *, task_id: str | None = None, kind: CallKind | None = None) -> list[HostCallInfo]:
        """The calls waiting for a host or its answer, oldest first (they are recorded when they end)."""
        return [
            {
                "id": None,
                "call_id": call.call_id,
                "kind": call.kind,
                "task_id": call.task_id,
                "status": "pending",
                "attempts": call.offers,
                "host_id": call.host.host_id if call.host is not None else call.last_host,
                "created_at": rfc3339(call.created_at),
                "answered_at": None,
                "latency_seconds": None,
                "error": None,
            }
            for call in self._pending.values()
            if (task_id is None or call.task_id == task_id) and (kind is None or call.kind == kind)
        ]

    # --- recording ---------------------------------------------------------------------------------------

    async def record_forever(
        self,
        store: StoreActor,
        hub: EventHub,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Write ended calls to the store in batches, and publish unanswered ones on `hub`, until `close`;
        then write what is left and return. A batch the store refuses is logged and dropped (the calls'
        effects stand; only their records are lost)."""
        send, receive = trio.open_memory_channel[EndedCall](RECORD_QUEUE)
        self._records, self._hub = send, hub
        task_status.started()
        async with receive:
            async for first in receive:
                batch = [first]
                while len(batch) < RECORD_BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    await store.transact(host_calls.record, batch)
                except Exception as exc:
                    log.warning("host_calls_not_recorded", calls=len(batch), cause=shown(exc))
                self._written += len(batch)
                self._progress.unpark_all()
        self._records = None
        self._progress.unpark_all()

    async def flushed(self) -> None:
        """Return once every call that ended before now is written (or given up on): a read of the records
        (`list_host_calls`, `task_history`) then shows it. At once when nothing is being recorded."""
        target = self._queued
        while self._written < target and self._records is not None:
            await self._progress.park()

    def close(self) -> None:
        """Stop recording once what has ended is written (`record_forever` returns)."""
        if self._records is not None:
            self._records.close()

    # --- the Host contract -------------------------------------------------------------------------------

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        """Ask a `session_action` host to perform the action (`Host.perform_session_action`)."""
        if "session_action" not in self._registered:
            return  # the default host's answer (checked first: this is every entry's path)
        call_id = session_action_call_id(
            request.task_id, request.admission_seq, request.trigger, request.position
        )
        fields = attrs.asdict(request, recurse=False)  # its config is plain JSON already
        await self._call("session_action", call_id, request.task_id, fields)

    async def start_code_review(
        self, *, task_id: str, step_id: str, entry_seq: int, review_run_id: int, agent_profile_id: str | None
    ) -> None:
        """Ask a `code_review` host to start the pass (`Host.start_code_review`, at-least-once: AC-A8)."""
        if "code_review" not in self._registered:
            return
        request = {
            "task_id": task_id,
            "step_id": step_id,
            "entry_seq": entry_seq,
            "review_run_id": review_run_id,
            "agent_profile_id": agent_profile_id,
        }
        await self._call("code_review", code_review_call_id(task_id, review_run_id), task_id, request)

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        """Ask a `preflight` host whether the move may happen (`Host.preflight_transition`): an answer `ok:
        false` refuses it."""
        if "preflight" not in self._registered:
            return  # every transition accepted (checked first: this is every move's path)
        request = {"task_id": task_id, "from_step": from_step, "to_step": to_step}
        await self._call("preflight", preflight_call_id(task_id, from_step, to_step), task_id, request)

    # --- the Coordinator contract ------------------------------------------------------------------------

    async def deliver(self, request: DeliveryRequest) -> OutcomeDelivery | Mapping[str, Any]:
        """Hand the outcome to a `coordinator` host; its answer's `result` is the receipt (AC-CO-4, AC-CO-5:
        a missing or malformed one fails the cycle)."""
        payload = {
            "message": request.message.model_dump(mode="json"),
            "cycle_id": request.cycle_id,
            "attempt": request.attempt,
        }
        call_id = coordinator_call_id(request.cycle_id, request.attempt)
        result = await self._call("deliver", call_id, None, payload)
        return result or {}

    async def acknowledge(self, request: AcknowledgeRequest) -> None:
        """Have a `coordinator` host commit the acknowledgement in the canonical store (AC-CO-10)."""
        payload = {
            "acknowledgement": request.acknowledgement.model_dump(mode="json"),
            "cycle_id": request.cycle_id,
            "attempt": request.attempt,
        }
        await self._call("acknowledge", coordinator_call_id(request.cycle_id, request.attempt), None, payload)

    # --- one call ----------------------------------------------------------------------------------------

    async def _call(
        self, kind: CallKind, call_id: str, task_id: str | None, request: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Offer the call until a host answers it, or it ends unanswered; return the answer's `result`.

        Raises HostRefusedError, HostUnavailableError, HostTimeoutError (module docstring). Cancelled, the
        call ends `cancelled` (recorded) and a late answer is refused."""
        if CAPABILITY[kind] not in self._registered:
            return None  # no host ever took this capability: the default host's answer
        if call_id in self._pending:  # one task's calls never overlap; keep ids unique all the same
            call_id = f"{call_id}#{self._numbered}-{len(self._pending)}"
        call = _Call(call_id, kind, task_id, request, self.clock(), trio.current_time())
        self._pending[call_id] = call
        try:
            status, error = await self._until_ended(call)
        except BaseException:
            self._end(call, "cancelled", _error("cancelled", "the runtime stopped before an answer", True))
            raise
        finally:
            del self._pending[call_id]
            if call.host is not None:
                call.host.held.discard(call_id)
        self._end(call, status, error)
        if call.reply is not None:
            if call.reply.ok:
                return call.reply.result
            assert call.reply.error is not None and call.last_host is not None
            host_error = call.reply.error
            raise HostRefusedError(
                call.last_host, host_error.code, host_error.message, retryable=host_error.retryable
            )
        assert error is not None
        failure = HostTimeoutError if status == "host_timeout" else HostUnavailableError
        raise failure(f"{kind} call {call_id}: {error['message']}")

    async def _until_ended(self, call: _Call) -> tuple[CallStatus, HostCallError | None]:
        capability = CAPABILITY[call.kind]
        while True:
            if call.reply is not None:
                return ("answered" if call.reply.ok else "refused"), _refusal(call.reply)
            now = trio.current_time()
            if call.host is None:
                if call.offers >= MAX_OFFERS:
                    message = f"offered {call.offers} times; each host went away before answering"
                    return "host_unavailable", _error("host_unavailable", message, True)
                host = self._pick(capability)
                if host is None:
                    call.hostless_since = call.hostless_since if call.hostless_since is not None else now
                    waited = now - call.hostless_since
                    if self._stopping or waited >= self.host_wait:
                        message = (
                            "the server is stopping and no host holds it"
                            if self._stopping
                            else f"no host with capability {capability!r} for {self.host_wait:g} seconds"
                        )
                        return "host_unavailable", _error("host_unavailable", message, True)
                    await self._sleep(call, self.host_wait - waited)
                    continue
                self._offer(call, host)
                continue
            if now >= call.deadline:
                message = f"{call.host.host_id} did not answer within {self.host_timeout:g} seconds"
                return "host_timeout", _error("host_timeout", message, True)
            await self._sleep(call, call.deadline - now)

    @staticmethod
    async def _sleep(call: _Call, timeout: float) -> None:
        """Wait until the call changes (answered, its host gone, a host registered) or `timeout` seconds."""
        with trio.move_on_after(timeout):
            await call.wake.wait()
        call.wake = trio.Event()  # no checkpoint before the caller looks at the call again

    def _pick(self, capability: Capability) -> RegisteredHost | None:
        """The live host with `capability` holding the fewest calls (the earliest registered of those)."""
        able = [host for host in self._hosts if capability in host.capabilities]
        return min(able, key=lambda host: len(host.held), default=None)

    def _offer(self, call: _Call, host: RegisteredHost) -> None:
        call.offers += 1
        call.hostless_since = None
        call.deadline = trio.current_time() + self.host_timeout
        frame = {
            "call_id": call.call_id,
            "kind": call.kind,
            "request": call.request,
            "deadline": rfc3339(self.clock() + self.host_timeout),
        }
        line = (json.dumps({"call": frame}, separators=(",", ":")) + "\n").encode()
        call.host, call.last_host = host, host.host_id
        host.held.add(call.call_id)
        if not host.link.offer(line):  # its connection is closing or overflowing: as if it went away
            self.unregister(host)

    def _end(self, call: _Call, status: CallStatus, error: HostCallError | None) -> None:
        latency = trio.current_time() - call.started
        attributes = {"kind": call.kind, "status": status}
        metrics.HOST_CALLS.add(1, attributes)
        metrics.HOST_CALL_DURATION.record(latency, attributes)
        self._ended[call.call_id] = status
        while len(self._ended) > REMEMBERED_ENDINGS:
            self._ended.popitem(last=False)
        if status in ("host_unavailable", "host_timeout", "cancelled"):
            assert error is not None
            event = HostCallUnanswered(
                call_id=call.call_id,
                kind=call.kind,
                task_id=call.task_id,
                status=status,
                attempts=call.offers,
                host_id=call.last_host,
                message=error["message"],
            )
            log.warning("host_call_unanswered", **event.model_dump(exclude={"type"}))
            if self._hub is not None:
                Outbox(self._hub, reply=False).emit(event)
        ended = EndedCall(
            call_id=call.call_id,
            kind=call.kind,
            task_id=call.task_id,
            status=status,
            attempts=call.offers,
            host_id=call.last_host,
            created_at=call.created_at,
            answered_at=self.clock(),
            latency=latency,
            error=error,
        )
        try:
            if self._records is None:
                raise trio.ClosedResourceError
            self._records.send_nowait(ended)
            self._queued += 1
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            metrics.HOST_CALLS.add(1, {"kind": call.kind, "status": "dropped"})
            log.warning("host_call_not_recorded", call_id=call.call_id, kind=call.kind, status=status)


def _error(code: str, message: str, retryable: bool) -> HostCallError:
    return {"code": code, "message": message, "retryable": retryable}


def _refusal(reply: HostReply) -> HostCallError | None:
    if reply.error is None:
        return None
    return _error(reply.error.code, reply.error.message, reply.error.retryable)
