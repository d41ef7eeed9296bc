"""`onceflow serve` driven from other processes over the socket with raw JSON.

The server runs as a subprocess (`python -m onceflow.cli serve`); clients are tests/facade/wire_client.py,
which imports nothing of onceflow (it also runs as its own `python -I` process). The wire format is in
onceflow/serve.py's docstring.
"""

from __future__ import annotations

import json
import re
import select
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import TESTS
from hypothesis import given
from hypothesis import strategies as st
from wire_client import WireClient

from onceflow.serve import OVERLONG, Request, _LineReader, split_request

WORKFLOW = TESTS / "fixtures" / "workflows" / "minimal.yml"
CLIENT = Path(__file__).with_name("wire_client.py")


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    socket: Path
    db: Path

    def client(self) -> WireClient:
        return WireClient(str(self.socket))

    def stop(self, signum: int = signal.SIGTERM) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=30)


def _start(db: Path, where: list[str], *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "onceflow.cli", "serve", "--db", str(db), "--workflow", str(WORKFLOW)]
    return subprocess.Popen(
        [*command, *where, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _wait_ready(process: subprocess.Popen[bytes], timeout: float = 30.0) -> str:
    """Wait for the server's one `serving on ...` line on stderr."""
    assert process.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stderr], [], [], 0.1)
        if ready:
            line = process.stderr.readline().decode()
            assert line, f"server exited before serving (status {process.wait()})"
            if line.startswith("serving on "):
                return line.strip()
    raise AssertionError("server did not start")


