"""Events and replies built without validation are the validated ones.

`protocol/trusted.py` builds the hot path's events and every `Runtime.send` reply without pydantic
validation. A host must observe nothing of it: each built instance must equal the validated
`Model(**same_arguments)` field by field, with the same fields set, `model_dump()`, JSON and repr; each
builder must still take exactly its model's fields; `Outbox` must keep what it did (the reply a copy of the
events, a bad diagnostic level refused, counted events counted, a log below the host's level dropped).
"""

from __future__ import annotations

import gc
import inspect
import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pydantic import BaseModel, ValidationError

from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.observability import metrics
from onceflow.observability.logs import get_logger
from onceflow.protocol import trusted
from onceflow.protocol.events import (
    ActionOutcome,
    DecisionsCleared,
    Diagnostic,
    ErrorInfo,
    Reply,
    RunCancelled,
    RunLeaseExpired,
    RunQueued,
    StepEntered,
    TaskCreated,
    Transition,
)

text = st.text(max_size=12)
optional_text = st.none() | text
integer = st.integers(min_value=-(2**63), max_value=2**63 - 1)
json_value = st.recursive(
    st.none() | st.booleans() | integer | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
levels = st.sampled_from(["debug", "info", "warning", "error"])

ARGUMENTS: dict[Callable[..., BaseModel], st.SearchStrategy[dict[str, Any]]] = {
    trusted.task_created: st.fixed_dictionaries({"task_id": text, "workflow_id": text, "step_id": text}),
    trusted.transition: st.fixed_dictionaries(
        {"task_id": text, "workflow_id": text, "from_step": text, "to_step": text, "trigger": text}
    ),
    trusted.step_entered: st.fixed_dictionaries(
        {
            "task_id": text,
            "step_id": text,
            "entry_seq": st.none() | integer,
            "entry_path": st.sampled_from(["E1", "E2", "E3", "E4", "E5", "recovery"]),
        }
    ),
    trusted.decisions_cleared: st.fixed_dictionaries({"task_id": text, "step_id": text, "deleted": integer}),
    trusted.run_queued: st.fixed_dictionaries(
        {
            "run_id": integer,
            "task_id": optional_text,
            "step_id": optional_text,
            "agent_profile_id": text,
            "reason": text,
            "idempotency_key": optional_text,
            "outcome": st.just("queued"),
            "priority": st.integers(0, 3),
            "parent_run_id": st.none() | integer,
            "causation_depth": st.integers(0, 8),
        }
    ),
    trusted.action_outcome: st.fixed_dictionaries(
        {
            "task_id": text,
            "step_id": text,
            "trigger": text,
            "position": integer,
            "kind": text,
            "outcome": st.sampled_from(["done", "skipped", "failed"]),
            "detail": text,
        }
    ),
    trusted.diagnostic: st.fixed_dictionaries(
        {"level": levels, "code": text, "fields": st.dictionaries(text, json_value, max_size=4)}
    ),
}
MODELS: dict[Callable[..., BaseModel], type[BaseModel]] = {
    trusted.task_created: TaskCreated,
    trusted.transition: Transition,
    trusted.step_entered: StepEntered,
    trusted.decisions_cleared: DecisionsCleared,
    trusted.run_queued: RunQueued,
    trusted.action_outcome: ActionOutcome,
    trusted.diagnostic: Diagnostic,
}
builders_and_arguments = st.sampled_from(list(ARGUMENTS)).flatmap(
    lambda builder: st.tuples(st.just(builder), ARGUMENTS[builder])
)


def assert_same(built: BaseModel, validated: BaseModel) -> None:
    """Everything a host can observe of a model instance, compared."""
    assert type(built) is type(validated)
    assert built == validated
    assert list(built.__dict__.items()) == list(validated.__dict__.items())  # declaration order too
    assert built.model_fields_set == validated.model_fields_set
    assert built.__pydantic_extra__ == validated.__pydantic_extra__
    assert built.__pydantic_private__ == validated.__pydantic_private__
    assert built.model_dump() == validated.model_dump()
    assert built.model_dump(exclude_unset=True) == validated.model_dump(exclude_unset=True)
    assert built.model_dump_json() == validated.model_dump_json()
    assert repr(built) == repr(validated)
    assert _hash(built) == _hash(validated)


def _hash(model: BaseModel) -> int | str:
    try:
        return hash(model)
    except TypeError as exc:  # a frozen model holding a dict (Diagnostic) or a mutable one (Reply)
        return str(exc)


@given(case=builders_and_arguments)
def test_a_trusted_event_equals_the_validated_one(case: tuple[Callable[..., BaseModel], Any]) -> None:
    builder, arguments = case
    assert_same(builder(**arguments), MODELS[builder](**arguments))


@given(case=builders_and_arguments)
def test_an_event_the_window_holds_compactly_comes_back_as_the_validated_one(
    case: tuple[Callable[..., BaseModel], Any],
) -> None:
    builder, arguments = case
    kept = trusted.held(builder(**arguments))
    assert not isinstance(kept, BaseModel)  # every trusted event is held as plain values
    assert_same(trusted.restored(kept), MODELS[builder](**arguments))


def test_the_window_holds_trusted_events_as_values_the_gc_does_not_track() -> None:
    """The event window keeps its last 10,000 events alive: held as models, the cyclic GC traversed them."""
    kept = [
        trusted.held(
            trusted.transition(task_id="T", workflow_id="w", from_step="a", to_step="b", trigger="t")
        ),
        trusted.held(trusted.diagnostic(level="info", code="c", fields={"task_id": "T", "n": 3})),
    ]
    gc.collect()  # a tuple of untracked values stops being tracked at its first collection, the diagnostic's
    gc.collect()  # outer tuple once its inner ones are (the next)
    assert not any(gc.is_tracked(value) for value in kept)
    validated = Transition(task_id="T", workflow_id="w", from_step="a", to_step="b", trigger="t")
    assert trusted.held(validated) is validated  # not built here: held as it is
    assert trusted.restored(validated) is validated


def test_each_trusted_builder_takes_exactly_its_models_fields() -> None:
    """A field added to a model without its builder fails here, not silently in a reply."""
    for builder, model in MODELS.items():
        parameters = set(inspect.signature(builder).parameters)
        assert parameters == set(model.model_fields) - {"type"}, builder.__name__
    assert set(inspect.signature(trusted.reply).parameters) == set(Reply.model_fields) - {"type", "ok"}


def test_a_trusted_event_stays_frozen() -> None:
    event = trusted.run_queued(
        run_id=1, task_id="T", step_id="s", agent_profile_id="a", reason="r", idempotency_key=None
    )
    with pytest.raises(ValidationError, match="frozen"):
        event.reason = "other"  # type: ignore[misc]


events = st.lists(
    st.sampled_from(list(ARGUMENTS)).flatmap(lambda builder: ARGUMENTS[builder].map(lambda a: builder(**a))),
    max_size=9,
)


@given(command=text, produced=events, result=json_value)
def test_a_trusted_ok_reply_serializes_as_the_validated_one(
    command: str, produced: list[Any], result: Any
) -> None:
    built = trusted.reply(command, list(produced), result=result)
    validated = Reply(command=command, ok=True, result=result, events=produced)
    assert_same(built, validated)
    assert Reply.model_validate_json(built.model_dump_json()) == validated


@given(command=text, produced=events, code=text, field=optional_text, retryable=st.booleans())
def test_a_trusted_error_reply_serializes_as_the_validated_one(
    command: str, produced: list[Any], code: str, field: str | None, retryable: bool
) -> None:
    error = ErrorInfo(code=code, message="m", field=field, retryable=retryable)
    built = trusted.reply(command, list(produced), error=error)
    validated = Reply(command=command, ok=False, error=error, events=produced)
    assert_same(built, validated)


def test_an_outbox_reply_is_a_copy_of_its_events_so_far() -> None:
    """Validation copied the list: an event emitted after the reply was built is not in it."""
    out = Outbox(EventHub())
    out.emit(StepEntered(task_id="T", step_id="s", entry_seq=1, entry_path="E2"))
    reply = out.reply("move_task", result={"task_id": "T"})
    out.emit(TaskCreated(task_id="T", workflow_id="w", step_id="s"))
    assert [e.type for e in reply.events] == ["step_entered"]
    assert reply == Reply(command="move_task", ok=True, result={"task_id": "T"}, events=out.events[:1])


def test_a_diagnostic_with_a_level_not_in_the_protocol_is_refused_naming_level() -> None:
    hub = EventHub()
    subscriber = hub.subscribe()
    out = Outbox(hub)
    with pytest.raises(ValidationError, match="level"):
        out.diagnostic("critical", "boom", task_id="T")
    assert out.events == []
    with pytest.raises(trio.WouldBlock):
        subscriber.receive_nowait()


def test_a_diagnostic_reaches_reply_and_subscribers_as_one_validated_event() -> None:
    hub = EventHub()
    subscriber = hub.subscribe()
    out = Outbox(hub)
    out.diagnostic("warning", "fan_out_matched_nobody", task_id="T", step_id="s", role="r")
    expected = Diagnostic(
        level="warning", code="fan_out_matched_nobody", fields={"task_id": "T", "step_id": "s", "role": "r"}
    )
    assert_same(out.events[0], expected)
    assert subscriber.receive_nowait() is out.events[0]


class _Watcher:
    watches = frozenset({"run_queued", "diagnostic"})

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.hub: EventHub | None = None

    def on_publish(self, event: Any) -> None:
        assert self.hub is not None
        self.seen.append((event.type, self.hub.count))


@given(produced=events)
def test_emit_all_publishes_as_emitting_each_in_turn(produced: list[Any]) -> None:
    """An entry's events published in one call reach the reply, the window, the watchers (before each is
    in the window) and a subscriber exactly as one `emit` each would."""
    seen = []
    for batch in (True, False):
        watcher = _Watcher()
        hub = watcher.hub = EventHub(watcher, size=4)
        subscriber = hub.subscribe()
        out = Outbox(hub)
        out.note(produced[0]) if produced else None  # a reply's own detail stays first
        if batch:
            out.emit_all(list(produced))
        else:
            for event in produced:
                out.emit(event)
        streamed = []
        while True:
            try:
                streamed.append(subscriber.receive_nowait())
            except trio.WouldBlock:
                break
        window = hub.read(hub.oldest - 1, hub.count)
        seen.append(
            (out.events, streamed, [(item.seq, item.event) for item in window], watcher.seen, hub.count)
        )
    assert seen[0] == seen[1]


def test_emit_counts_exactly_the_events_count_event_counts() -> None:
    """The emitter skips `count_event` for types outside COUNTED_EVENTS: each event type the hot path emits
    counts exactly when its type is in that set, and the set is the types `count_event` knows."""
    reader = InMemoryMetricReader()
    probe = MeterProvider(metric_readers=[reader]).get_meter("test").create_counter("probe")
    original = metrics.STEP_ENTRIES, metrics.RUNS, metrics.RUN_CHANGES
    metrics.STEP_ENTRIES = metrics.RUNS = metrics.RUN_CHANGES = probe
    samples: list[Any] = [
        trusted.decisions_cleared(task_id="T", step_id="s", deleted=0),
        trusted.action_outcome(
            task_id="T", step_id="s", trigger="on_enter", position=0, kind="k", outcome="done", detail=""
        ),
        trusted.diagnostic(level="info", code="c", fields={}),
        TaskCreated(task_id="T", workflow_id="w", step_id="s"),
        trusted.run_queued(
            run_id=1, task_id="T", step_id="s", agent_profile_id="a", reason="r", idempotency_key=None
        ),
        StepEntered(task_id="T", step_id="s", entry_seq=1, entry_path="E2"),
        RunLeaseExpired(run_id=1, task_id="T", agent_profile_id="a", attempt=1),
        RunCancelled(run_id=1, task_id="T", agent_profile_id="a", attempt=1, reason="entry_left"),
    ]
    try:
        for count, event in enumerate(samples):
            metrics.count_event(event)
            data = reader.get_metrics_data()
            total = sum(
                point.value
                for resource in (data.resource_metrics if data else [])
                for scope in resource.scope_metrics
                for metric in scope.metrics
                for point in metric.data.data_points  # type: ignore[union-attr]
            )
            assert total == sum(e.type in metrics.COUNTED_EVENTS for e in samples[: count + 1]), event.type
    finally:
        metrics.STEP_ENTRIES, metrics.RUNS, metrics.RUN_CHANGES = original
    changes = {"run_claimed", "run_finished", "run_retry_scheduled", "run_failed", "run_cancelled"}
    assert {  # a step entry is counted where it is admitted (`metrics.count_entry`: it names the workflow)
        "run_queued",
        "run_coalesced",
        "run_suppressed",
        "run_lease_expired",
    } | changes == (metrics.COUNTED_EVENTS)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("host_level", [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR])
def test_a_log_below_the_hosts_level_is_dropped_before_it_is_built(host_level: int) -> None:
    """Without structlog configured each level reaches `logging` exactly when the logger is enabled for it
    (as `filter_by_level` decided before), with its fields as discrete attributes; `logging.disable` too."""
    name = f"onceflow.test_trusted.{host_level}"
    handler = _Records()
    std = logging.getLogger(name)
    std.addHandler(handler)
    std.setLevel(host_level)
    log = get_logger(name)
    try:
        log.debug("d", task_id="T")
        log.info("i", task_id="T")
        log.warning("w", task_id="T")
        log.error("e", task_id="T")
        expected = [n for n, level in zip("diwe", (10, 20, 30, 40), strict=True) if level >= host_level]
        assert [r.event for r in handler.records] == expected  # type: ignore[attr-defined]
        assert all(getattr(r, "task_id", None) == "T" for r in handler.records)
        logging.disable(logging.CRITICAL)
        log.error("dropped", task_id="T")
        assert len(handler.records) == len(expected)
    finally:
        logging.disable(logging.NOTSET)
        std.removeHandler(handler)
