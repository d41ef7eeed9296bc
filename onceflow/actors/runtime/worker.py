"""A worker over the runs queue: claim with a long poll, renew the lease while the body runs, finish the run
from the body's outcome. Trio thread (the asyncio face, onceflow/aio/worker.py, drives this same object
from an asyncio loop through the runtime's Trio thread).

    async with rt.runs("reviewer") as runs:        # a RunWorker: it owns the renewals' nursery
        async for run in runs:                      # claim_run, long-polling until a run comes
            async with run:                         # renews in the background; finishes on leaving
                await review(run.task_id, run.payload)

Leaving `async with run` resolves the run from how the block ended (`RunWorker._end`):

- the block completed: `finish_run` status finished, with `run.result` (set it in the block: JSON, at
  most 64 KiB) stored as the run's result;
- it raised `HandBack`: the run is returned to the queue (`requeue_run`, fenced by its claim token), in its
  place in line, its attempt counted, no retry spent;
- it raised `RunError`: finished failed with its message, `retryable` and `retry_at`;
- it raised any other `Exception`: failed, retryable, with the exception's type and message as the error
  (logged at WARNING `run_body_failed` with its traceback). The exception is *not* re-raised: the loop
  goes on with the next run;
- the claim was lost — `renew_run` answered a `conflict` (the lease ran out and the run was handed out
  again, or it was cancelled), a `run_cancelled` or `run_lease_expired` event of this runtime named the
  run, or (with `cancel_superseded`, the default) a renewal said the task left the step entry that queued
  it — the block is cancelled at its next checkpoint, a WARNING `run_lost` diagnostic (an event and a log
  record) says why, and the loop goes on. A superseded run is then finished failed (the runs queue cancels
  it `entry_left`); a lost claim has nothing left to finish;
- it was cancelled from outside (the consumer stops, the runtime shuts down) or raised a BaseException
  (KeyboardInterrupt): the claim is handed back — queued again at once, the attempt not counted, an INFO
  `run_released` diagnostic — and the cancellation propagates. Commands the block sent before stay
  committed (a cancelled `send` still runs its command to completion), so the next claim may repeat part of
  the work: key the agent's side effects on the run id.

Runs may be worked on concurrently (hand each to a task of your nursery, which enters it). A run handed
out by the iterator but never entered is handed back the same way when the worker is left. Leaving the
worker (or `stop()`) ends a waiting claim, which claims nothing.
What a cancellation leaves behind, then: no run claimed by this worker, every claim it made finished or
released; only a runtime that dies (no code runs) leaves a claim, which its lease ends. On PostgreSQL a
cancellation by another runtime is seen at the next renewal (no event reaches this one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, cast

import trio
from trio.lowlevel import enable_ki_protection

from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.runs import lease_for
from onceflow.observability.logs import get_logger
from onceflow.protocol import commands as c
from onceflow.protocol.codec import decode_command
from onceflow.protocol.errors import OnceflowError, ProtocolError, shown
from onceflow.protocol.events import ErrorInfo, Event, Reply
from onceflow.protocol.limits import MAX_TEXT_CHARS
from onceflow.protocol.results import ClaimedRun, FinishOutcome, RunRenewed
from onceflow.protocol.times import unix_seconds
from onceflow.store.runs import run_claims

if TYPE_CHECKING:
    from pydantic import BaseModel

    from onceflow.actors.kernel.services import Services


class Runtime(Protocol):
    """What a worker uses of the runtime (`Runtime`, actors/runtime/supervisor.py, which makes the workers):
    named here so that the two modules do not import each other."""

    services: Services

    def subscribe(self) -> trio.MemoryReceiveChannel[Event]: ...

    async def send(self, command: c.Command | BaseModel | dict[str, Any] | str | bytes) -> Reply: ...


log = get_logger("onceflow.worker")

RENEW_FRACTION = 1 / 3
"""A lease is renewed when this fraction of it has passed (a renewal that fails is tried again after a
third of that, so two failures in a row still leave a third of the lease)."""

CLAIM_BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds between claims that failed with a retryable error (a busy database): one after another."""

