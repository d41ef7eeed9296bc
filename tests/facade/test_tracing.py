"""Traces through OpenTelemetry's API, read by the SDK's in-memory exporter: span names, parentage (the
host's span -> the command's -> the entry's -> its actions' and host calls'), attributes; the W3C
`traceparent` a command carries over `onceflow serve`; the asyncio bridge's parentage; nothing without a
recording provider."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import gascity_envelope, ok, register
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, StatusCode
from wire_client import WireClient

import onceflow.aio
from onceflow import serve
from onceflow.actors.runtime.startup import open_runtime
from onceflow.observability.tracing import Tracing
from onceflow.protocol.coordinator import RetryPolicy
from onceflow.testing import RecordingCoordinator, RecordingHost

TRACED = """
id: traced
name: Traced
steps:
  - {id: backlog, name: Backlog, position: 0, is_start_step: true, allow_manual_move: true}
  - id: work
    name: Work
    position: 1
    allow_manual_move: true
    events:
      on_enter:
        - {type: reset_agent_context}
        - {type: queue_run, config: {target: primary, reason: work}}
        - {type: run_code_review}
      on_comment:
        - {type: queue_run, config: {target: primary, reason: comment}}
  - {id: done, name: Done, position: 2, allow_manual_move: true}
"""

ENVELOPE: dict[str, Any] = gascity_envelope(work_id="gc-1")
"""A valid Gas City outcome envelope."""

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


class PreflightHost(RecordingHost):
    """A RecordingHost whose preflight is its own (so the runtime calls it)."""

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        await trio.lowlevel.checkpoint()


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """A provider of the test's own, passed to `open_runtime` (the global one is left alone)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def setup(rt: Any) -> None:
    await register(rt, TRACED, import_path=True)
    await ok(rt, {"type": "create_task", "task_id": "T1", "workflow_id": "traced", "session_id": "s-1",
                  "primary_agent_id": "worker"})  # fmt: skip


