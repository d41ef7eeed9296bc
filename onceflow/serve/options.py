"""`onceflow serve`'s bounds and the connection errors they cause. Trio thread (plain data)."""

from __future__ import annotations

import math

import attrs

from onceflow.protocol.errors import OnceflowError
from onceflow.protocol.limits import MAX_MESSAGE_BYTES


class SlowConsumerError(OnceflowError):
    """The client stopped reading and its outgoing queue filled (`--queue-size` lines or `--queue-bytes`
    bytes); the server disconnects it."""

    code = "slow_consumer"


class IdleTimeoutError(OnceflowError):
    """The client sent nothing and had nothing in flight for `--idle-timeout` seconds; the server closes
    it."""

    code = "idle_timeout"


class EvictedError(OnceflowError):
    """The server was at `--max-connections` when a new client arrived, and this connection was the one
    idle the longest (nothing pending, queued or subscribed): it was closed to make room. Nothing was in
    flight; connect again when there is something to send."""

    code = "evicted"
    retryable = True


def _nonnegative_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number of seconds >= 0, not {value!r}")


def _positive_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number of seconds > 0, not {value!r}")


@attrs.frozen
class ServeOptions:
    """Per-connection and server bounds (the module docstring says what each does).

    `queue_size` outgoing lines and `queue_bytes` outgoing bytes a client may lag behind; `max_line` bytes
    in one request line (default and at most the protocol's message limit, `MAX_MESSAGE_BYTES`, its one
    owner: a line serve reads is never one the runtime refuses for its size; ValueError beyond it);
    `max_pipeline` received lines waiting to be applied; `grace` seconds a disconnecting client (slow,
    idle, or at shutdown) gets to read what is queued; `max_connections` clients at once (None: what the
    open-files limit allows, at most 256; `serve` sizes it at start, onceflow/serve/descriptors.py);
    `idle_timeout` seconds without activity before a client is closed (0: never); `backlog` connections the
    kernel queues before they are accepted; `host_timeout` seconds a host connection has to answer a call
    it was offered, and `host_wait` seconds a call waits for a host with its capability to be connected
    (the host role: actors/runtime/host_broker.py).
    """

    queue_size: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    queue_bytes: int = attrs.field(default=8 << 20, validator=attrs.validators.ge(1))
    max_line: int = attrs.field(
        default=MAX_MESSAGE_BYTES, validator=[attrs.validators.ge(1), attrs.validators.le(MAX_MESSAGE_BYTES)]
    )
    max_pipeline: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    grace: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    max_connections: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    idle_timeout: float = attrs.field(default=300.0, validator=_nonnegative_seconds)
    backlog: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    host_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    host_wait: float = attrs.field(default=10.0, validator=_positive_seconds)
