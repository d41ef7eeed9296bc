"""The W3C trace context a command may carry (`traceparent`, `tracestate`): every command model has both
fields. Pure: the wire, no thread.

A host that traces its own work sends the context of its current span with a command, as an HTTP client
sends the `traceparent` header (https://www.w3.org/TR/trace-context/); the runtime's span of that command
is then that span's child (onceflow/observability/tracing.py). In process a host need not: the runtime takes
its current OpenTelemetry context as the parent, and a `traceparent` a command carries overrides it. Neither
field changes what the command does.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from onceflow.protocol.field_docs import describe_fields
from onceflow.protocol.limits import MAX_TRACESTATE_CHARS

TRACEPARENT_PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?$"
"""`version-trace_id-parent_id-flags` in lowercase hex, as W3C Trace Context level 1 writes it (a later
version may append fields after a `-`)."""

MAX_TRACEPARENT_CHARS = 256
"""A `traceparent` is 55 characters in version 00; later versions may be longer, up to this."""

TRACE_FIELDS = ("traceparent", "tracestate")
"""The fields every command has for its trace context (docs/protocol.md lists them once)."""


class TraceContext(BaseModel):
    """The trace context fields every command accepts (none of them changes what the command does)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=describe_fields)

    traceparent: (
        Annotated[str, Field(max_length=MAX_TRACEPARENT_CHARS, pattern=TRACEPARENT_PATTERN)] | None
    ) = None
    """The W3C `traceparent` of the sender's current span: the runtime's span of this command is its child.
    None: the caller's current OpenTelemetry context in process, a new trace over `onceflow serve`."""
    tracestate: Annotated[str, Field(max_length=MAX_TRACESTATE_CHARS, pattern=r"^[ -~]*$")] | None = None
    """The W3C `tracestate` going with `traceparent` (vendor entries, passed on to the runtime's spans)."""
