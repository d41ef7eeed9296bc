"""The on_enter dispatch through a host in another process (`onceflow serve`'s host role, in process here:
the `HostBroker` answered by a test link) keeps the order and ownership rules of an in-process host: AC-A9
and AC-A12 order, AC-A10 (no live session, no call), AC-B8 (a session action held when the runtime dies is
not offered again by recovery, whose engine-owned actions still finish)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
import trio.testing
from entry_support import WF, setup_entries
from helpers import FakeClock, ok, send

from onceflow.actors.runtime.host_broker import HostBroker, RegisteredHost
from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.events import Reply
from onceflow.protocol.host_calls import HostReply

MIXED = """
- type: set_session_mode
  config: {mode: review}
- type: clear_decisions
- type: enable_plan_mode
- type: reset_agent_context
- type: queue_run_for_each_participant
  config: {role: reviewer, reason: wake}
"""


class AnsweringLink:
    """A host connection that answers every call at once through the broker, logging it."""

    def __init__(self) -> None:
        self.broker: HostBroker | None = None
        self.host: RegisteredHost | None = None
        self.calls: list[dict[str, Any]] = []

    def offer(self, frame: bytes) -> bool:
        call = json.loads(frame)["call"]
        self.calls.append(call)
        assert self.broker is not None and self.host is not None
        trio.lowlevel.current_trio_token().run_sync_soon(
            lambda: self.broker.answer(self.host, HostReply(call_id=call["call_id"], ok=True))  # type: ignore[union-attr,arg-type]
        )
        return True


def answering(broker: HostBroker) -> AnsweringLink:
    link = AnsweringLink()
    link.broker, link.host = broker, broker.register(["session_action"], link)
    return link


async def _task(rt: Any, task_id: str, session: str | None) -> None:
    await ok(
        rt,
        {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": WF,
            "step_id": "work",
            "session_id": session,
        },
    )


def _order(reply: Reply) -> list[str]:
    """The actions as the reply's events show them run: session actions and engine-owned outcomes."""
    seen = []
    for event in reply.events:
        if event.type == "session_action":
            seen.append(event.action)  # type: ignore[union-attr]
        elif event.type == "action_outcome":
            seen.append(event.kind)  # type: ignore[union-attr]
    return seen


async def test_ac_a9_ac_a12_through_a_host_connection_the_declared_order_holds_across_owners(
    db_path: Path,
) -> None:
    """AC-A9: reset_agent_context leads; AC-A12: set_session_mode, clear_decisions, enable_plan_mode and the
    fan-out keep their declared order although the session actions are answered by another process."""
    broker = HostBroker()
    async with open_runtime(db_path, host=broker, clock=FakeClock()) as rt:
        link = answering(broker)
        await setup_entries(rt, MIXED)
        await _task(rt, "T1", "s-T1")
        reply = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    assert _order(reply) == [
        "reset_agent_context",
        "set_session_mode",
        "clear_decisions",
        "enable_plan_mode",
        "queue_run_for_each_participant",
    ]
    assert [call["request"]["action"] for call in link.calls] == [
        "reset_agent_context",
        "set_session_mode",
        "enable_plan_mode",
    ]
    assert [call["request"]["position"] for call in link.calls] == [3, 0, 2]  # the declared positions


async def test_ac_a10_with_no_live_session_no_call_reaches_a_host_and_engine_actions_still_run(
    db_path: Path,
) -> None:
    broker = HostBroker()
    async with open_runtime(db_path, host=broker, clock=FakeClock()) as rt:
        link = answering(broker)
        await setup_entries(rt, MIXED)
        await _task(rt, "T1", None)
        reply = await ok(rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
    assert link.calls == []
    assert _order(reply) == ["clear_decisions", "queue_run_for_each_participant"]


class HangingLink:
    """A host connection that takes calls and never answers (its runtime dies first)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.offered = trio.Event()

    def offer(self, frame: bytes) -> bool:
        self.calls.append(json.loads(frame)["call"])
        self.offered.set()
        return True


async def test_ac_b8_a_session_action_held_when_the_runtime_dies_is_never_offered_again(
    db_path: Path,
) -> None:
    """The runtime dies while a host holds the entry's reset_agent_context; the restart's recovery scan
    finishes the entry's engine-owned actions and offers no session action (they hold no marker)."""
    hanging = HangingLink()
    dying = HostBroker()
    dying.register(["session_action"], hanging)
    with trio.CancelScope() as crash:
        async with open_runtime(db_path, host=dying, clock=FakeClock()) as rt:
            await setup_entries(rt, MIXED)
            await _task(rt, "T1", "s-T1")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, rt, {"type": "move_task", "task_id": "T1", "step_id": "review"})
                await hanging.offered.wait()
                crash.cancel()  # the process dies while the host holds the entry's first action
    assert [call["request"]["action"] for call in hanging.calls] == ["reset_agent_context"]

    restarted = HostBroker()
    link = AnsweringLink()
    link.broker, link.host = restarted, restarted.register(["session_action"], link)  # before the scan
    async with open_runtime(db_path, host=restarted, clock=FakeClock()) as rt:
        runs = await ok(rt, {"type": "list_runs", "task_id": "T1"})
    assert link.calls == []  # AC-B8: nothing resurrected
    assert len(runs.result["runs"]) == 2  # the fan-out finished by recovery
