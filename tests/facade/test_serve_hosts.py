"""The host role over `onceflow serve`: a connection registers capabilities, is sent calls, answers them;
calls are never silently lost. Real `onceflow serve` processes, real sockets, real host processes killed
mid-call (tests/facade/host_process.py); the routing rules in process are tests/runtime/test_host_broker.py's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers import gascity_envelope
from test_serve import _create, serving
from wire_client import WireClient

HOST = Path(__file__).with_name("host_process.py")


@contextmanager
def host_process(socket: Path, capabilities: str, mode: str, log: Path) -> Iterator[subprocess.Popen[str]]:
    """A host process registered on `socket` (it has printed `registered host-N`)."""
    process = subprocess.Popen(
        [sys.executable, "-I", str(HOST), str(socket), capabilities, mode, str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("registered host-")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def calls_in(log: Path, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The calls a host process logged, once it has logged `count`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            calls = [json.loads(line) for line in log.read_text().splitlines()]
            if len(calls) >= count:
                return calls
        time.sleep(0.02)
    raise AssertionError(f"fewer than {count} calls logged in {timeout} s")


def host(client: WireClient, *capabilities: str) -> str:
    reply = client.request({"id": "reg", "type": "register_host", "capabilities": list(capabilities)})
    assert reply["reply"]["ok"], reply
    host_id: str = reply["reply"]["result"]["host_id"]
    return host_id


class HostWire(WireClient):
    """A host connection: call lines that arrive while it waits for a reply are kept for `next_call`."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.calls: list[dict[str, Any]] = []

    def next_call(self) -> dict[str, Any]:
        """The next call line sent to this host (replies and events on the way are skipped)."""
        while not self.calls:
            frame = self.line()
            assert frame is not None, "the connection closed"
            if "call" in frame:
                self.calls.append(frame["call"])
        return self.calls.pop(0)

    def answer(self, call: dict[str, Any], **answer: Any) -> dict[str, Any]:
        """Answer a call; the server's reply to the answer (call lines on the way are kept)."""
        request = {"id": f"answer:{call['call_id']}", "type": "host_reply", "call_id": call["call_id"]}
        self.write(request | ({"ok": True} | answer))
        while True:
            frame = self.line()
            assert frame is not None
            if "call" in frame:
                self.calls.append(frame["call"])
            elif frame.get("id") == request["id"]:
                return frame


def moved(client: WireClient, task: str, step: str = "work") -> None:
    client.write({"id": f"move:{task}", "type": "move_task", "task_id": task, "step_id": step})


def history_calls(client: WireClient, task: str) -> list[dict[str, Any]]:
    items = client.request({"type": "task_history", "task_id": task})["reply"]["result"]["items"]
    return [item["detail"] for item in items if item["kind"] == "host_call"]


def test_register_host_refuses_bad_capabilities_and_a_second_registration() -> None:
    with serving() as served:
        client = served.client()
        for capabilities, field in [
            ([], "capabilities"),
            (["telepathy"], "capabilities.0"),
            (["preflight"] * 2, "capabilities"),
        ]:
            reply = client.request({"type": "register_host", "capabilities": capabilities})["reply"]
            assert (reply["ok"], reply["error"]["code"], reply["error"]["field"]) == (
                False,
                "invalid_message",
                field,
            )
        unknown = client.request({"type": "register_host", "capabilities": ["preflight"], "extra": 1})[
            "reply"
        ]
        assert unknown["error"]["field"] == "extra"
        assert host(client, "preflight") == "host-1"
        again = client.request({"type": "register_host", "capabilities": ["session_action"]})["reply"]
        assert again["error"]["code"] == "conflict"


