"""onceflow's traces, through OpenTelemetry's API: nothing is recorded until a tracer provider with an SDK
is there. Trio thread (spans start and end on the runtime's thread; `current` is also called on an asyncio
caller's thread by onceflow/aio.py).

Spans (tracer name `onceflow`; docs/observability.md, "Tracing"):

| name | parent | what it covers |
|---|---|---|
| `onceflow.command <type>` | the sender's span (1) | one command, from its parse to its reply |
| `onceflow.entry` | the command (1) | one step entry: preflight, admission, on_exit, on_enter dispatch |
| `onceflow.action <type>` | the entry or command | one engine-owned action (2) |
| `onceflow.host <method>` | the entry, action or command | one call of the host (3) |
| `onceflow.coordinator <method>` | the `outcome_ready` command | one attempt of `deliver` or `acknowledge` |

(1) The OpenTelemetry context current where `Runtime.send` (or the asyncio bridge's `send`) was called, or
the W3C `traceparent` the command carries (protocol/tracecontext.py), which wins. A command queued behind a
busy task actor carries the context in its mailbox envelope; a WIP promotion's entry carries the context
where the slot was freed (the entry, or command, that moved the task out). (2) An action the store ran
inside a transaction (a common entry, a segment) gets a span timed as that transaction, made when its
outcome is published. (3) `perform_session_action`, `start_code_review` or `preflight_transition`.

Attributes, where known: `onceflow.task_id`, `onceflow.workflow_id`, `onceflow.step_id`,
`onceflow.entry_seq`, `onceflow.entry_path`, `onceflow.operation_id`, `onceflow.run_id`,
`onceflow.outcome_id`, and per span kind the ones named below. A refused command's span has status ERROR
and `onceflow.error.code`; a host call that raised records its exception.

The hot path stays cheap: `Tracing.tracer()` is None while nothing would record (the global provider is
still OpenTelemetry's proxy or a no-op one, or the runtime was given a no-op provider), and then no span,
attribute dict or context is built at all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

Attributes: TypeAlias = dict[str, AttributeValue]
"""A span's attributes."""

NAME = "onceflow"
"""The tracer's (instrumentation scope's) name."""

TASK_ID = "onceflow.task_id"
WORKFLOW_ID = "onceflow.workflow_id"
STEP_ID = "onceflow.step_id"
ENTRY_SEQ = "onceflow.entry_seq"
ENTRY_PATH = "onceflow.entry_path"
OPERATION_ID = "onceflow.operation_id"
RUN_ID = "onceflow.run_id"
OUTCOME_ID = "onceflow.outcome_id"
COMMAND = "onceflow.command"
"""The command's type."""
ERROR_CODE = "onceflow.error.code"
"""A refused command's `error.code`."""
EVENTS = "onceflow.events"
"""How many events a command's reply carries."""
ACTION_TYPE = "onceflow.action.type"
ACTION_POSITION = "onceflow.action.position"
"""The action's index in its trigger's list."""
ACTION_OUTCOME = "onceflow.action.outcome"
"""done, skipped, failed, abandoned or already_done (the `action_outcome` event's `outcome`)."""
TRIGGER = "onceflow.trigger"
CYCLE_ID = "onceflow.cycle_id"
ATTEMPT = "onceflow.attempt"
ENTRY_RESULT = "onceflow.entry.result"
"""An entry's end: admitted, queued (WIP), abandoned (the task moved meanwhile) or stale_row."""

_COMMAND_FIELDS = (
    ("task_id", TASK_ID),
    ("workflow_id", WORKFLOW_ID),
    ("step_id", STEP_ID),
    ("operation_id", OPERATION_ID),
    ("run_id", RUN_ID),
    ("outcome_id", OUTCOME_ID),
)
"""A command's fields copied onto its span, when it has them."""

_NO_RECORDING = (ProxyTracerProvider, NoOpTracerProvider)
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """Where one runtime's spans go: the `tracer_provider` given to `open_runtime`, else the global one
    (`opentelemetry.trace.set_tracer_provider`, before or after the runtime opened)."""

    __slots__ = ("_settled", "_tracer")

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._tracer: Tracer | None = None
        self._settled = False  # the provider is known for good: `_tracer` is the answer
        if provider is not None:
            self._settle(provider)
        elif OTEL_PYTHON_TRACER_PROVIDER in os.environ:  # the API loads the one the environment names
            self._settle(trace.get_tracer_provider())

    def tracer(self) -> Tracer | None:
        """The tracer to start spans with, or None while nothing would record them (the fast path: an
        attribute or two, no call into OpenTelemetry).

        The global provider can be set once only (`set_tracer_provider` refuses a second), so once set it
        is settled; until then it is OpenTelemetry's proxy, which records nothing."""
        if self._settled:
            return self._tracer
        provider = trace._TRACER_PROVIDER  # what `get_tracer_provider` reads, without its environment lookup
        if provider is None:
            return None
        self._settle(provider)
        return self._tracer

    def _settle(self, provider: trace.TracerProvider) -> None:
        self._tracer = None if isinstance(provider, _NO_RECORDING) else provider.get_tracer(NAME)
        self._settled = True