async def test_a_move_is_a_command_span_under_the_hosts_span_with_its_entry_actions_and_host_calls(
    db_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    host_tracer = provider.get_tracer("the-host")
    async with open_runtime(db_path, host=PreflightHost(), tracer_provider=provider) as rt:
        await setup(rt)
        exporter.clear()
        with host_tracer.start_as_current_span("host.handle_request") as host_span:
            await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    spans = exporter.get_finished_spans()
    command = one(spans, "onceflow.command move_task")
    entry = one(spans, "onceflow.entry")
    preflight = one(spans, "onceflow.host preflight_transition")
    session = one(spans, "onceflow.host perform_session_action")
    queued = one(spans, "onceflow.action queue_run")
    review = one(spans, "onceflow.action run_code_review")
    start_review = one(spans, "onceflow.host start_code_review")

    host_id = host_span.get_span_context().span_id
    assert parent_of(command) == host_id
    assert {span.context.trace_id for span in spans} == {host_span.get_span_context().trace_id}
    assert parent_of(entry) == command.context.span_id
    for child in (preflight, session, queued, review):
        assert parent_of(child) == entry.context.span_id, child.name
    assert parent_of(start_review) == review.context.span_id

    assert command.attributes is not None and entry.attributes is not None
    assert command.attributes["onceflow.command"] == "move_task"
    assert command.attributes["onceflow.task_id"] == "T1"
    assert command.attributes["onceflow.step_id"] == "work"
    assert command.status.status_code == StatusCode.UNSET
    assert dict(entry.attributes) == {
        "onceflow.task_id": "T1",
        "onceflow.workflow_id": "traced",
        "onceflow.step_id": "work",
        "onceflow.entry_path": "E2",
        "onceflow.trigger": "move_task",
        "onceflow.entry.result": "admitted",
        "onceflow.entry_seq": 1,
    }
    for child in (session, queued, review, start_review):
        assert child.attributes is not None
        assert child.attributes["onceflow.entry_seq"] == 1, child.name
        assert child.attributes["onceflow.entry_path"] == "E2", child.name
        assert child.attributes["onceflow.task_id"] == "T1", child.name
    assert queued.attributes is not None and review.attributes is not None
    assert queued.attributes["onceflow.action.outcome"] == "done"
    assert queued.attributes["onceflow.action.position"] == 1
    assert review.attributes["onceflow.action.outcome"] == "done"
    assert session.attributes is not None
    assert session.attributes["onceflow.action.type"] == "reset_agent_context"
    # the children nest inside their parents in time
    assert command.start_time is not None and command.end_time is not None
    assert entry.start_time is not None and entry.end_time is not None
    assert command.start_time <= entry.start_time <= entry.end_time <= command.end_time


async def test_a_trigger_action_and_a_refusal(
    db_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async with open_runtime(db_path, host=RecordingHost(), tracer_provider=provider) as rt:
        await setup(rt)
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
        exporter.clear()
        await ok(rt, {"type": "task_comment", "task_id": "T1", "comment_id": "c-1"})
        refused = await rt.send({"type": "move_task", "task_id": "nobody", "step_id": "work"})
    assert not refused.ok
    spans = exporter.get_finished_spans()
    comment = one(spans, "onceflow.command task_comment")
    action = one(spans, "onceflow.action queue_run")
    assert parent_of(action) == comment.context.span_id
    assert action.attributes is not None
    assert action.attributes["onceflow.trigger"] == "on_comment"
    assert action.attributes["onceflow.operation_id"] == "task_comment:c-1"
    assert action.attributes["onceflow.step_id"] == "work"
    failed = one(spans, "onceflow.command move_task")
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes is not None and failed.attributes["onceflow.error.code"] == "not_found"
    assert parent_of(failed) is None  # no span was current: a new trace


async def test_a_host_call_that_raises_is_recorded_on_its_span(
    db_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    class FailingHost(RecordingHost):
        async def perform_session_action(self, request: Any) -> None:
            raise RuntimeError("session backend down")

    async with open_runtime(db_path, host=FailingHost(), tracer_provider=provider) as rt:
        await setup(rt)
        reply = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    assert any(e.type == "diagnostic" and e.code == "session_action_failed" for e in reply.events)
    spans = exporter.get_finished_spans()
    failed = one(spans, "onceflow.host perform_session_action")
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.status.description == "RuntimeError: session backend down"
    assert [event.name for event in failed.events] == ["exception"]
    entry = one(spans, "onceflow.entry")
    assert entry.status.status_code == StatusCode.UNSET  # the entry stands (AC-C4)
    assert parent_of(failed) == entry.context.span_id


async def test_a_command_queued_behind_a_busy_actor_keeps_its_senders_span(
    db_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The second command waits in the task actor's mailbox and runs on the actor's task: its entry is
    still its own command's child, not the first command's."""
    gate = trio.Event()

    class SlowHost(RecordingHost):
        async def perform_session_action(self, request: Any) -> None:
            await gate.wait()
            await super().perform_session_action(request)

    tracer = provider.get_tracer("the-host")
    async with open_runtime(db_path, host=SlowHost(), tracer_provider=provider) as rt:
        await setup(rt)
        exporter.clear()

        async def send_under(name: str, message: dict[str, Any], ids: dict[str, int]) -> None:
            with tracer.start_as_current_span(name) as span:
                ids[name] = span.get_span_context().span_id
                await ok(rt, message)

        ids: dict[str, int] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                send_under, "first", {"type": "move_task", "task_id": "T1", "step_id": "work"}, ids
            )
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(
                send_under, "second", {"type": "move_task", "task_id": "T1", "step_id": "done"}, ids
            )
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    spans = exporter.get_finished_spans()
    first, second = named(spans, "onceflow.command move_task")
    assert (parent_of(first), parent_of(second)) == (ids["first"], ids["second"])
    into_work, into_done = named(spans, "onceflow.entry")
    assert parent_of(into_work) == first.context.span_id
    assert parent_of(into_done) == second.context.span_id  # not the first's: the actor's task ran it
    assert into_done.attributes is not None and into_done.attributes["onceflow.step_id"] == "done"


WIP = """
id: wip
name: WIP
steps:
  - {id: backlog, name: Backlog, position: 0, is_start_step: true, allow_manual_move: true}
  - {id: narrow, name: Narrow, position: 1, wip_limit: 1, allow_manual_move: true}
  - {id: done, name: Done, position: 2, allow_manual_move: true}
"""


async def test_a_promoted_entry_is_traced_under_the_entry_that_freed_the_slot(
    db_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async with open_runtime(db_path, tracer_provider=provider) as rt:
        await register(rt, WIP)
        for task in ("T1", "T2"):
            await ok(rt, {"type": "create_task", "task_id": task, "workflow_id": "wip"})
            await ok(rt, {"type": "move_task", "task_id": task, "step_id": "narrow"})  # T2 is queued
        exporter.clear()
        await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "done"})
        await trio.testing.wait_all_tasks_blocked()  # T2's promoted entry is dispatched on a task of its own
    spans = exporter.get_finished_spans()
    command = one(spans, "onceflow.command move_task")
    entries = {
        span.attributes["onceflow.entry_path"]: span
        for span in named(spans, "onceflow.entry")
        if span.attributes
    }
    assert set(entries) == {"E2", "E3"}
    assert entries["E3"].attributes is not None and entries["E3"].attributes["onceflow.task_id"] == "T2"
    assert parent_of(entries["E2"]) == command.context.span_id
    assert parent_of(entries["E3"]) == entries["E2"].context.span_id  # T1's entry freed the slot


async def test_coordinator_delivery_and_ack_attempts_are_spans_under_outcome_ready(
    db_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    coordinator = RecordingCoordinator(failing_deliveries=1)
    policy = RetryPolicy(initial_interval=0.01)
    async with open_runtime(
        db_path, coordinator=coordinator, retry_policy=policy, tracer_provider=provider
    ) as rt:
        await ok(rt, {"type": "outcome_ready", "envelope": ENVELOPE})
        with trio.fail_after(20):
            await coordinator.until(lambda: len(coordinator.deliveries) == 2)
        ack = {key: ENVELOPE[key] for key in ("store_ref", "outcome_id", "work_id")}
        ack |= {"coordinator_fence": coordinator.fence, "acknowledged_by": "mayor"}
        await ok(rt, {"type": "coordinator_ack", **ack})
        with trio.fail_after(20):
            await coordinator.until(lambda: bool(coordinator.acks))
        await trio.testing.wait_all_tasks_blocked()
    spans = exporter.get_finished_spans()
    ready = one(spans, "onceflow.command outcome_ready")
    delivers = named(spans, "onceflow.coordinator deliver")
    assert [span.attributes["onceflow.attempt"] for span in delivers if span.attributes] == [1, 2]
    assert delivers[0].status.status_code == StatusCode.ERROR  # the failing attempt
    acknowledge = one(spans, "onceflow.coordinator acknowledge")
    for span in (*delivers, acknowledge):
        assert parent_of(span) == ready.context.span_id
        assert span.attributes is not None
        assert span.attributes["onceflow.outcome_id"] == ENVELOPE["outcome_id"]
    assert ready.attributes is not None and ready.attributes["onceflow.outcome_id"] == ENVELOPE["outcome_id"]


async def test_traceparent_over_a_serve_socket_is_the_command_spans_parent(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    socket_path = tmp_path / "s.sock"

    def talk() -> tuple[dict[str, Any], dict[str, Any]]:
        client = WireClient(str(socket_path))
        try:
            good = client.request(
                {"id": 1, "type": "list_tasks", "traceparent": TRACEPARENT, "tracestate": "k=v"}
            )
            return good, client.request({"id": 2, "type": "list_tasks", "traceparent": "not-a-traceparent"})
        finally:
            client.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(
                serve.serve, tmp_path / "db.sqlite", [], socket_path=socket_path, switch_interval=None,
                tracer_provider=provider,
            )
        )  # fmt: skip
        with trio.fail_after(20):
            while not socket_path.exists():
                await trio.sleep(0.01)
        good, bad = await trio.to_thread.run_sync(talk)
        nursery.cancel_scope.cancel()
    assert good["reply"]["ok"], good
    assert not bad["reply"]["ok"] and bad["reply"]["error"]["field"] == "traceparent"
    command = one(exporter.get_finished_spans(), "onceflow.command list_tasks")
    assert f"{command.context.trace_id:032x}" == TRACE_ID
    assert command.parent is not None and f"{command.parent.span_id:016x}" == PARENT_SPAN
    assert command.parent.is_remote
    assert command.context.trace_state.get("k") == "v"  # the tracestate came along


def test_the_asyncio_bridge_carries_the_callers_span(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    tracer = provider.get_tracer("the-host")

    async def main() -> int:
        async with onceflow.aio.open_runtime(tmp_path / "db.sqlite", tracer_provider=provider) as rt:
            with tracer.start_as_current_span("asyncio.handler") as span:
                reply = await rt.send({"type": "list_tasks"})
            assert reply.ok
            return span.get_span_context().span_id

    host_span = asyncio.run(main())
    assert parent_of(one(exporter.get_finished_spans(), "onceflow.command list_tasks")) == host_span


async def test_without_a_recording_provider_nothing_is_built(db_path: Path) -> None:
    """No SDK (the global proxy) or a no-op provider: `tracer()` is None, the fast path."""
    assert Tracing(NoOpTracerProvider()).tracer() is None
    assert Tracing(TracerProvider()).tracer() is not None
    if os.environ.get("OTEL_PYTHON_TRACER_PROVIDER") is None:  # the suite never sets a global provider
        assert Tracing().tracer() is None
    async with open_runtime(db_path, tracer_provider=NoOpTracerProvider()) as rt:
        assert rt.services.tracing.tracer() is None
        await setup(rt)
        reply = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
    assert json.loads(reply.model_dump_json())["ok"]
