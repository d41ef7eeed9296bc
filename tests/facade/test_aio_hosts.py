"""`onceflow.aio` with hosts and coordinators written for asyncio (onceflow/aio/hosts.py): their coroutine
methods run on the caller's asyncio loop, raise into diagnostics that carry the exception, and are cancelled
when the runtime gives up on them.

Each test is a plain function running its own `asyncio.run` (pytest-trio's trio_mode takes async tests);
every host here really awaits asyncio (sleeps, queues, events), which fails on the runtime's Trio thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

import onceflow.aio
from onceflow.aio.hosts import HOST_METHODS, AsyncioCalls
from onceflow.protocol.coordinator import AcknowledgeRequest, DeliveryRequest, RetryPolicy
from onceflow.protocol.events import Diagnostic, Reply
from onceflow.protocol.host import BaseHost, SessionActionRequest
from onceflow.protocol.outcome import derive_outcome_id

T = TypeVar("T")

OFFICE = resources.files("onceflow") / "examples" / "office-example.yml"
WAIT = 10.0  # seconds of real time any single wait may take before the test fails instead of hanging

REVIEWED = """
id: reviewed
name: Reviewed
steps:
  - id: todo
    name: Todo
    position: 0
  - id: review
    name: Review
    position: 1
    is_start_step: true
    events:
      on_enter:
        - type: run_code_review
          config: {agent_profile_id: reviewer-bot}
        - type: auto_start_agent
"""


async def fake_model(prompt: str) -> str:
    """An HTTP-less stand-in for a model call: takes a while on the asyncio loop, then answers."""
    await asyncio.sleep(0.005)
    return "approved" if prompt else "rejected"


class AgentHost(BaseHost):
    """An asyncio host: each session action waits for a permit the test puts on `permits`, and a started
    agent is handed to the test's agent loop through `started`; preflight asks the fake model."""

    def __init__(self) -> None:
        self.permits: asyncio.Queue[str] = asyncio.Queue()
        self.started: asyncio.Queue[str] = asyncio.Queue()
        self.performed: list[tuple[str, str, str]] = []
        self.preflights: list[tuple[str, str]] = []
        self.reviews: list[tuple[str, str, str | None]] = []
        self.threads: set[int] = set()
        self.loops: set[asyncio.AbstractEventLoop] = set()

    def _seen(self) -> None:
        self.threads.add(threading.get_ident())
        self.loops.add(asyncio.get_running_loop())

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        self._seen()
        permit = await self.permits.get()
        self.performed.append((request.task_id, request.action, permit))
        if request.action == "auto_start_agent":
            self.started.put_nowait(request.task_id)

    async def start_code_review(
        self, *, task_id: str, step_id: str, entry_seq: int, review_run_id: int, agent_profile_id: str | None
    ) -> None:
        self._seen()
        await asyncio.sleep(0.001)
        self.reviews.append((task_id, step_id, agent_profile_id))

    async def preflight_transition(self, *, task_id: str, from_step: str, to_step: str) -> None:
        self._seen()
        if await fake_model(f"may {task_id} go to {to_step}?") != "approved":
            raise PermissionError(to_step)
        self.preflights.append((from_step, to_step))


async def _ok(rt: onceflow.aio.AsyncioRuntime, message: dict[str, Any]) -> Reply:
    reply = await asyncio.wait_for(rt.send(message), WAIT)
    assert reply.ok, reply.error
    return reply


def _diagnostics(reply: Reply, code: str) -> list[Diagnostic]:
    return [e for e in reply.events if isinstance(e, Diagnostic) and e.code == code]


