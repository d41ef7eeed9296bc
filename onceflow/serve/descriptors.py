"""`onceflow serve`'s file descriptors: the connection cap the open-files limit (RLIMIT_NOFILE) allows, and
the spare descriptor that lets a client be told `busy` when accept fails for want of one. Trio thread
(plain system calls).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import sys
from types import TracebackType

import trio

from onceflow.observability.logs import get_logger
from onceflow.protocol.errors import BusyError
from onceflow.serve.admission import refuse

log = get_logger("onceflow.serve")

DEFAULT_MAX_CONNECTIONS = 256
"""`--max-connections` when not given, if the open-files limit allows it (else what the limit allows)."""
HEADROOM = 32
"""Descriptors kept free beyond those open at start (stdio, the listener, the store's files or socket, logs):
the spare below, a store reconnection (SQLite's file, WAL and shm; a PostgreSQL socket), sockets being
refused (each held up to REFUSE_SECONDS) or evicted, and a margin."""
DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
"""accept(2) failures for want of a file descriptor (the process's, the system's): the spare answers them."""
_UNCOUNTED = 64  # descriptors assumed open where they cannot be listed


def descriptors_open() -> int:
    """How many file descriptors the process has open now (`_UNCOUNTED` where it cannot list them)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder)) - 1  # not the listing's own descriptor
    return _UNCOUNTED


def _name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _finite(limit: int) -> int:
    return sys.maxsize if limit == resource.RLIM_INFINITY else limit


def connection_caps(
    socket: int | None, http: int | None, *, serving_socket: bool, serving_http: bool
) -> tuple[int, int]:
    """The caps of the socket's clients and of the HTTP connections, which share one descriptor budget: the
    two together are `connection_cap` of the sum of what each wants, so serving both never holds more
    descriptors than the open-files limit leaves. Each wants its own figure (`socket` None:
    DEFAULT_MAX_CONNECTIONS; `http` None: the socket's); a listener not served wants nothing (its cap is 0).
    When the limit cannot hold the sum, each gets its share of what it leaves in proportion to its want, at
    least one each (room for one: one each, the second out of HEADROOM). Raises OSError (EMFILE) as
    `connection_cap` does."""
    socket_wants = (socket or DEFAULT_MAX_CONNECTIONS) if serving_socket else 0
    http_wants = (http or socket or DEFAULT_MAX_CONNECTIONS) if serving_http else 0
    explicit = (serving_socket and socket is not None) or (serving_http and (http or socket) is not None)
    wanted = socket_wants + http_wants
    total = connection_cap(wanted if explicit else None, default=wanted)
    if total >= wanted or not (socket_wants and http_wants):
        caps = min(socket_wants, total), min(http_wants, total)
    else:
        socket_cap = max(1, min(total * socket_wants // wanted, total - 1))
        caps = socket_cap, max(1, total - socket_cap)  # (1, 1) when room is left for one: HEADROOM has it
    if socket_wants and http_wants:
        log.info("connection_limits_shared", socket_max_connections=caps[0], http_max_connections=caps[1])
    return caps


def connection_cap(requested: int | None, *, default: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """The most clients `onceflow serve` holds at once: `requested` (None: `default`), within
    what the open-files limit leaves once the descriptors open now and HEADROOM are set aside. Call it with
    the store open, before accepting.

    The soft limit is first raised toward the hard one, as far as that needs and no further (as many
    servers do; the hard limit is the administrator's, never passed). A default the limit cannot hold
    becomes what it can; an explicit `requested` it cannot hold is lowered the same way, with a WARNING
    `max_connections_clamped` (clamped, not refused: the server still serves on a host with a lower
    limit, and says so). Logs INFO `connection_limit`. Raises OSError (EMFILE) when the limit leaves no
    descriptor for a single client.
    """
    wanted = requested or default
    in_use = descriptors_open()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = in_use + HEADROOM + wanted
    if _finite(soft) < needed:
        raised = min(needed, _finite(hard))
        with contextlib.suppress(OSError, ValueError):  # not permitted here: the current limit stands
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    allowed = _finite(soft) - in_use - HEADROOM
    if allowed < 1:
        raise OSError(
            errno.EMFILE,
            f"the open-files limit of {soft} leaves no descriptor for a client: {in_use} are open and "
            f"{HEADROOM} are kept in reserve; raise it (ulimit -n)",
            "RLIMIT_NOFILE",
        )
    cap = min(wanted, allowed)
    if requested is not None and cap < requested:
        log.warning(
            "max_connections_clamped", requested=requested, max_connections=cap, open_files_limit=soft
        )
    log.info(
        "connection_limit",
        max_connections=cap,
        open_files_limit=soft,
        open_files_hard_limit=hard,
        descriptors_open=in_use,
        headroom=HEADROOM,
    )
    return cap


class SpareDescriptor:
    """One descriptor held open (on /dev/null) for a rainy day: when accept fails for want of a descriptor
    (EMFILE, ENFILE), `accept_waiting` closes it and accepts the next client in its place, so that client
    is answered (`busy`) instead of waiting in the backlog, unanswered. A context manager: the spare is
    closed on exit.

    An episode (from the first client so refused until one is served again) logs one WARNING
    `accept_out_of_descriptors` and, at its end, one INFO `accept_descriptors_back` with how many clients
    were refused meanwhile.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self.refused = 0  # clients refused in the current episode
        self.restore()

    def __enter__(self) -> SpareDescriptor:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()

    def restore(self) -> bool:
        """Hold the spare again, if not held; False when no descriptor is free for it."""
        if self._fd is None:
            with contextlib.suppress(OSError):
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return self._fd is not None

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def accept_waiting(
        self, listener: trio.abc.Listener[trio.SocketStream], exc: OSError, connections: int
    ) -> trio.SocketStream | None:
        """After accept failed with `exc` for want of a descriptor (DESCRIPTOR_ERRNOS), the spare held: close
        the spare and accept the next client in its place, waiting for one (the kernel fails accept so
        whether or not a client waits). If a descriptor is free again by then (the spare can be held
        again), return the client to be served; else send it one `busy` line (at most REFUSE_SECONDS),
        close it, hold the spare again and return None. `connections`: those being served, for the log.

        Raises `exc` itself when it is another shortage or no spare is held, and the accept's own error if
        the accept in the spare's place fails too (another thread took the descriptor): the caller pauses.
        Cancelled while waiting, the spare is held again.
        """
        if exc.errno not in DESCRIPTOR_ERRNOS or self._fd is None:
            raise exc
        self._release()
        try:
            stream = await listener.accept()
        except BaseException:
            self.restore()
            raise
        if self.restore():
            return stream  # a descriptor came free: nothing to refuse
        try:
            if not self.refused:
                log.warning(
                    "accept_out_of_descriptors",
                    errno=_name(exc),
                    reason=exc.strerror,
                    connections=connections,
                )
            self.refused += 1
            busy = BusyError(
                f"the server has no file descriptor for another connection ({_name(exc)}); retry later"
            )
            await refuse(stream, busy)
        finally:
            self.restore()
        return None

    def accepted(self) -> None:
        """A client is being served: end the episode, if one was under way."""
        if self.refused:
            log.info("accept_descriptors_back", refused=self.refused)
            self.refused = 0
