"""The host role in process: `HostBroker` as the runtime's host and coordinator, answered by test host
links (what a serve connection is to the broker), on real Trio scheduling and a real database, timers on a
MockClock. The wire itself is tests/facade/test_serve_hosts.py's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import FIXTURES, FakeClock, gascity_envelope, ok, send

from onceflow.actors.runtime.host_broker import MAX_OFFERS, HostBroker, RegisteredHost
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.errors import ConflictError, NotFoundError
from onceflow.protocol.events import Event, Reply
from onceflow.protocol.host_calls import HostReply, session_action_call_id
from onceflow.protocol.results import result_of

MINIMAL = (FIXTURES / "workflows" / "minimal.yml").read_text()
REVIEWED = """\
id: reviewed
name: Reviewed
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
  - id: review
    name: Review
    position: 1
    events:
      on_enter:
        - type: run_code_review
"""
TIMEOUT, WAIT = 30.0, 10.0


class Link:
    """A host connection as the broker sees it: the call lines offered, and whether it takes more."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.open = True
        self._offered = trio.lowlevel.ParkingLot()

    def offer(self, frame: bytes) -> bool:
        if not self.open:
            return False
        line = json.loads(frame)
        assert set(line) == {"call"} and frame.endswith(b"\n")
        self.calls.append(line["call"])
        self._offered.unpark_all()
        return True

    async def wait_for(self, count: int) -> list[dict[str, Any]]:
        """The calls offered, once there are `count` (a store round trip may come first: no clock here)."""
        while len(self.calls) < count:
            await self._offered.park()
        return self.calls


async def waiting(broker: HostBroker, call_id: str) -> None:
    """Return once the call `call_id` is pending (its dispatch may first wait on the store's thread)."""
    while not any(call["call_id"] == call_id for call in broker.pending()):
        await trio.sleep(0)


async def elapse(clock: trio.testing.MockClock, seconds: float) -> None:
    """Move the Trio clock by hand (the store's thread is real) and let every expired timer run."""
    await trio.testing.wait_all_tasks_blocked()
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()


@asynccontextmanager
async def brokered(db_path: Path) -> AsyncIterator[tuple[Runtime, HostBroker, list[Event]]]:
    """A runtime whose host is a broker (recording ended calls), the minimal fixture workflow registered,
    and every event a subscriber saw."""
    broker = HostBroker(host_timeout=TIMEOUT, host_wait=WAIT)
    async with open_runtime(db_path, host=broker, clock=FakeClock()) as rt:
        broker.on_coordinator = rt.attach_coordinator
        await ok(rt, {"type": "register_workflow", "yaml": MINIMAL})
        events: list[Event] = []

        async def watch(stream: trio.MemoryReceiveChannel[Event]) -> None:
            async for event in stream:
                events.append(event)

        async with trio.open_nursery() as watching:
            watching.start_soon(watch, rt.subscribe())
            async with trio.open_nursery() as recording:
                await recording.start(broker.record_forever, rt.services.store, rt.hub)
                try:
                    yield rt, broker, events
                finally:
                    broker.close()  # the recorder writes what ended, then returns
            watching.cancel_scope.cancel()


async def create(rt: Runtime, task_id: str = "T1", session: str | None = "s1") -> None:
    await ok(
        rt,
        {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": "fixture",
            "step_id": "todo",
            "session_id": session,
        },
    )


def answer(broker: HostBroker, host: RegisteredHost, call: dict[str, Any], **reply: Any) -> Any:
    return broker.answer(host, HostReply(call_id=call["call_id"], **({"ok": True} | reply)))


async def calls_recorded(rt: Runtime, **filters: Any) -> list[dict[str, Any]]:
    await trio.testing.wait_all_tasks_blocked()
    reply = await ok(rt, {"type": "list_host_calls", **filters})
    result_of(reply)  # every row has the documented shape (HostCallPage)
    calls: list[dict[str, Any]] = reply.result["calls"]
    return calls


async def test_before_any_host_registers_calls_get_the_default_answers(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, _, _):
        await create(rt)
        moved = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
        actions = [e.action for e in moved.events if e.type == "session_action"]  # type: ignore[union-attr]
        assert actions == ["set_session_mode", "auto_start_agent"]  # reported performed, as BaseHost does
        assert await calls_recorded(rt) == []


