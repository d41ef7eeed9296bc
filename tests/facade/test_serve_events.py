"""`onceflow serve`'s event stream with a resume point: event lines carry `event_seq`, `subscribe` takes
`after`, replays what the runtime still holds at the client's pace, tells of a gap, then goes live.

Over the wire: a real `onceflow serve` subprocess and tests/facade/wire_client.py (no onceflow imports), as
a host in another language talks to it. The replay/live hand-over under load runs in process (a real
runtime, real socketpairs) to try many interleavings quickly.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import TESTS
from test_serve import served_in_process
from wire_client import WireClient

from onceflow.serve import ServeOptions

WORKFLOW = TESTS / "fixtures" / "workflows" / "minimal.yml"  # entering `work` asks for 2 session actions


class ServeProcess:
    """A `onceflow serve` process on `db`, listening on `sock`; its stderr drained into `log`."""

    def __init__(self, db: Path, sock: Path, *extra: str) -> None:
        command = [
            sys.executable,
            "-m",
            "onceflow.cli",
            "serve",
            "--db",
            str(db),
            "--workflow",
            str(WORKFLOW),
        ]
        self.process = subprocess.Popen(
            [*command, "--socket", str(sock), *extra], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.sock, self.log = sock, list[str]()
        assert self.process.stderr is not None
        for raw in iter(self.process.stderr.readline, b""):
            if raw.startswith(b"serving on "):
                break
        else:
            raise AssertionError(f"the server exited before serving (status {self.process.wait()})")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for raw in iter(self.process.stderr.readline, b""):
            self.log.append(raw.decode(errors="replace"))

    def client(self) -> WireClient:
        return WireClient(str(self.sock))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=30) == 0


@contextmanager
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))  # a socket path is limited to ~107 bytes
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def served(where: Path, *extra: str) -> Iterator[ServeProcess]:
    server = ServeProcess(where / "board.db", where / "s.sock", *extra)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def _create(task: str) -> dict[str, Any]:
    """A task in `todo` with a session (so entering `work` asks for its 2 session actions)."""
    return {
        "type": "create_task",
        "task_id": task,
        "workflow_id": "fixture",
        "step_id": "todo",
        "session_id": f"session-{task}",
    }


def _subscribe(client: WireClient, **fields: Any) -> dict[str, Any]:
    reply = client.request({"id": "sub", "type": "subscribe", **fields})["reply"]
    assert reply["ok"], reply
    return reply


def _burst(client: WireClient, tasks: range) -> int:
    """Create the tasks, then move them all to `work` in one pipelined write (2 session actions each); how
    many events the replies carried."""
    replies = []
    for requests in (
        [{"id": n, **_create(f"T{n}")} for n in tasks],
        [{"id": n, "type": "move_task", "task_id": f"T{n}", "step_id": "work"} for n in tasks],
    ):
        client.write(*requests)
        replies += [client.reply()["reply"] for _ in requests]
    assert all(reply["ok"] for reply in replies)
    return sum(len(reply["events"]) for reply in replies)


def _session_actions(frames: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (f["event"]["task_id"], f["event"]["action"])
        for f in frames
        if "event" in f and f["event"]["type"] == "session_action"
    ]


def test_a_slow_subscriber_dropped_in_a_burst_resumes_after_its_last_seq_and_sees_300_of_300() -> None:
    """The scenario a Go host hit: 300 session actions in a burst, a subscriber slower than the runtime
    dropped as `slow_consumer` with most of them unseen. It reconnects with `after` = the last seq it
    processed: the replay (paced by its small queue, never dropped for it) brings the rest, and across the
    two connections it has each of the 300, once, in the order the moves were applied."""
    with folder() as where, served(where, "--queue-size", "16", "--grace", "60") as server:
        slow, worker = server.client(), server.client()
        start = _subscribe(slow)["result"]["next_event_seq"]
        _burst(worker, range(150))  # meanwhile the slow subscriber reads nothing
        first: list[dict[str, Any]] = []
        while (frame := slow.line()) is not None:  # what was queued, the error, then EOF
            first.append(frame)
        assert first[-1]["error"]["code"] == "slow_consumer"
        processed = first[:-1]
        assert all(set(f) == {"event_seq", "event"} for f in processed)
        assert len(_session_actions(processed)) < 300  # the drop lost events: only a resume brings them

        last = processed[-1]["event_seq"]
        again = server.client()
        resumed = _subscribe(again, after=last)
        assert resumed["result"] == {"subscribed": True, "next_event_seq": last + 1}
        rest: list[dict[str, Any]] = []
        while len(_session_actions(processed + rest)) < 300:
            frame = again.line()
            assert frame is not None and "event" in frame, (
                frame
            )  # no gap line, no error: paced, never dropped
            rest.append(frame)
        seqs = [f["event_seq"] for f in processed + rest]
        assert seqs == list(range(start, start + len(seqs)))  # no duplicate, no gap
        expected = [
            (f"T{n}", action) for n in range(150) for action in ("set_session_mode", "auto_start_agent")
        ]
        assert _session_actions(processed + rest) == expected


def test_subscribe_after_a_seq_older_than_the_window_starts_with_one_gap_line() -> None:
    with folder() as where, served(where, "--event-window", "20") as server:
        watcher, worker = server.client(), server.client()
        start = _subscribe(watcher)["result"]["next_event_seq"]
        emitted = _burst(worker, range(10))
        assert emitted > 40
        seen = [watcher.line() for _ in range(emitted)]
        newest = start + emitted - 1
        assert [f["event_seq"] for f in seen] == list(range(start, newest + 1))  # type: ignore[index]

        late = server.client()
        reply = _subscribe(late, after=start)  # processed one event; the window holds the last 20
        assert reply["result"] == {"subscribed": True, "next_event_seq": newest - 19}
        assert late.line() == {"gap": {"after": start, "next": newest - 19}}
        replayed = [late.line() for _ in range(20)]
        assert replayed == seen[-20:]
        worker.request(_create("T-live"))
        live = late.line()
        assert live is not None and live["event_seq"] == newest + 1 and live["event"]["task_id"] == "T-live"


def test_a_resume_from_before_a_restart_of_serve_gets_a_gap_line_and_only_newer_seqs() -> None:
    with folder() as where:
        with served(where) as server:
            watcher, worker = server.client(), server.client()
            start = _subscribe(watcher)["result"]["next_event_seq"]
            worker.request(_create("T1"))
            frame = watcher.line()
            assert frame is not None and frame["event_seq"] == start
            server.stop()
        with served(where) as server:
            resumed = server.client()
            reply = _subscribe(resumed, after=start)
            next_seq = reply["result"]["next_event_seq"]
            assert next_seq > start  # never told it already saw newer events
            assert resumed.line() == {"gap": {"after": start, "next": next_seq}}
            server.client().request(_create("T2"))
            frame = resumed.line()
            assert frame is not None and frame["event_seq"] == next_seq
            assert frame["event"]["task_id"] == "T2"


@pytest.mark.parametrize(
    "after", [-1, 1.5, True, "17", None, 2**63, [1], {"seq": 1}], ids=lambda v: json.dumps(v)
)
def test_subscribe_refuses_a_bad_after_naming_the_field_and_starts_nothing(after: Any) -> None:
    with folder() as where, served(where) as server:
        client = server.client()
        refused = client.request({"id": 1, "type": "subscribe", "after": after})["reply"]
        assert refused["command"] == "subscribe"
        assert (refused["error"]["code"], refused["error"]["field"]) == ("invalid_message", "after")
        unknown = client.request({"id": 2, "type": "subscribe", "after": 0, "from": 3})["reply"]
        assert (unknown["error"]["code"], unknown["error"]["field"]) == ("invalid_message", "from")
        assert _subscribe(client, after=0)["result"]["subscribed"]  # nothing had started


# --- in process: the replay/live hand-over under concurrent load, many interleavings ------------------


async def test_replay_then_live_never_duplicates_or_skips_a_seq_under_concurrent_load(tmp_path: Path) -> None:
    """A writer keeps creating tasks while readers resume from random past seqs, reading at random paces
    through a small queue (so the replay waits for room while events keep coming): each gets exactly the
    events after its `after`, in seq order (each create emits one event, so seq and task match)."""
    rng = random.Random(7)
    async with served_in_process(tmp_path / "b.db", ServeOptions(queue_size=4, grace=5)) as (rt, _, connect):
        start = rt.events().next_seq
        created = 0

        async def write() -> None:
            nonlocal created
            worker = connect()
            for n in range(400):
                worker.send({"id": n, **_create(f"T{n}")})
                assert (await worker.line() or {})["reply"]["ok"]
                created += 1
                if n % 7 == 0:
                    await trio.sleep(0)

        async def resume(after: int, pace: int, results: list[tuple[int, list[int]]]) -> None:
            peer = connect()
            peer.send({"id": "s", "type": "subscribe", "after": after})
            reply = await peer.line()
            assert reply is not None and reply["reply"]["result"]["next_event_seq"] == after + 1
            seqs: list[int] = []
            while (seqs[-1] if seqs else after) < start + 399:
                frame = await peer.line()
                assert frame is not None and "event_seq" in frame, frame
                assert frame["event"]["task_id"] == f"T{frame['event_seq'] - start}"
                seqs.append(frame["event_seq"])
                for _ in range(rng.randrange(pace + 1)):
                    await trio.sleep(0)
            results.append((after, seqs))

        results: list[tuple[int, list[int]]] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                for _ in range(24):
                    for _ in range(1 + rng.randrange(30)):
                        await trio.sleep(0)
                    after = rng.randrange(start - 1, start + created)  # one event a task
                    nursery.start_soon(resume, after, rng.choice([0, 2, 10]), results)
    assert len(results) == 24
    for after, seqs in results:
        assert seqs == list(range(after + 1, start + 400)), after