async def _office(rt: onceflow.aio.AsyncioRuntime) -> None:
    await _ok(rt, {"type": "register_workflow", "yaml": OFFICE.read_text(), "source": OFFICE.name})
    for step, role, agent in (
        ("review", "reviewer", "reviewer-1"),
        ("review", "reviewer", "reviewer-2"),
        ("approval", "approver", "approver-1"),
    ):
        seat = {"workflow_id": "office-example", "step_id": step, "role": role, "agent_profile_id": agent}
        await _ok(rt, {"type": "add_participant", **seat})
    await _ok(
        rt,
        {
            "type": "create_task",
            "task_id": "T1",
            "workflow_id": "office-example",
            "step_id": "backlog",
            "session_id": "S1",
            "primary_agent_id": "worker",
        },
    )


async def _decide(rt: onceflow.aio.AsyncioRuntime, step: str, role: str, agent: str) -> Reply:
    verdict = await fake_model(f"{agent}: is T1 good?")
    decision = {"decider_type": "agent", "decider_id": agent, "role": role, "decision": verdict}
    return await _ok(rt, {"type": "record_decision", "task_id": "T1", "step_id": step, **decision})


def test_an_asyncio_host_drives_the_office_flow_to_done_under_asyncio_run(tmp_path: Path) -> None:
    host = AgentHost()

    async def main() -> None:
        async with onceflow.aio.open_runtime(tmp_path / "b.db", host=host) as rt:
            await _office(rt)
            moving = rt.send({"type": "move_task", "task_id": "T1", "step_id": "work"})
            await asyncio.sleep(0.05)
            assert not moving.done()  # the move waits on the host, which waits on the test's queue
            await host.permits.put("go")
            moved = await asyncio.wait_for(moving, WAIT)
            assert [e.type for e in moved.events if e.type == "session_action"] == ["session_action"]

            task = await asyncio.wait_for(host.started.get(), WAIT)  # the agent loop: work, then report
            assert await fake_model(f"work on {task}") == "approved"
            await _ok(rt, {"type": "turn_complete", "task_id": task})
            runs = (await _ok(rt, {"type": "list_runs", "task_id": "T1"})).result["runs"]
            reviewers = sorted(r["agent_profile_id"] for r in runs if r["reason"] == "review_started")
            assert reviewers == ["reviewer-1", "reviewer-2"]
            for reviewer in reviewers:
                last = await _decide(rt, "review", "reviewer", reviewer)
            assert last.result["moved_to"] == "approval"
            done = await _decide(rt, "approval", "approver", "approver-1")
            assert done.result["moved_to"] == "done"
            assert (await _ok(rt, {"type": "get_task", "task_id": "T1"})).result["step_id"] == "done"
            assert host.loops == {asyncio.get_running_loop()}

    asyncio.run(main())
    assert host.threads == {threading.get_ident()}  # every host call ran on this (the asyncio) thread
    assert host.performed == [("T1", "auto_start_agent", "go")]
    assert host.preflights == [
        ("backlog", "work"),
        ("work", "review"),
        ("review", "approval"),
        ("approval", "done"),
    ]


class BrokenHost(BaseHost):
    """An asyncio host whose model endpoint refuses every session action and every review start."""

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        await asyncio.sleep(0.001)
        raise ConnectionError(f"model endpoint refused {request.action}")

    async def start_code_review(
        self, *, task_id: str, step_id: str, entry_seq: int, review_run_id: int, agent_profile_id: str | None
    ) -> None:
        await asyncio.sleep(0.001)
        raise TimeoutError(f"review backend timed out for {agent_profile_id}")


def test_a_raising_asyncio_host_shows_its_exception_type_and_message_in_the_diagnostic(
    tmp_path: Path,
) -> None:
    async def main() -> Reply:
        async with onceflow.aio.open_runtime(tmp_path / "b.db", host=BrokenHost()) as rt:
            register = {"type": "register_workflow", "yaml": REVIEWED, "source": "r.yml", "import_path": True}
            await _ok(rt, register)
            create = {"type": "create_task", "task_id": "T1", "workflow_id": "reviewed", "step_id": "todo"}
            await _ok(rt, {**create, "session_id": "S1"})
            return await _ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})

    moved = asyncio.run(main())
    [failed] = _diagnostics(moved, "session_action_failed")
    assert failed.level == "error"
    assert (failed.fields["action"], failed.fields["error_type"], failed.fields["error"]) == (
        "auto_start_agent",
        "ConnectionError",
        "model endpoint refused auto_start_agent",
    )
    assert failed.fields["cause"] == repr(ConnectionError("model endpoint refused auto_start_agent"))
    [review] = _diagnostics(moved, "code_review_start_failed")
    assert (review.fields["error_type"], review.fields["error"]) == (
        "TimeoutError",
        "review backend timed out for reviewer-bot",
    )