async def test_session_actions_go_to_the_host_in_declared_order_each_awaited(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """AC-A9: the second action is offered only once the first was answered; the reply shows both."""
    async with brokered(db_path) as (rt, broker, _):
        link = Link()
        host = broker.register(["session_action"], link)
        await create(rt)
        replies: list[Reply] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _append, replies, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"}
            )
            [first] = await link.wait_for(1)
            assert first["kind"] == "session_action"
            assert (
                first["call_id"]
                == session_action_call_id("T1", 1, "on_enter", 0)
                == "session_action/T1/1/on_enter/0"
            )
            assert first["request"]["action"] == "set_session_mode" and first["request"]["session_id"] == "s1"
            assert first["deadline"].endswith("Z")
            await trio.testing.wait_all_tasks_blocked()
            assert len(link.calls) == 1  # the next action waits for this one's answer
            assert answer(broker, host, first) == {"call_id": first["call_id"], "status": "answered"}
            second = (await link.wait_for(2))[1]
            assert second["call_id"] == "session_action/T1/1/on_enter/1"
            answer(broker, host, second)
        [reply] = replies
        assert reply.ok and [e.type for e in reply.events].count("session_action") == 2
        recorded = await calls_recorded(rt, task_id="T1")
        assert [(c["call_id"], c["status"], c["attempts"], c["host_id"]) for c in recorded] == [
            ("session_action/T1/1/on_enter/0", "answered", 1, "host-1"),
            ("session_action/T1/1/on_enter/1", "answered", 1, "host-1"),
        ]


async def _append(replies: list[Reply], rt: Runtime, command: dict[str, Any]) -> None:
    replies.append(await send(rt, command))