def current() -> Context:
    """The OpenTelemetry context current on the calling thread and task (to carry to another)."""
    return otel_context.get_current()


@contextmanager
def attached(parent: Context | None) -> Iterator[None]:
    """Make `parent` the current context inside the block (None: leave the current one)."""
    if parent is None:
        yield
        return
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def span(
    tracer: Tracer,
    name: str,
    attributes: Mapping[str, AttributeValue],
    *,
    benign: tuple[type[BaseException], ...] = (),
) -> Iterator[Span]:
    """A span, current inside the block, child of the current one; an exception leaving the block is
    recorded on it with status ERROR (and passes on), unless it is one of `benign` (no failure: e.g. a
    stale cached row, read again)."""
    with tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as started:
        try:
            yield started
        except benign:
            raise
        except BaseException as exc:
            started.record_exception(exc)
            started.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise


def ids(**values: Any) -> Attributes:
    """`onceflow.<name>` attributes of the values that are known (None and "" are left out)."""
    return {f"onceflow.{name}": value for name, value in values.items() if value is not None and value != ""}


class CommandSpan:
    """The span of one command, current from its start until `finish` (the command's handling is its
    child). Its parent is the command's `traceparent` when it carries one, else the current context."""

    __slots__ = ("_span", "_token")

    def __init__(self, tracer: Tracer, command: Any, command_type: str) -> None:
        parent = _carried(command)
        attributes: dict[str, AttributeValue] = {COMMAND: command_type}
        for field, key in _COMMAND_FIELDS:
            value = getattr(command, field, None)
            if isinstance(value, str | int) and value != "":
                attributes[key] = value
        envelope = getattr(command, "envelope", None)  # outcome_ready names its outcome in the envelope
        if envelope is not None and isinstance(getattr(envelope, "outcome_id", None), str):
            attributes[OUTCOME_ID] = envelope.outcome_id
        name = f"onceflow.command {command_type}"
        self._span = tracer.start_span(name, context=parent, attributes=attributes)
        self._token = otel_context.attach(trace.set_span_in_context(self._span, parent))

    def finish(self, reply: Any, error: BaseException | None = None) -> None:
        """End the span with the command's `Reply` (status ERROR and `onceflow.error.code` when it was
        refused), or with the exception that stopped it (a cancellation); restores the context."""
        otel_context.detach(self._token)
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        elif reply is not None:
            self._span.set_attribute(EVENTS, len(reply.events))
            if reply.error is not None:
                self._span.set_attribute(ERROR_CODE, reply.error.code)
                self._span.set_status(Status(StatusCode.ERROR, f"{reply.error.code}: {reply.error.message}"))
        self._span.end()


def _carried(command: Any) -> Context | None:
    """The context a command's `traceparent` (and `tracestate`) name, or None when it carries none."""
    traceparent = getattr(command, "traceparent", None)
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    tracestate = getattr(command, "tracestate", None)
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier, context=Context())


def now() -> int:
    """The time spans are stamped with: Unix nanoseconds."""
    return time.time_ns()


def action_spans(
    tracer: Tracer, events: Sequence[Any], started: int, ended: int, attributes: Mapping[str, AttributeValue]
) -> None:
    """One finished span per `action_outcome` among `events` (what one transaction, from `started` to
    `ended` Unix nanoseconds, ran and has just published), child of the current span, with `attributes`
    and the action's type, position, trigger and outcome."""
    for event in events:
        if event.type != "action_outcome":
            continue
        own = {
            **attributes,
            TASK_ID: event.task_id,
            STEP_ID: event.step_id,
            ACTION_TYPE: event.kind,
            ACTION_POSITION: event.position,
            TRIGGER: event.trigger,
            ACTION_OUTCOME: event.outcome,
        }
        done = tracer.start_span(f"onceflow.action {event.kind}", attributes=own, start_time=started)
        if event.outcome == "failed":
            done.set_status(Status(StatusCode.ERROR, event.detail or "failed"))
        done.end(end_time=ended)
