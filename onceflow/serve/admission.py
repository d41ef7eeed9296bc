"""Who holds one of `onceflow serve`'s `max_connections` slots: a new client takes a free one; at the cap the
connection idle the longest is closed with an `evicted` line to make room for it, and when none is idle the
new client gets one `busy` line and is closed. Trio thread.
"""

from __future__ import annotations

import contextlib

import trio

from onceflow.observability.logs import get_logger
from onceflow.protocol.errors import BusyError
from onceflow.serve.connection import Connection
from onceflow.serve.options import EvictedError
from onceflow.serve.wire import error_frame, error_info

log = get_logger("onceflow.serve")

REFUSE_SECONDS = 1.0
"""How long a refused connection gets to take its one `busy` line before it is closed; also how long a new
client waits for the connection evicted for it to close."""
EVICT_SECONDS = 0.5
"""How long an evicted connection gets to take its `evicted` line before it is closed: less than
REFUSE_SECONDS, so that the client it makes room for is served within REFUSE_SECONDS."""


async def refuse(stream: trio.abc.Stream, busy: BusyError) -> None:
    """Send `stream` one `busy` error line (waiting at most REFUSE_SECONDS for the client to take it) and
    close it. A client already gone is not an error."""
    with (
        trio.move_on_after(REFUSE_SECONDS),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.send_all(error_frame(error_info(busy)))
    await trio.aclose_forcefully(stream)


class Admission:
    """At most `limit` connections hold a slot at once, each from `enter` until `leave` (its socket closed),
    so at most `limit` client sockets are open besides the ones being refused. `connections`: those being
    served, the candidates for eviction (`Connection.evictable`).

    An episode at the cap, from the first new client that finds no free slot until one finds a free slot
    again, logs one WARNING `connections_at_cap` and, at its end, one INFO `connections_below_cap` with how
    many clients were refused and evicted meanwhile; an evicted connection itself is logged at INFO.
    """

    def __init__(self, limit: int, connections: set[Connection]) -> None:
        self.limit = limit
        self._connections = connections
        self._held = 0
        self._handovers: dict[Connection, trio.Event] = {}  # evicted -> set when it has closed
        self._at_cap = False
        self._refused = 0
        self._evicted = 0

    async def enter(self, stream: trio.abc.Stream, *, stopping: bool) -> bool:
        """Give the new client on `stream` a slot: True when it has one (the caller serves it, then calls
        `leave`). At the cap, close the longest-idle connection with an `evicted` line and take its slot
        once it has closed (within EVICT_SECONDS); with none idle (or `stopping`), or if it is not closed
        within REFUSE_SECONDS, send `stream` one `busy` line, close it and return False. Cancelled while
        waiting, it holds nothing and `stream` is closed."""
        if self._held < self.limit:
            self._held += 1
            if self._at_cap:
                log.info(
                    "connections_below_cap",
                    refused=self._refused,
                    evicted=self._evicted,
                    connections=len(self._connections),
                )
                self._at_cap, self._refused, self._evicted = False, 0, 0
            return True
        if not self._at_cap:
            self._at_cap = True
            log.warning("connections_at_cap", max_connections=self.limit)
        victim = None if stopping else self._longest_idle()
        try:
            if victim is not None and await self._evict(victim):
                return True
        except BaseException:  # cancelled while waiting: the stream is not served
            await trio.aclose_forcefully(stream)
            raise
        self._refused += 1
        await refuse(
            stream, BusyError(f"the server already serves its limit of {self.limit} connections; retry later")
        )
        return False

    def leave(self, conn: Connection | None) -> None:
        """A connection's socket is closed (`conn` None: it failed before it was set up): its slot goes to
        the client waiting for it, if any, else it is free."""
        handover = None if conn is None else self._handovers.pop(conn, None)
        if handover is not None:
            handover.set()
        else:
            self._held -= 1

    def _longest_idle(self) -> Connection | None:
        idle = (conn for conn in self._connections if conn.evictable())
        return min(idle, key=lambda conn: conn.last_active, default=None)

    async def _evict(self, victim: Connection) -> bool:
        """Close `victim` and wait for its slot; False if it did not close within REFUSE_SECONDS (its slot
        is then freed when it does)."""
        handover = self._handovers[victim] = trio.Event()
        self._evicted += 1
        idle = trio.current_time() - victim.last_active
        evicted = EvictedError(
            f"the server is at its limit of {self.limit} connections and this one was idle the longest "
            f"({idle:.1f} seconds); connect again when there is something to send"
        )
        victim.fail(evicted, within=EVICT_SECONDS, warn=False)
        try:
            with trio.move_on_after(REFUSE_SECONDS):
                await handover.wait()
        except BaseException:
            if handover.is_set():
                self._held -= 1  # the slot was handed to a client that will not be served
            else:
                self._handovers.pop(victim, None)
            raise
        if not handover.is_set():
            self._handovers.pop(victim, None)
            return False
        return True