def test_a_host_killed_mid_call_is_replaced_and_the_next_host_performs_the_call_under_the_same_id(
    tmp_path: Path,
) -> None:
    with serving() as served:
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
        with host_process(served.socket, "session_action", "hang", first_log) as first:
            moved(client, "T1")
            [held] = calls_in(first_log, 1)
            first.send_signal(signal.SIGKILL)  # dies holding the call
            first.wait()
        with host_process(served.socket, "session_action", "answer", second_log):
            reply = client.reply()["reply"]
            performed = calls_in(second_log, 2)
        assert reply["ok"] and [e["action"] for e in reply["events"] if e["type"] == "session_action"] == [
            "set_session_mode",
            "auto_start_agent",
        ]
        assert performed[0]["call_id"] == held["call_id"] == "session_action/T1/1/on_enter/0"
        assert performed[0]["request"] == held["request"]
        listed = client.request({"type": "list_host_calls", "task_id": "T1"})["reply"]["result"]["calls"]
        assert [(c["call_id"], c["status"], c["attempts"], c["host_id"]) for c in listed] == [
            ("session_action/T1/1/on_enter/0", "answered", 2, "host-2"),
            ("session_action/T1/1/on_enter/1", "answered", 1, "host-2"),
        ]


def test_a_host_that_never_answers_gets_host_timeout_within_the_deadline(tmp_path: Path) -> None:
    with serving("--host-timeout", "1") as served:
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        with host_process(served.socket, "session_action", "hang", tmp_path / "calls.jsonl"):
            began = time.monotonic()
            moved(client, "T1")
            reply = client.reply()["reply"]
            took = time.monotonic() - began
        assert reply["ok"] and 2.0 <= took < 4.0  # two actions, one second each: never a hang
        failed = [
            e for e in reply["events"] if e["type"] == "diagnostic" and e["code"] == "session_action_failed"
        ]
        assert [f["fields"]["error_type"] for f in failed] == ["HostTimeoutError"] * 2
        statuses = [(c["status"], c["error"]["retryable"]) for c in history_calls(client, "T1")]
        assert statuses == [("host_timeout", True)] * 2


def test_with_no_host_a_call_is_host_unavailable_after_host_wait_and_readable_on_reconnect() -> None:
    with serving("--host-wait", "0.5") as served:
        watcher = served.client()
        assert watcher.request({"type": "subscribe"})["reply"]["ok"]
        departed = served.client()
        host(departed, "session_action")
        departed.close()  # registered once, then away: calls now wait for a host
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        time.sleep(0.2)  # the server has seen the host leave
        moved(client, "T1")
        assert client.reply()["reply"]["ok"]  # the move committed; its actions reached no executor

        back = served.client()  # the host reconnects and reads what happened while it was away
        missed = back.request({"type": "list_host_calls", "status": "host_unavailable"})["reply"]["result"]
        assert [(c["call_id"], c["attempts"]) for c in missed["calls"]] == [
            ("session_action/T1/1/on_enter/0", 0),
            ("session_action/T1/1/on_enter/1", 0),
        ]
        assert [c["status"] for c in history_calls(back, "T1")] == ["host_unavailable"] * 2
        unanswered = []
        while len(unanswered) < 2:
            frame = watcher.line()
            assert frame is not None
            if "event" in frame and frame["event"]["type"] == "host_call_unanswered":
                unanswered.append(frame["event"])
        assert [e["status"] for e in unanswered] == ["host_unavailable"] * 2


def test_a_preflight_refusal_over_the_socket_blocks_the_move(tmp_path: Path) -> None:
    with serving() as served:
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        with host_process(served.socket, "preflight", "refuse", tmp_path / "calls.jsonl"):
            moved(client, "T1")
            reply = client.reply()["reply"]
        assert reply["error"]["code"] == "transition_refused"
        assert "host host-1 answered not_now: busy elsewhere" in reply["error"]["message"]
        got = client.request({"type": "get_task", "task_id": "T1"})["reply"]["result"]
        assert got["step_id"] == "todo"


def test_a_host_answers_the_calls_its_own_commands_cause() -> None:
    """A host_reply is taken as it is read, ahead of the connection's pipeline: the host's own move waits on
    the preflight and session actions the same connection must answer."""
    with serving() as served:
        own = HostWire(str(served.socket))
        host(own, "preflight", "session_action")
        assert own.request(_create("T1", session_id="s1"))["reply"]["ok"]
        moved(own, "T1")
        kinds = []
        for _ in range(3):
            call = own.next_call()
            kinds.append(call["kind"])
            own.write({"type": "host_reply", "call_id": call["call_id"], "ok": True})  # replies skipped below
        while True:
            frame = own.line()
            assert frame is not None
            if frame.get("id") == "move:T1":
                break
        assert kinds == ["preflight", "session_action", "session_action"] and frame["reply"]["ok"]