class HangingHost(BaseHost):
    """An asyncio host whose session action waits for a reply that never comes."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.never = asyncio.Event()

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        self.entered.set()
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def _run_bounded(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`asyncio.run(main())` on a daemon thread, failing after 3 * WAIT seconds instead of hanging the
    suite when a shutdown waits on host code (leaving `open_runtime` cannot itself be cancelled)."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(asyncio.run(main()))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(3 * WAIT)
    assert not thread.is_alive(), "the runtime did not close: it waits on a host call"
    if errors:
        raise errors[0]
    return results[0]


def test_leaving_cancels_a_pending_asyncio_host_call_and_closes_promptly(tmp_path: Path) -> None:
    host = HangingHost()

    async def main() -> tuple[asyncio.Future[Reply], float]:
        async with onceflow.aio.open_runtime(tmp_path / "b.db", host=host) as rt:
            await _office(rt)
            moving = rt.send({"type": "move_task", "task_id": "T1", "step_id": "work"})
            await asyncio.wait_for(host.entered.wait(), WAIT)
            leaving = time.monotonic()
        closed = time.monotonic() - leaving
        await asyncio.wait_for(host.cancelled.wait(), WAIT)  # the asyncio side saw CancelledError
        return moving, closed

    moving, closed = _run_bounded(main)
    assert closed < 5.0
    moved = moving.result()  # the command drained: the transition stands, the host call is reported
    assert moved.ok, moved.error
    [failed] = _diagnostics(moved, "session_action_failed")
    assert (failed.fields["action"], failed.fields["error_type"]) == (
        "auto_start_agent",
        onceflow.aio.HostCallCancelledError.__name__,
    )
    assert "shutting down" in failed.fields["error"]


def _envelope() -> dict[str, Any]:
    data: dict[str, Any] = {
        "contract_version": 1,
        "producer": "direct-worker",
        "store_ref": "city:gascity",
        "work_id": "gc-1234",
        "source_root_id": "gc-1000",
        "step_key": "implement",
        "summary": "Implemented the parser.",
        "impact": "Commands are parsed strictly.",
        "state": "terminal",
        "evidence": [{"kind": "commit", "uri": "git:repo@abc123", "sha256": "0123456789abcdef" * 4}],
        "fence": {"producer_id": "worker-7", "generation": 3, "token": "tok-9"},
        "occurred_at": "2023-11-14T22:13:20.5Z",
    }
    fields = {key: data[key] for key in ("producer", "store_ref", "work_id", "state", "fence")}
    return {"outcome_id": derive_outcome_id(**fields), **data}


class AsyncCoordinator:
    """An asyncio coordinator: the first `hanging` delivery attempts wait forever (and note their
    cancellation), later ones return a receipt; every call is handed to the test through a queue."""

    def __init__(self, hanging: int = 0) -> None:
        self.hanging = hanging
        self.deliveries: asyncio.Queue[DeliveryRequest] = asyncio.Queue()
        self.acks: asyncio.Queue[AcknowledgeRequest] = asyncio.Queue()
        self.cancelled: list[int] = []

    async def deliver(self, request: DeliveryRequest) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        if request.attempt <= self.hanging:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.attempt)
                raise
        self.deliveries.put_nowait(request)
        return {"delivery_ref": f"bead:hq-mail-{request.attempt}", "coordinator_fence": "coord-1"}

    async def acknowledge(self, request: AcknowledgeRequest) -> None:
        await asyncio.sleep(0.001)
        self.acks.put_nowait(request)


def test_an_asyncio_coordinator_receives_outcomes_and_their_acknowledgements(tmp_path: Path) -> None:
    coordinator = AsyncCoordinator()
    env = _envelope()

    async def main() -> tuple[DeliveryRequest, AcknowledgeRequest, str]:
        async with onceflow.aio.open_runtime(tmp_path / "b.db", coordinator=coordinator) as rt:
            await _ok(rt, {"type": "outcome_ready", "envelope": env})
            delivered = await asyncio.wait_for(coordinator.deliveries.get(), WAIT)
            ack = {
                "store_ref": env["store_ref"],
                "outcome_id": env["outcome_id"],
                "work_id": env["work_id"],
                "coordinator_fence": "coord-1",
                "acknowledged_by": "mayor",
            }
            await _ok(rt, {"type": "coordinator_ack", **ack})
            acknowledged = await asyncio.wait_for(coordinator.acks.get(), WAIT)
            for _ in range(100):  # the phase is written just after the acknowledgement returned
                state = await _ok(rt, {"type": "get_outcome", "outcome_id": env["outcome_id"]})
                if state.result["phase"] == "acknowledged":
                    break
                await asyncio.sleep(0.02)
            return delivered, acknowledged, state.result["phase"]

    delivered, acknowledged, phase = asyncio.run(main())
    assert delivered.envelope.outcome_id == env["outcome_id"]
    assert delivered.cycle_id == f"deliver/{env['outcome_id']}/cycle-000001"
    assert acknowledged.acknowledgement.acknowledged_by == "mayor"
    assert phase == "acknowledged"


def test_a_timed_out_coordinator_attempt_cancels_its_asyncio_task(tmp_path: Path) -> None:
    coordinator = AsyncCoordinator(hanging=1)
    policy = RetryPolicy(initial_interval=0.01, attempt_timeout=0.2)

    async def main() -> DeliveryRequest:
        async with onceflow.aio.open_runtime(
            tmp_path / "b.db", coordinator=coordinator, retry_policy=policy
        ) as rt:
            await _ok(rt, {"type": "outcome_ready", "envelope": _envelope()})
            return await asyncio.wait_for(coordinator.deliveries.get(), WAIT)

    delivered = asyncio.run(main())
    assert coordinator.cancelled == [1]  # the first attempt's asyncio task saw CancelledError
    assert delivered.attempt == 2


class MixedHost(BaseHost):
    """A host with a plain (non-async) method that returns a Trio awaitable: called on the Trio thread."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def perform_session_action(self, request: SessionActionRequest) -> Any:  # type: ignore[override]
        self.threads.append(threading.current_thread().name)
        return trio.lowlevel.checkpoint()


def test_non_coroutine_and_inherited_methods_stay_on_the_trio_thread(tmp_path: Path) -> None:
    host = MixedHost()

    async def main() -> Reply:
        calls = AsyncioCalls(asyncio.get_running_loop())
        plain = BaseHost()
        assert calls.adapt(plain, HOST_METHODS) is plain  # nothing of BaseHost's own crosses
        assert calls.adapt(host, HOST_METHODS) is host
        async with onceflow.aio.open_runtime(tmp_path / "b.db", host=host) as rt:
            await _office(rt)
            return await _ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})

    moved = asyncio.run(main())
    assert _diagnostics(moved, "session_action_failed") == []
    assert host.threads == ["onceflow-trio"]


def test_host_loop_is_checked_before_anything_opens(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="host_loop"):
            async with onceflow.aio.open_runtime(tmp_path / "b.db", host_loop="curio"):  # type: ignore[arg-type]
                pass

    asyncio.run(main())
    assert not (tmp_path / "b.db").exists()