async def test_a_call_whose_host_goes_away_is_offered_to_the_next_host_under_the_same_id(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        first_link, second_link = Link(), Link()
        first = broker.register(["session_action"], first_link)
        await create(rt)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
            [held] = await first_link.wait_for(1)
            broker.unregister(first)  # its connection closed mid-call
            await elapse(mock_clock, WAIT / 2)  # waiting for a host, not yet unavailable
            assert broker.pending()[0]["attempts"] == 1
            second = broker.register(["session_action"], second_link)
            [again] = await second_link.wait_for(1)
            assert again["call_id"] == held["call_id"] and again["request"] == held["request"]
            with pytest.raises(ConflictError):  # the departed host's late answer changes nothing
                answer(broker, first, held)
            answer(broker, second, again)
            answer(broker, second, (await second_link.wait_for(2))[1])
        recorded = await calls_recorded(rt)
        assert [(c["attempts"], c["host_id"], c["status"]) for c in recorded] == [
            (2, "host-2", "answered"),
            (1, "host-2", "answered"),
        ]


async def test_with_no_host_connected_a_call_ends_host_unavailable_after_the_host_wait(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The spec's "reaches no executor": an event, a record, the task's history, and the dispatch goes on."""
    async with brokered(db_path) as (rt, broker, events):
        gone = broker.register(["session_action"], Link())
        broker.unregister(gone)  # registered once, so calls now wait for a host
        await create(rt)
        replies: list[Reply] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _append, replies, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"}
            )
            await waiting(broker, "session_action/T1/1/on_enter/0")
            await elapse(mock_clock, WAIT - 0.5)
            assert replies == [] and [c["status"] for c in await calls_recorded(rt)] == ["pending"]
            await elapse(mock_clock, 0.5)  # the first call gives up; the second waits its own host_wait
            await waiting(broker, "session_action/T1/1/on_enter/1")
            await elapse(mock_clock, WAIT)
        [reply] = replies
        assert reply.ok  # the move committed; its session actions reached no executor
        failures = [e for e in reply.events if e.type == "diagnostic" and e.code == "session_action_failed"]  # type: ignore[union-attr]
        assert [f.fields["error_type"] for f in failures] == ["HostUnavailableError"] * 2  # type: ignore[union-attr]
        unanswered = [e for e in events if e.type == "host_call_unanswered"]
        assert [(e.call_id, e.status, e.attempts) for e in unanswered] == [  # type: ignore[union-attr]
            ("session_action/T1/1/on_enter/0", "host_unavailable", 0),
            ("session_action/T1/1/on_enter/1", "host_unavailable", 0),
        ]
        recorded = await calls_recorded(rt, status="host_unavailable")
        assert len(recorded) == 2 and recorded[0]["error"]["retryable"] is True
        assert recorded[0]["latency_seconds"] == pytest.approx(WAIT)
        history = await ok(rt, {"type": "task_history", "task_id": "T1"})
        result_of(history)
        calls = [i["detail"] for i in history.result["items"] if i["kind"] == "host_call"]
        assert [c["status"] for c in calls] == ["host_unavailable", "host_unavailable"]


async def test_a_host_that_does_not_answer_by_the_deadline_ends_host_timeout_and_its_late_answer_is_refused(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        link = Link()
        host = broker.register(["session_action"], link)
        await create(rt)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
            await link.wait_for(1)
            await elapse(mock_clock, TIMEOUT - 0.1)
            assert len(link.calls) == 1
            await elapse(mock_clock, 0.1)
            [late, second] = await link.wait_for(2)  # the first timed out; the dispatch went on
            with pytest.raises(ConflictError, match="already ended: host_timeout"):
                answer(broker, host, late)
            answer(broker, host, second)
        recorded = await calls_recorded(rt)
        assert [(c["status"], c["latency_seconds"]) for c in recorded] == [
            ("host_timeout", pytest.approx(TIMEOUT)),
            ("answered", 0.0),
        ]


async def test_answers_that_match_no_waiting_call_are_refused_and_change_nothing(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        link, other_link = Link(), Link()
        host = broker.register(["session_action"], link)
        other = broker.register(["code_review"], other_link)
        with pytest.raises(NotFoundError):
            broker.answer(host, HostReply(call_id="session_action/nope/1/on_enter/0", ok=True))
        await create(rt)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
            [call] = await link.wait_for(1)
            with pytest.raises(ConflictError, match="held by host-1, not host-2"):
                answer(broker, other, call)
            answer(broker, host, call)
            with pytest.raises(ConflictError):  # answered twice
                answer(broker, host, call)
            answer(broker, host, (await link.wait_for(2))[1])
        assert [c["status"] for c in await calls_recorded(rt)] == ["answered", "answered"]


async def test_a_refused_preflight_blocks_the_move_naming_the_host_and_its_reason(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        link = Link()
        host = broker.register(["preflight"], link)
        await create(rt)
        error = {"code": "blocked_by_ci", "message": "CI is red", "retryable": True}

        async def refuse_every_call() -> None:
            # A move from a cached task row asks again, with the committed row, after a refusal (SQLite).
            for n in range(2):
                call = (await link.wait_for(n + 1))[n]
                assert call["call_id"] == "preflight/T1/todo/work"
                assert call["request"] == {"task_id": "T1", "from_step": "todo", "to_step": "work"}
                assert answer(broker, host, call, ok=False, error=error)["status"] == "refused"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse_every_call)
            reply = await send(rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
            nursery.cancel_scope.cancel()
        assert reply.error is not None and reply.error.code == "transition_refused"
        assert "host host-1 answered blocked_by_ci: CI is red" in reply.error.message
        assert reply.error.retryable is True
        task = await ok(rt, {"type": "get_task", "task_id": "T1"})
        assert task.result["step_id"] == "todo"  # nothing committed
        records = await calls_recorded(rt)
        assert {(r["status"], r["error"]["code"]) for r in records} == {("refused", "blocked_by_ci")}
        assert len(records) == len(link.calls)


async def test_a_preflight_no_host_answers_refuses_the_move_retryably(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        broker.unregister(broker.register(["preflight"], Link()))
        await create(rt)
        replies: list[Reply] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _append, replies, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"}
            )
            await waiting(broker, "preflight/T1/todo/work")
            await elapse(mock_clock, WAIT)
        [reply] = replies
        assert reply.error is not None and (reply.error.code, reply.error.retryable) == (
            "host_unavailable",
            True,
        )
        assert (await ok(rt, {"type": "get_task", "task_id": "T1"})).result["step_id"] == "todo"


async def test_a_call_is_offered_at_most_max_offers_times(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        await create(rt)
        links = [Link() for _ in range(MAX_OFFERS + 1)]
        hosts = [broker.register(["session_action"], link) for link in links]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
            for host, link in zip(hosts[:MAX_OFFERS], links, strict=False):
                assert len(await link.wait_for(1)) == 1
                broker.unregister(host)
            last = await links[MAX_OFFERS].wait_for(1)
            assert [c["call_id"] for c in last] == ["session_action/T1/1/on_enter/1"]  # the next action
            answer(broker, hosts[MAX_OFFERS], last[0])
        first = (await calls_recorded(rt))[0]
        assert (first["status"], first["attempts"]) == ("host_unavailable", MAX_OFFERS)


async def test_a_link_that_refuses_the_line_counts_as_a_host_gone(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with brokered(db_path) as (rt, broker, _):
        closing, fine = Link(), Link()
        closing.open = False
        broker.register(["session_action"], closing)
        host = broker.register(["session_action"], fine)
        await create(rt)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "work"})
            for n in range(2):
                answer(broker, host, (await fine.wait_for(n + 1))[n])
        assert [(c["attempts"], c["host_id"]) for c in await calls_recorded(rt)] == [
            (2, "host-2"),
            (1, "host-2"),
        ]


async def test_code_reviews_go_to_a_code_review_host_keyed_by_the_review_run(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    broker = HostBroker(host_timeout=TIMEOUT, host_wait=WAIT)
    async with open_runtime(db_path, host=broker, clock=FakeClock()) as rt, trio.open_nursery() as nursery:
        await nursery.start(broker.record_forever, rt.services.store, rt.hub)
        link = Link()
        host = broker.register(["code_review"], link)
        await ok(rt, {"type": "register_workflow", "yaml": REVIEWED, "import_path": True})
        await ok(rt, {"type": "create_task", "task_id": "T1", "workflow_id": "reviewed"})
        nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
        [call] = await link.wait_for(1)
        runs = await ok(rt, {"type": "list_review_runs", "task_id": "T1"})
        [review] = runs.result["review_runs"]
        assert call["call_id"] == f"code_review/T1/{review['id']}"
        assert call["request"] == {
            "task_id": "T1",
            "step_id": "review",
            "entry_seq": 1,
            "review_run_id": review["id"],
            "agent_profile_id": None,
        }
        answer(broker, host, call)
        await trio.testing.wait_all_tasks_blocked()
        broker.close()


async def test_a_coordinator_host_delivers_and_commits_an_outcome_until_its_fenced_acknowledgement(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The coordinator capability attaches the broker as the runtime's Coordinator: an outcome stored while
    none was connected is delivered once one registers (AC-CO-14), and the delivery stays open until the
    acknowledgement of the current fence is committed through the host (AC-CO-9, AC-CO-10, AC-CO-15)."""
    async with brokered(db_path) as (rt, broker, _):
        envelope = gascity_envelope(work_id="gc-1")
        outcome_id = envelope["outcome_id"]
        received = await ok(rt, {"type": "outcome_ready", "envelope": envelope})
        assert received.result["phase"] == "pending"  # no coordinator yet: stored
        link = Link()
        host = broker.register(["coordinator"], link)
        [deliver] = await link.wait_for(1)
        assert deliver["kind"] == "deliver"
        assert deliver["call_id"] == f"deliver/{outcome_id}/cycle-000001/attempt-1"
        assert deliver["request"]["message"] == {"envelope": envelope, "delivery_cycle": "cycle-000001"}
        receipt = {"delivery_ref": "bead:hq-mail-1", "coordinator_fence": "fence-1"}
        answer(broker, host, deliver, result=receipt)
        ack = {
            "type": "coordinator_ack",
            "store_ref": "city:gascity",
            "outcome_id": outcome_id,
            "work_id": "gc-1",
            "coordinator_fence": "fence-1",
            "acknowledged_by": "mayor",
        }
        while (await ok(rt, {"type": "get_outcome", "outcome_id": outcome_id})).result["phase"] == "pending":
            await trio.sleep(0)  # the receipt is being recorded
        await ok(rt, ack)
        [_, acknowledge] = await link.wait_for(2)
        assert acknowledge["kind"] == "acknowledge"
        assert acknowledge["call_id"] == f"ack/{outcome_id}/cycle-000001/attempt-1"
        assert acknowledge["request"]["acknowledgement"]["coordinator_fence"] == "fence-1"
        answer(broker, host, acknowledge)
        while (await ok(rt, {"type": "get_outcome", "outcome_id": outcome_id})).result[
            "phase"
        ] != "acknowledged":
            await trio.sleep(0)
        recorded = await calls_recorded(rt, kind="deliver")
        assert [(c["task_id"], c["status"]) for c in recorded] == [(None, "answered")]