LOST_CLAIMS = frozenset({"claim_lost", "cancelled", "lease_expired"})
"""The `Run.lost` reasons after which the claim's token is stale: nothing to finish or hand back."""

FINISH_ATTEMPTS = 3
"""How many times a finish that failed with a retryable error is sent (it is an idempotent replay)."""


class RunError(Exception):
    """Raise it from a run's body to fail the run on your own terms: `message` becomes the run's
    `last_error` (cut to the protocol's 16,384-character text limit); `retryable=False` fails it for good
    at once (a failure retrying cannot cure); `retry_at` (RFC 3339 UTC text, or Unix seconds) retries it
    then instead of after the policy's backoff (a rate limit's reset). Any other exception fails the run
    retryable."""

    def __init__(self, message: str, *, retryable: bool = True, retry_at: float | str | None = None) -> None:
        """Raises ProtocolError (field retry_at) for a `retry_at` that is neither RFC 3339 UTC text
        (`2026-03-01T12:00:00Z`) nor a finite number of seconds >= 0."""
        if isinstance(retry_at, str):
            try:
                retry_at = unix_seconds(retry_at)
            except ValueError:
                raise ProtocolError(
                    f"retry_at must be RFC 3339 UTC or Unix seconds, got {shown(retry_at)}", field="retry_at"
                ) from None
        if retry_at is not None and (
            isinstance(retry_at, bool)
            or not isinstance(retry_at, int | float)
            or not 0 <= retry_at < math.inf
        ):
            raise ProtocolError(
                f"retry_at must be RFC 3339 UTC or Unix seconds, got {shown(retry_at)}", field="retry_at"
            )
        super().__init__(message)
        self.message = str(message)
        self.retryable = bool(retryable)
        self.retry_at = retry_at


class HandBack(Exception):
    """Raise it in a run's block to return the run to the queue (`requeue_run`) instead of finishing it:
    the work could not be done now (the host is stopping, the agent is busy), and did not fail."""


class Run:
    """One claimed run, as the worker hands it out: enter it (`async with run`) to work on it.

    `info` is the `claim_run` result (a `ClaimedRun`); the common fields are properties. While the block
    runs, `lease_expires_at` and `superseded` follow the renewals. Once the block is left, `outcome` is the
    `finish_run` result (None when nothing was finished), `lost` says why the claim was lost (None: it was
    not), and `released` is True when it was handed back. A run is entered once; entering it again raises
    RuntimeError.
    """

    def __init__(self, worker: RunWorker, info: ClaimedRun) -> None:
        self.info = info
        self.lease_expires_at: str | None = info["lease_expires_at"]  # RFC 3339 UTC
        self.superseded = info["superseded"]
        self.lost: str | None = None
        self.outcome: FinishOutcome | None = None
        self.released = False
        self.result: Any = None
        """What the block produced: stored with the run when it finishes (`finish_run`'s `result`)."""
        self._worker = worker
        self._entered = False
        self._ended = False
        self._scope: trio.CancelScope | None = None
        self._renewal: trio.CancelScope | None = None
        self._renewed = trio.Event()  # set once the renewal task has ended (nothing in flight)
        self._renewed.set()

    @property
    def id(self) -> int:
        """The run id."""
        return self.info["id"]

    @property
    def agent_profile_id(self) -> str:
        """The agent profile it is for."""
        return self.info["agent_profile_id"]

    @property
    def task_id(self) -> str | None:
        """The task it is for."""
        return self.info["task_id"]

    @property
    def step_id(self) -> str | None:
        """The step whose action queued it."""
        return self.info["step_id"]

    @property
    def reason(self) -> str:
        """Why it was queued (the action's reason)."""
        return self.info["reason"]

    @property
    def payload(self) -> dict[str, Any] | None:
        """The action's payload."""
        return self.info["payload"]

    @property
    def entry_seq(self) -> int | None:
        """The step entry that queued it (an on_enter run's): the review round a vote it casts is for
        (`record_decision`'s `entry_seq`)."""
        return self.info["entry_seq"]

    @property
    def attempt(self) -> int:
        """Which claim of the run this is (1 for the first)."""
        return self.info["attempt"]

    @property
    def claim_token(self) -> str:
        """The fencing token of this claim."""
        return self.info["claim_token"]

    def _cancel_body(self) -> None:
        """Stop the body (Trio: cancel its scope). The asyncio face overrides it."""
        if self._scope is not None:
            self._scope.cancel()

    @enable_ki_protection
    async def __aenter__(self) -> Run:
        self._enter()
        self._scope = trio.CancelScope()
        self._scope.__enter__()
        self._worker._begin(self)
        return self

    @enable_ki_protection
    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        assert self._scope is not None
        try:
            absorbed = self._scope.__exit__(exc_type, exc, tb)  # the body's cancellation by a lost claim
        except BaseException as remaining:  # the scope kept part of a group: it goes on as it is
            await self._worker._end(self, remaining)
            raise
        error = None if absorbed else exc
        await self._worker._end(self, error, cancelled=self._scope.cancelled_caught)
        return error is None or isinstance(error, Exception)

    def _enter(self) -> None:
        if self._entered:
            raise RuntimeError(f"run {self.id} was already entered: enter each run once")
        self._entered = True