def test_malformed_or_unmatched_host_replies_are_refused_and_change_nothing() -> None:
    with serving() as served:
        stranger = served.client()
        not_host = stranger.request({"type": "host_reply", "call_id": "x", "ok": True})["reply"]
        assert (not_host["error"]["code"], not_host["error"]["field"]) == ("invalid_message", "type")

        own = HostWire(str(served.socket))
        host(own, "session_action")
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        moved(client, "T1")
        call = own.next_call()
        unknown = own.answer({"call_id": "session_action/T9/1/on_enter/0"})["reply"]
        assert (unknown["error"]["code"], unknown["error"]["field"]) == ("not_found", "call_id")
        shapeless = own.answer(call, ok=False)["reply"]  # ok: false needs an error
        assert shapeless["error"]["code"] == "invalid_message"
        assert own.answer(call)["reply"]["result"] == {"call_id": call["call_id"], "status": "answered"}
        twice = own.answer(call)["reply"]
        assert (twice["error"]["code"], twice["error"]["field"]) == ("conflict", "call_id")
        own.answer(own.next_call())
        assert client.reply()["reply"]["ok"]


def test_shutdown_lets_a_host_answer_the_calls_it_holds_then_exits_0() -> None:
    with serving() as served:
        own = HostWire(str(served.socket))
        host(own, "session_action")
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        moved(client, "T1")
        first = own.next_call()
        served.process.send_signal(signal.SIGTERM)  # draining: the move waits on the host
        time.sleep(0.3)
        own.answer(first)
        own.answer(own.next_call())
        assert client.reply()["reply"]["ok"]
        assert served.process.wait(timeout=30) == 0


def test_a_coordinator_host_over_the_socket_takes_an_outcome_to_its_fenced_acknowledgement(
    tmp_path: Path,
) -> None:
    with serving() as served:
        client = served.client()
        envelope = gascity_envelope(work_id="gc-1")
        outcome = envelope["outcome_id"]
        assert client.request({"type": "outcome_ready", "envelope": envelope})["reply"]["ok"]
        log = tmp_path / "coordinator.jsonl"
        with host_process(served.socket, "coordinator", "answer", log):
            [deliver] = calls_in(log, 1)
            assert deliver["kind"] == "deliver" and deliver["request"]["message"]["envelope"] == envelope
            ack = {"store_ref": "city:gascity", "outcome_id": outcome, "work_id": "gc-1"}
            while True:  # the receipt (fence f-1) is recorded, then the ack of that fence completes it
                state = client.request({"type": "get_outcome", "outcome_id": outcome})["reply"]["result"]
                if state["phase"] == "needs-coordinator-ack":
                    break
                time.sleep(0.02)
            queued = client.request(
                {"type": "coordinator_ack", **ack, "coordinator_fence": "f-1", "acknowledged_by": "mayor"}
            )
            assert queued["reply"]["ok"]
            [_, acknowledge] = calls_in(log, 2)
            assert acknowledge["kind"] == "acknowledge"
            deadline = time.monotonic() + 20
            while client.request({"type": "get_outcome", "outcome_id": outcome})["reply"]["result"][
                "phase"
            ] != ("acknowledged"):
                assert time.monotonic() < deadline
                time.sleep(0.02)


def test_before_any_host_registers_serve_answers_as_before() -> None:
    """Old clients keep working: no host ever registered, so session actions are reported performed and
    every transition is accepted, with nothing recorded."""
    with serving() as served:
        client = served.client()
        assert client.request(_create("T1", session_id="s1"))["reply"]["ok"]
        reply = client.request({"type": "move_task", "task_id": "T1", "step_id": "work"})["reply"]
        assert reply["ok"] and [e["type"] for e in reply["events"]].count("session_action") == 2
        assert client.request({"type": "list_host_calls"})["reply"]["result"]["calls"] == []