@contextmanager
def serving(*extra: str) -> Iterator[Served]:
    """A server on a socket in a short temp dir (a socket path is limited to ~107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    served = Served(
        _start(folder / "board.db", ["--socket", str(folder / "s.sock")], *extra),
        folder / "s.sock",
        folder / "board.db",
    )
    try:
        assert _wait_ready(served.process) == f"serving on {served.socket}"
        yield served
    finally:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _create(task: str, **extra: Any) -> dict[str, Any]:
    return {"type": "create_task", "task_id": task, "workflow_id": "fixture", "step_id": "todo", **extra}


def _step_of(client: WireClient, task: str) -> str | None:
    frame = client.request({"id": "get", "type": "get_task", "task_id": task})
    reply = frame["reply"]
    return reply["result"]["step_id"] if reply["ok"] else None


def test_issue13_serve_concurrent_clients_in_separate_processes_each_get_their_replies_by_id() -> None:
    with serving() as served:
        clients = [
            subprocess.Popen(
                [sys.executable, "-I", str(CLIENT), str(served.socket), f"C{n}", "15"], stdout=subprocess.PIPE
            )
            for n in range(4)
        ]
        reports = [json.loads(c.communicate(timeout=60)[0]) for c in clients]
        for n, report in enumerate(reports):
            expected = [i for k in range(15) for i in (f"C{n}-{k}/create", k)]
            assert report["ids"] == expected  # each id echoed, replies in the order sent
            assert all(report["ok"])
        checker = served.client()
        assert {_step_of(checker, f"C{n}-{k}") for n in range(4) for k in range(15)} == {"work"}


def test_issue13_serve_reply_echoes_string_and_int64_ids_and_refuses_bad_ones() -> None:
    with serving() as served:
        client = served.client()
        assert client.request({"id": "req-1", **_create("T1")})["id"] == "req-1"
        assert client.request({"id": 2**63 - 1, "type": "get_task", "task_id": "T1"})["id"] == 2**63 - 1
        assert client.request({"id": None, "type": "get_task", "task_id": "T1"})["id"] is None
        assert client.request({"type": "get_task", "task_id": "T1"})["id"] is None
        for bad in (2**63, True, "x" * 257, [1], 1.5):
            frame = client.request({"id": bad, **_create("T-bad")})
            assert frame["id"] is None
            assert frame["reply"]["error"]["code"] == "invalid_message"
            assert frame["reply"]["error"]["field"] == "id"
        assert _step_of(client, "T-bad") is None  # a refused id never ran its command


def test_issue13_serve_subscribe_streams_every_event_as_event_lines() -> None:
    with serving() as served:
        watcher, worker = served.client(), served.client()
        subscribed = watcher.request({"id": "s", "type": "subscribe"})
        assert subscribed["reply"] == {
            "type": "reply",
            "command": "subscribe",
            "ok": True,
            "result": {"subscribed": True},
            "error": None,
            "events": [],
        }
        created = worker.request(_create("T1"))["reply"]
        moved = worker.request({"type": "move_task", "task_id": "T1", "step_id": "work"})["reply"]
        expected = created["events"] + moved["events"]  # the same models the replies carry
        seen = []
        while len(seen) < len(expected):
            frame = watcher.line()
            assert frame is not None and set(frame) == {"event"}, frame
            seen.append(frame["event"])
        assert seen == expected
        assert {"task_created", "transition", "step_entered"} <= {e["type"] for e in seen}


def test_issue13_serve_malformed_lines_get_typed_errors_and_the_connection_stays_usable() -> None:
    with serving("--max-line", "2000") as served:
        client = served.client()
        client.write(b"not json\n", b"[" * 100_000 + b"\n", b"\xff\xfe\n")
        for _ in range(3):
            frame = client.reply()
            assert frame["id"] is None and frame["reply"]["error"]["code"] == "invalid_message"
        unknown = client.request({"id": 1, "type": "launch_rockets"})["reply"]["error"]
        assert (unknown["code"], unknown["field"]) == ("invalid_message", "type")
        bad_field = client.request({"id": 2, **_create("T1", priority="urgent")})["reply"]["error"]
        assert (bad_field["code"], bad_field["field"]) == ("invalid_message", "priority")
        client.write(b'{"id": 3, "type": "get_task", "task_id": "' + b"x" * 3000 + b'"}\n')
        overlong = client.reply()  # longer than --max-line: refused, skipped to its newline
        assert overlong["id"] is None and "longer than 2000 bytes" in overlong["reply"]["error"]["message"]
        assert client.request({"id": 4, **_create("T1")})["reply"]["ok"]
        assert _step_of(client, "T1") == "todo"


def test_issue13_serve_slow_reader_is_disconnected_with_an_error_line_and_never_blocks_others() -> None:
    with serving("--queue-size", "4", "--grace", "60") as served:
        slow, fast = served.client(), served.client()
        assert slow.request({"type": "subscribe"})["reply"]["ok"]  # and from now on it reads nothing
        started = time.monotonic()
        for n in range(150):
            assert fast.request(_create(f"T{n}"))["reply"]["ok"]
            assert fast.request({"type": "move_task", "task_id": f"T{n}", "step_id": "work"})["reply"]["ok"]
        assert time.monotonic() - started < 30  # the fast client never waited on the slow one
        frames = []
        while (frame := slow.line()) is not None:  # the slow client reads at last: queue, error, EOF
            frames.append(frame)
        assert frames[-1]["error"]["code"] == "slow_consumer"
        assert all("event" in f for f in frames[:-1])
        assert _step_of(fast, "T149") == "work"


def test_issue13_serve_client_disconnecting_mid_command_loses_nothing_it_sent() -> None:
    with serving() as served:
        gone = served.client()
        gone.write(*[_create(f"T{n}") for n in range(40)])
        gone.close()  # before any reply: the commands already sent still run and commit
        checker = served.client()
        deadline = time.monotonic() + 20
        while _step_of(checker, "T39") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [_step_of(checker, f"T{n}") for n in range(40)] == ["todo"] * 40


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_issue13_serve_signal_drains_in_flight_commands_removes_socket_and_exits_0(signum: int) -> None:
    with serving() as served:
        client = served.client()
        client.write(*[{"id": n, **_create(f"T{n}")} for n in range(60)])
        first = client.reply()
        assert served.stop(signum) == 0
        assert not served.socket.exists()
        replies = [first]
        while (frame := client.line()) is not None:
            replies.append(frame)
        assert all(f["reply"]["ok"] for f in replies)
        answered = [f["id"] for f in replies]
        assert answered == list(range(len(answered)))
        # every answered command committed, and nothing past them did
        restarted = subprocess.run(
            [sys.executable, "-m", "onceflow.cli", "serve", "--db", str(served.db), "--stdio"],
            input=b"".join(
                json.dumps({"id": n, "type": "get_task", "task_id": f"T{n}"}).encode() + b"\n"
                for n in range(60)
            ),
            capture_output=True,
            timeout=60,
        )
        assert restarted.returncode == 0
        found = [json.loads(line)["reply"]["ok"] for line in restarted.stdout.splitlines()]
        assert found == [n < len(answered) for n in range(60)]


def test_issue13_serve_stdio_answers_each_line_and_exits_0_at_end_of_input(tmp_path: Path) -> None:
    lines = [
        {"id": "a", **_create("T1")},
        {"id": "b", "type": "move_task", "task_id": "T1", "step_id": "work"},
        {"id": "c", "type": "nope"},
        {"id": "d", "type": "get_task", "task_id": "T1"},
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "serve",
            "--db",
            str(tmp_path / "b.db"),
            "--workflow",
            str(WORKFLOW),
            "--stdio",
        ],
        input=b"".join(json.dumps(line).encode() + b"\n" for line in lines),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stderr.decode().splitlines()[0] == "serving on stdio"
    frames = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(f["id"], f["reply"]["ok"]) for f in frames] == [
        ("a", True),
        ("b", True),
        ("c", False),
        ("d", True),
    ]
    assert frames[3]["reply"]["result"]["step_id"] == "work"


def test_issue13_serve_refuses_a_live_socket_or_an_owned_database_with_one_error_line() -> None:
    with serving() as served:
        other = _start(served.db.with_name("other.db"), ["--socket", str(served.socket)])
        _, err = other.communicate(timeout=30)
        assert (other.returncode, err.decode()) == (
            2,  # the CLI's "cannot run" status
            f"error: {served.socket}: another server is listening there\n",
        )
        second = served.socket.with_name("second.sock")
        same_db = _start(served.db, ["--socket", str(second)])
        _, err = same_db.communicate(timeout=30)
        assert same_db.returncode == 2
        assert err.decode().startswith("error: database ") and "already owned" in err.decode()
        assert len(err.splitlines()) == 1  # no traceback
        assert not second.exists()  # its socket was removed again
        assert served.client().request({"type": "get_task", "task_id": "none"})["reply"]["ok"] is False


def test_issue13_split_request_strips_the_id_before_the_command_is_decoded() -> None:
    request = split_request(b'{"id": 7, "type": "get_task", "task_id": "T1"}')
    assert request == Request(
        7, {"type": "get_task", "task_id": "T1"}, '{"type": "get_task", "task_id": "T1"}'
    )
    plain = b'{"type": "get_task", "task_id": "T1"}'
    assert split_request(plain) == Request(None, {"type": "get_task", "task_id": "T1"}, plain)


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=50), max_size=20),
)
def test_issue13_line_reader_splits_any_chunking_and_skips_overlong_lines(
    lines: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(line + b"\n" for line in lines)
    chunks, rest = [], data
    for cut in cuts:
        chunks.append(rest[:cut])
        rest = rest[cut:]
    chunks.append(rest)

    class Chunks(trio.abc.ReceiveStream):
        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            await trio.lowlevel.checkpoint()
            while chunks and not chunks[0]:
                chunks.pop(0)
            return chunks.pop(0) if chunks else b""

        async def aclose(self) -> None:
            pass

    async def read_all() -> list[bytes | object]:
        reader, out = _LineReader(Chunks(), max_line=20), []
        while (line := await reader.receive_line()) is not None:
            out.append(line)
        return out

    assert trio.run(read_all) == [OVERLONG if len(line) > 20 else line for line in lines]


def test_issue13_readme_serving_example_runs_as_written(tmp_path: Path) -> None:
    """The README's `onceflow serve` line and the shell client's lines, over --stdio (no socat here)."""
    readme = (TESTS.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Serving over a socket", 1)[1].split("\n## ", 1)[0]
    (serve_line,) = [line for line in section.splitlines() if line.startswith("onceflow serve ")]
    argv = shlex.split(serve_line)[1:]
    argv[argv.index("--socket") : argv.index("--socket") + 2] = ["--stdio"]
    argv[argv.index("--db") + 1] = str(tmp_path / "board.db")
    requests = re.findall(r"'(\{.*?\})'", section)
    assert len(requests) == 2
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *argv],
        cwd=TESTS.parent,
        input="".join(line + "\n" for line in requests).encode(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    frames = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(f["id"], f["reply"]["ok"]) for f in frames] == [(1, True), (2, True)]
    assert frames[1]["reply"]["result"]["step_id"] == "work"


def test_issue13_serve_replaces_a_stale_socket_file_and_creates_it_owner_only() -> None:
    folder = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    try:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(folder / "s.sock"))  # a killed server's leftover: nobody listens on it
        stale.close()
        process = _start(folder / "b.db", ["--socket", str(folder / "s.sock")])
        try:
            _wait_ready(process)
            assert stat.S_IMODE((folder / "s.sock").stat().st_mode) == 0o600
            client = WireClient(str(folder / "s.sock"))
            assert client.request({"id": 1, **_create("T1")})["reply"]["ok"]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("bad", ["-1", "nan", "soon"])
def test_issue14_serve_refuses_a_bad_switch_interval_naming_the_flag(tmp_path: Path, bad: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "serve",
            "--db",
            str(tmp_path / "s.db"),
            "--stdio",
            "--switch-interval",
            bad,
        ],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--switch-interval" in done.stderr.decode()
    assert not (tmp_path / "s.db").exists()