class RunWorker:
    """`rt.runs(agent_profile_id)`: the runs of one agent profile (a sequence of them: claimed across them
    fairly; None: any agent's), claimed one at a time (module docstring).

    Use it as `async with` (it owns the nursery the lease renewals run in), then `async for run in
    worker`, then `async with run`. `lease_seconds` (None: the policy's lease) is the lease of every claim and
    renewal, renewed every third of it; `wait_seconds` (≤ 60) the long poll of each `claim_run` (the
    iterator sends the next one at once, so it waits for a run as long as it takes); `until_idle` True ends
    the iteration instead when a claim found no run (after its wait: with `wait_seconds=0`, as soon as none
    is eligible); `cancel_superseded` False lets a body whose task left its step entry run on
    (`run.superseded` says so). Leaving it, however (an error, a cancellation), hands back every run it
    handed out and did not end, and cancels a body still running in another task: it leaves no claim.

    Raises (at construction):
        ProtocolError: a bad `agent_profile_id`, `lease_seconds` (above the policy's `max_lease` too) or
            `wait_seconds` (0 only with `until_idle`), naming the field.
    """

    def __init__(
        self,
        runtime: Runtime,
        hub: EventHub,
        agent_profile_id: str | Sequence[str] | None,
        *,
        lease_seconds: float | None = None,
        wait_seconds: float = 60.0,
        until_idle: bool = False,
        cancel_superseded: bool = True,
    ) -> None:
        if wait_seconds == 0 and not until_idle:
            raise ProtocolError(
                "wait_seconds must be positive (a worker never busy-polls)", field="wait_seconds"
            )
        agents = (
            {"agent_profile_id": agent_profile_id}
            if isinstance(agent_profile_id, str)
            else {}
            if agent_profile_id is None
            else {"agent_profile_ids": list(agent_profile_id)}
        )
        claim = decode_command(
            {"type": "claim_run", **agents, "lease_seconds": lease_seconds, "wait_seconds": wait_seconds}
        )
        assert isinstance(claim, c.ClaimRun)
        self.agent_profile_id = (
            agent_profile_id if isinstance(agent_profile_id, str) else ",".join(agent_profile_id or ["*"])
        )
        """The agent profile claimed for (several: joined by commas; any: `*`), as logs name it."""
        self.lease = lease_for(runtime.services, lease_seconds)
        """The lease of every claim and renewal, in seconds."""
        self._claim = claim
        self._runtime = runtime
        self._hub = hub
        self._cancel_superseded = cancel_superseded
        self._until_idle = until_idle
        self._active: dict[str, Run] = {}  # by claim token: entered, not yet ended
        self._unentered: dict[str, Run] = {}  # by claim token: handed out, not yet entered
        self._nursery_manager: Any = None
        self._nursery: trio.Nursery | None = None
        self._stopping = False
        self._left = False
        self._claiming: trio.CancelScope | None = None

    # the worker's life -------------------------------------------------------------------------

    @enable_ki_protection
    async def __aenter__(self) -> RunWorker:
        if self._nursery_manager is not None:
            raise RuntimeError("a RunWorker is entered once")
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        await self._nursery.start(self._watch)
        return self

    @enable_ki_protection
    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        """Release what was handed out and not ended, stop the renewals and the watch, and let the block's
        exception (if any) propagate as it is."""
        self.stop()
        self._left = True
        for run in list(self._active.values()):  # bodies in other tasks (or on the asyncio loop)
            self._lose(run, "worker_closed")
        for run in [*self._active.values(), *self._unentered.values()]:
            await self._end(run, HANDED_BACK)
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        await self._nursery_manager.__aexit__(None, None, None)
        return False

    @enable_ki_protection
    def stop(self) -> None:
        """Claim no more: a waiting claim ends (claiming nothing) and the iteration stops; a run being
        worked on is not disturbed."""
        self._stopping = True
        if self._claiming is not None:
            self._claiming.cancel()

    # claiming ---------------------------------------------------------------------------------

    def __aiter__(self) -> RunWorker:
        return self

    @enable_ki_protection
    async def __anext__(self) -> Run:
        run = await self._next(lambda info: Run(self, info))
        if run is None:
            raise StopAsyncIteration
        return run

    async def _next(self, make: Callable[[ClaimedRun], Run]) -> Run | None:
        """Claim the next run (`_claim_next`) and hand it out as `make(info)`; None once stopped or left.

        Raises:
            RuntimeError: the worker was never entered (`async with rt.runs(...)`).
        """
        if self._nursery is None:
            raise RuntimeError("iterate a RunWorker inside `async with rt.runs(...) as runs`")
        if self._left:
            return None
        info = await self._claim_next()
        if info is None:
            return None
        run = self._unentered[info["claim_token"]] = make(
            info
        )  # no checkpoint since the claim: nothing strands it
        return run

    async def _claim_next(self) -> ClaimedRun | None:
        """Send `claim_run` until a run comes (None once stopped or the runtime is shutting down). A retryable
        refusal is logged at WARNING `run_claim_failed` and tried again after `CLAIM_BACKOFF`. A
        cancellation claims nothing (the runtime hands back a claim it interrupts).

        Raises:
            OnceflowError: a refusal that retrying cannot cure, with the reply's code, message and field.
        """
        failures = 0
        while not self._stopping:
            with trio.CancelScope() as self._claiming:
                if self._stopping:  # stop() between the loop's test and here
                    self._claiming.cancel()
                reply = await self._runtime.send(self._claim)
                if reply.ok:
                    if reply.result is not None:
                        return cast(ClaimedRun, reply.result)
                    if self._until_idle:
                        return None
                    failures = 0
                    continue
                assert reply.error is not None
                if reply.error.code == "shutting_down":
                    return None
                if not reply.error.retryable:
                    raise _refusal(reply.error)
                delay = CLAIM_BACKOFF[min(failures, len(CLAIM_BACKOFF) - 1)]
                failures += 1
                log.warning(
                    "run_claim_failed",
                    agent_profile_id=self.agent_profile_id,
                    code=reply.error.code,
                    cause=reply.error.message,
                    retry_in=delay,
                )
                await trio.sleep(delay)
        return None

    # working on one run -----------------------------------------------------------------------

    def _begin(self, run: Run) -> None:
        """The body of `run` starts: renew its lease in the background until `_end`."""
        self._unentered.pop(run.claim_token, None)
        if run._ended:  # released meanwhile (the worker closed before the asyncio body began)
            run._cancel_body()
            return
        self._active[run.claim_token] = run
        assert self._nursery is not None
        run._renewal = trio.CancelScope()
        run._renewed = trio.Event()
        self._nursery.start_soon(self._renew, run)

    @enable_ki_protection
    async def _renew(self, run: Run) -> None:
        """Renew `run`'s lease every `RENEW_FRACTION` of it until `_end` cancels this (or the claim is
        lost)."""
        interval = self.lease * RENEW_FRACTION
        delay = interval
        assert run._renewal is not None
        try:
            with run._renewal:
                while True:
                    await trio.sleep(delay)
                    renew = c.RenewRun(run_id=run.id, claim_token=run.claim_token, lease_seconds=self.lease)
                    reply = await self._runtime.send(renew)
                    if reply.ok:
                        renewed = cast(RunRenewed, reply.result)
                        run.lease_expires_at = renewed["lease_expires_at"]
                        run.superseded = renewed["superseded"]
                        if run.superseded and self._cancel_superseded:
                            self._lose(run, "superseded")
                            return
                        delay = interval
                        continue
                    assert reply.error is not None
                    if reply.error.code in ("conflict", "not_found"):
                        self._lose(run, "claim_lost", cause=reply.error.message)
                        return
                    if reply.error.code == "shutting_down":
                        return  # no renewal comes now: the lease ends the claim unless the body finishes
                    delay = interval * RENEW_FRACTION
                    log.warning(
                        "run_renew_failed",
                        run_id=run.id,
                        code=reply.error.code,
                        cause=reply.error.message,
                        retry_in=delay,
                    )
        finally:
            run._renewed.set()

    @enable_ki_protection
    async def _watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Cancel a body at once when this runtime publishes that its run was cancelled or its lease ran
        out (a renewal would find out only later)."""
        with self._runtime.subscribe() as events:
            task_status.started()
            async for event in events:
                run = self._lost_by(event)
                if run is not None:
                    self._lose(run, event.type[len("run_") :], cause=getattr(event, "reason", None))

    def _lost_by(self, event: Event) -> Run | None:
        """The run being worked on whose claim `event` ends (None: none)."""
        if event.type not in ("run_cancelled", "run_lease_expired"):
            return None
        run_id, attempt = getattr(event, "run_id", None), getattr(event, "attempt", None)
        for run in self._active.values():
            if run.id == run_id and run.attempt == attempt and run.lost is None:
                return run
        return None

    def _lose(self, run: Run, why: str, cause: str | None = None) -> None:
        """The claim is lost (`why`: superseded, claim_lost, cancelled, lease_expired, worker_closed): say
        so, stop the renewals and the body."""
        if run.lost is not None or run._ended:
            return
        self._say_lost(run, why, cause)
        if run._renewal is not None:
            run._renewal.cancel()
        run._cancel_body()

    def _say_lost(self, run: Run, why: str, cause: str | None) -> None:
        """Record why the claim was lost, as `run.lost` and a WARNING `run_lost` diagnostic."""
        run.lost = why
        fields: dict[str, Any] = {
            "run_id": run.id,
            "task_id": run.task_id,
            "agent_profile_id": run.agent_profile_id,
        }
        Outbox(self._hub, reply=False).diagnostic("warning", "run_lost", **fields, reason=why, cause=cause)

    async def _end(self, run: Run, error: BaseException | None, *, cancelled: bool = False) -> None:
        """Resolve `run` once its body ended with `error` (None: it completed, or a lost claim cancelled it:
        `cancelled`): finish, fail or release it (module docstring). Never raises; shielded from
        cancellation (each step is one store transaction)."""
        if run._ended:
            return
        run._ended = True
        self._active.pop(run.claim_token, None)
        self._unentered.pop(run.claim_token, None)
        with trio.CancelScope(shield=True):
            if run._renewal is not None:
                run._renewal.cancel()
                await run._renewed.wait()
            if run.lost in LOST_CLAIMS:
                return  # another claim holds it, or it is over: nothing is left to finish
            if error is not None and not isinstance(error, Exception):
                await self._release(run)
            elif isinstance(error, HandBack):
                await self._requeue(run)
            elif isinstance(error, RunError):
                await self._finish(run, "failed", error.message, error.retryable, error.retry_at)
            elif error is not None:
                log.warning("run_body_failed", run_id=run.id, cause=shown(error), exc_info=error)
                await self._finish(run, "failed", f"{type(error).__name__}: {error}", True, None)
            elif cancelled:  # superseded, the body stopped: not retried (the runs queue cancels it)
                await self._finish(run, "failed", "its task left the step entry that queued it", False, None)
            else:  # completed (superseded or not: a finish still counts)
                await self._finish(run, "finished", None, True, None)

    async def _finish(
        self, run: Run, status: str, error: str | None, retryable: bool, retry_at: float | None
    ) -> None:
        command = c.FinishRun(
            run_id=run.id,
            claim_token=run.claim_token,
            status="finished" if status == "finished" else "failed",
            error=None if error is None else error[:MAX_TEXT_CHARS],
            retryable=retryable,
            retry_at=retry_at,
            result=run.result,
        )
        reply: Reply | None = None
        for attempt in range(FINISH_ATTEMPTS):
            reply = await self._runtime.send(command)
            if reply.ok or reply.error is None or not reply.error.retryable:
                break
            await trio.sleep(0.1 * 2**attempt)
        assert reply is not None
        if reply.ok:
            run.outcome = cast(FinishOutcome, reply.result)
            return
        assert reply.error is not None
        if reply.error.code == "conflict" and reply.error.field == "claim_token":
            self._say_lost(run, "claim_lost", reply.error.message)
        else:  # the lease ends the claim: the run is handed out again then
            log.warning("run_finish_failed", run_id=run.id, code=reply.error.code, cause=reply.error.message)

    async def _requeue(self, run: Run) -> None:
        """Return the run to the queue under its claim (`requeue_run`); a lost claim is said so."""
        reply = await self._runtime.send(c.RequeueRun(run_id=run.id, claim_token=run.claim_token))
        if reply.ok:
            run.released = True
        elif reply.error is not None and reply.error.field == "claim_token":
            self._say_lost(run, "claim_lost", reply.error.message)
        else:
            log.warning("run_requeue_failed", run_id=run.id, cause=reply.error and reply.error.message)

    async def _release(self, run: Run) -> None:
        """Hand the claim back: queued again at once, the attempt not counted (store/runs/run_claims.py)."""
        services = self._runtime.services
        try:
            released = await services.store.transact(run_claims.release, run.id, run.claim_token)
        except Exception as exc:  # the store is closed, or a fault: the lease ends the claim
            log.warning("run_release_failed", run_id=run.id, cause=shown(exc))
            return
        if released:
            run.released = True
            services.run_signals.notify(run.agent_profile_id)  # a waiting claim of the agent looks again
            Outbox(self._hub, reply=False).diagnostic(
                "info",
                "run_released",
                run_id=run.id,
                task_id=run.task_id,
                agent_profile_id=run.agent_profile_id,
            )


class _HandedBack(BaseException):
    """`_end`'s error for a run to hand back (the body was cancelled, or never began)."""


HANDED_BACK = _HandedBack()


def _refusal(info: ErrorInfo) -> OnceflowError:
    """The refusal in `info` as an exception of its code (`invalid_message`: ProtocolError)."""
    if info.code == "invalid_message":
        return ProtocolError(info.message, field=info.field)
    error = OnceflowError(info.message, field=info.field)
    error.code = info.code
    return error
