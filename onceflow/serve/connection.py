"""One client of `onceflow serve`: its stream, its bounded queues, what it has in flight, and the scopes
that stop it. Trio thread."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from onceflow.actors.runtime.host_broker import RegisteredHost
from onceflow.observability.logs import get_logger
from onceflow.protocol.errors import OnceflowError
from onceflow.protocol.events import ErrorInfo
from onceflow.serve.options import ServeOptions, SlowConsumerError
from onceflow.serve.wire import error_info

log = get_logger("onceflow.serve")


@attrs.define(eq=False)
class Connection:
    """One client: its stream, its bounded queues, what it has in flight, and the scopes that stop it."""

    number: int  # the n-th connection since start, for the logs
    stream: trio.abc.Stream
    nursery: trio.Nursery
    out: trio.MemorySendChannel[bytes]
    queued: trio.MemoryReceiveChannel[bytes]
    options: ServeOptions
    reading: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    writing: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    watching: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    subscription: trio.CancelScope | None = None  # the event pump's, once subscribed
    failure: ErrorInfo | None = None
    out_bytes: int = 0  # queued for the client, not yet taken by the socket
    peak_out_bytes: int = 0
    pending: int = 0  # received lines not yet answered (waiting, or running)
    pending_bytes: int = 0  # of which waiting in the pipeline or running
    freed: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    drained: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)  # `push_paced` waits
    last_active: float = attrs.field(factory=trio.current_time)
    host: RegisteredHost | None = None  # registered as a host (onceflow/serve/hosting.py)
    hung_up: bool = False  # the client closed its side: a waiting claim_run stops waiting
    claim_wait: trio.CancelScope | None = None  # the claim_run under way, which `hang_up` cancels
    on_fail: Callable[[], None] | None = None  # told when `fail` disconnects it (a host's calls move on)

    def push(self, frame: bytes) -> bool:
        """Queue a line for the client without ever waiting; past `queue_size` lines or `queue_bytes`
        bytes the client is a slow consumer and is disconnected. Whether the line was queued."""
        if self.failure is not None:
            return False
        size, limit = len(frame), self.options.queue_bytes
        if self.out_bytes + size > limit:
            held = f"{self.out_bytes} bytes wait for it" if self.out_bytes else f"a line of {size} bytes"
            self.fail(
                SlowConsumerError(f"the client is not reading fast enough: {held}, the limit is {limit}")
            )
            return False
        try:
            self.out.send_nowait(frame)
        except trio.WouldBlock:
            self.fail(SlowConsumerError("the client stopped reading and its outgoing queue is full"))
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False  # the client is gone or the connection is closing: the line has nowhere to go
        self.out_bytes += size
        self.peak_out_bytes = max(self.peak_out_bytes, self.out_bytes)
        return True

    async def push_paced(self, frame: bytes) -> None:
        """Queue a line once the outgoing queue holds less than half its `queue_size` lines and half its
        `queue_bytes` bytes (or nothing at all), waiting for the client to read meanwhile: a replay goes at
        the client's pace, and the other half stays free for replies and live lines. A frame larger than
        `queue_bytes` still makes a slow consumer. Cancelled with the subscription, nothing is queued."""
        lines, space = max(1, self.options.queue_size // 2), self.options.queue_bytes // 2
        while self.failure is None and (
            self.out.statistics().current_buffer_used >= lines
            or (self.out_bytes and self.out_bytes + len(frame) > space)
        ):
            await self.drained.park()
        self.push(frame)

    def taken(self, size: int) -> None:
        """The socket took a frame of `size` bytes: room for `push_paced`."""
        self.out_bytes -= size
        if self.drained:
            self.drained.unpark_all()

    def offer(self, frame: bytes) -> bool:
        """`HostLink.offer` (actors/runtime/host_broker.py): queue a call line for this host connection."""
        return self.push(frame)

    def fail(self, exc: OnceflowError, *, within: float | None = None, warn: bool = True) -> None:
        """Disconnect: read nothing more, send nothing new, flush what is queued plus the error line, within
        `within` seconds (None: `grace`). Logged as a WARNING `client_disconnected`, or at INFO when not
        `warn` (an eviction: its episode has a WARNING of its own)."""
        self.failure = error_info(exc)
        (log.warning if warn else log.info)(
            "client_disconnected",
            connection=self.number,
            code=exc.code,
            reason=exc.message,
            queued_bytes=self.out_bytes,
            peak_queued_bytes=self.peak_out_bytes,
            queue_bytes=self.options.queue_bytes,
        )
        self.reading.cancel()
        self.end_subscription()
        self.close_within(self.options.grace if within is None else within)
        if self.on_fail is not None:
            self.on_fail()

    def end_subscription(self) -> None:
        if self.subscription is not None:
            self.subscription.cancel()

    def close_within(self, seconds: float) -> None:
        self.writing.deadline = min(self.writing.deadline, trio.current_time() + seconds)

    def touch(self) -> None:
        """Something happened on the connection: its idle time starts again."""
        self.last_active = trio.current_time()

    def hang_up(self) -> None:
        """The client closed its side (end of stream): a claim_run waiting for a run stops waiting and
        claims nothing (one it committed meanwhile is handed back); a later one does not wait at all."""
        self.hung_up = True
        if self.claim_wait is not None:
            self.claim_wait.cancel()

    def busy(self) -> bool:
        """Whether the connection has something in flight: a command, a queued line, a subscription, or a
        host registration (a host waits for calls)."""
        return bool(self.pending or self.out_bytes or self.subscription is not None or self.host is not None)

    def evictable(self) -> bool:
        """Whether the server may close this connection to make room for a new client at `max_connections`
        (admission.py): it is still served and idle (`busy` false). The one test of who may be evicted."""
        return self.failure is None and not self.busy()

    async def admit(self, size: int) -> None:
        """Wait until `size` more received bytes fit in the pipeline's `max_line` (one line always fits)."""
        while self.pending_bytes and self.pending_bytes + size > self.options.max_line:
            await self.freed.park()
        self.pending += 1
        self.pending_bytes += size

    def answered(self, size: int) -> None:
        self.pending -= 1
        self.pending_bytes -= size
        self.freed.unpark_all()
        self.touch()
