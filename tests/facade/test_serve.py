"""`onceflow serve` driven from other processes over the socket with raw JSON.

The server runs as a subprocess (`python -m onceflow.cli serve`); clients are
tests/facade/wire_client.py, which imports nothing of onceflow (it also runs as its own `python -I` process).
The wire format is in onceflow/serve/__init__.py's docstring.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import os
import pty
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import TESTS, register
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs
from wire_client import WireClient

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.limits import MAX_MESSAGE_BYTES, MAX_TEMPLATE_BYTES
from onceflow.serve import ServeOptions, Server
from onceflow.serve.connection import Connection
from onceflow.serve.server import accept_clients
from onceflow.serve.wire import HEAD_BYTES, LineReader, Overlong, Request, head_fields, split_request

WORKFLOW = TESTS / "fixtures" / "workflows" / "minimal.yml"
CLIENT = Path(__file__).with_name("wire_client.py")


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    socket: Path
    db: Path
    log: list[str] = field(default_factory=list)  # the server's stderr lines but `serving on`

    def client(self) -> WireClient:
        return WireClient(str(self.socket))

    def stop(self, signum: int = signal.SIGTERM) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=30)

    def wait_log(self, fragment: str, timeout: float = 30.0) -> str:
        """The first stderr line holding `fragment`, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.log if fragment in line]
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"the server never logged {fragment!r}: {self.log}")

    def rss(self) -> int:
        """The server's resident memory, in bytes."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def _start(
    db: Path,
    where: list[str],
    *extra: str,
    workflow: Path = WORKFLOW,
    verbose: bool = False,
    nofile: tuple[int, int] | None = None,
) -> subprocess.Popen[bytes]:
    """`onceflow serve` in a process of its own; `nofile`: its RLIMIT_NOFILE (soft, hard) from the start."""
    command = [sys.executable, "-m", "onceflow.cli", *(["--verbose"] if verbose else []), "serve"]
    command += ["--db", str(db), "--workflow", str(workflow)]
    limit = None if nofile is None else functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, nofile)
    return subprocess.Popen(
        [*command, *where, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # unbuffered: `_wait_ready`'s select sees every line not yet read
        preexec_fn=limit,
    )


def _wait_ready(
    process: subprocess.Popen[bytes], timeout: float = 30.0, seen: list[str] | None = None
) -> str:
    """Wait for the server's one `serving on ...` line on stderr; the lines before it go to `seen`."""
    assert process.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stderr], [], [], 0.1)
        if ready:
            line = process.stderr.readline().decode()
            assert line, f"server exited before serving (status {process.wait()})"
            if line.startswith("serving on "):
                return line.strip()
            if seen is not None:
                seen.append(line)
    raise AssertionError("server did not start")


def _drain(stream: Any, lines: list[str]) -> None:
    """Keep reading the server's stderr (a full pipe would stall its logging), line by line."""
    for raw in iter(stream.readline, b""):
        lines.append(raw.decode(errors="replace"))


@contextmanager
def serving(
    *extra: str, workflow: Path = WORKFLOW, verbose: bool = False, nofile: tuple[int, int] | None = None
) -> Iterator[Served]:
    """A server on a socket in a short temp dir (a socket path is limited to ~107 bytes); `verbose`, `nofile`
    as for `_start`. Its stderr lines, from the start, are in `Served.log`."""
    folder = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    where = ["--socket", str(folder / "s.sock")]
    served = Served(
        _start(folder / "board.db", where, *extra, workflow=workflow, verbose=verbose, nofile=nofile),
        folder / "s.sock",
        folder / "board.db",
    )
    try:
        assert _wait_ready(served.process, seen=served.log) == f"serving on {served.socket}"
        threading.Thread(target=_drain, args=(served.process.stderr, served.log), daemon=True).start()
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


def test_serve_concurrent_clients_in_separate_processes_each_get_their_replies_by_id() -> None:
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


def test_serve_reply_echoes_string_and_int64_ids_and_refuses_bad_ones() -> None:
    with serving() as served:
        client = served.client()
        assert client.request({"id": "req-1", **_create("T1")})["id"] == "req-1"
        assert client.request({"id": 2**63 - 1, "type": "get_task", "task_id": "T1"})["id"] == 2**63 - 1
        assert client.request({"id": None, "type": "get_task", "task_id": "T1"})["id"] is None
        assert client.request({"type": "get_task", "task_id": "T1"})["id"] is None
        echoes = {
            2**63: "9223372036854775808",
            2**64: "18446744073709551616",
            True: "true",
            1.5: "1.5",
            "x" * 257: "x" * 257,
        }
        for bad, echoed in [*echoes.items(), ([1, "a"], '[1,"a"]'), ({"n": 1}, '{"n":1}')]:
            frame = client.request({"id": bad, **_create("T-bad")})
            assert frame["id"] == echoed  # what was sent, as a string the client can match
            reply = frame["reply"]
            assert (reply["command"], reply["error"]["code"], reply["error"]["field"]) == (
                "create_task",
                "invalid_message",
                "id",
            )
        assert _step_of(client, "T-bad") is None  # a refused id never ran its command


def test_serve_subscribe_streams_every_event_as_event_lines_with_increasing_seqs() -> None:
    with serving() as served:
        watcher, worker = served.client(), served.client()
        subscribed = watcher.request({"id": "s", "type": "subscribe"})
        start = subscribed["reply"]["result"]["next_event_seq"]
        assert subscribed["reply"] == {
            "type": "reply",
            "command": "subscribe",
            "ok": True,
            "result": {"subscribed": True, "next_event_seq": start},
            "error": None,
            "events": [],
        }
        created = worker.request(_create("T1"))["reply"]
        moved = worker.request({"type": "move_task", "task_id": "T1", "step_id": "work"})["reply"]
        expected = created["events"] + moved["events"]  # the same models the replies carry
        seen, seqs = [], []
        while len(seen) < len(expected):
            frame = watcher.line()
            assert frame is not None and set(frame) == {"event_seq", "event"}, frame
            seen.append(frame["event"])
            seqs.append(frame["event_seq"])
        assert seen == expected
        assert {"task_created", "transition", "step_entered"} <= {e["type"] for e in seen}
        assert seqs == list(range(start, start + len(seqs)))  # within a block, one after another
        again = watcher.request({"id": "again", "type": "subscribe"})["reply"]
        assert (again["ok"], again["error"]["code"]) == (False, "conflict")


def test_serve_malformed_lines_get_typed_errors_and_the_connection_stays_usable() -> None:
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
        assert overlong["id"] == 3 and "longer than 2000 bytes" in overlong["reply"]["error"]["message"]
        assert overlong["reply"]["command"] == "get_task"
        assert client.request({"id": 4, **_create("T1")})["reply"]["ok"]
        assert _step_of(client, "T1") == "todo"


def test_serve_slow_reader_is_disconnected_with_an_error_line_and_never_blocks_others() -> None:
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


def test_serve_client_disconnecting_mid_command_loses_nothing_it_sent() -> None:
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
def test_serve_signal_drains_in_flight_commands_removes_socket_and_exits_0(signum: int) -> None:
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


def test_serve_stdio_answers_each_line_and_exits_0_at_end_of_input(tmp_path: Path) -> None:
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


def test_serve_refuses_a_live_socket_or_an_owned_database_with_one_error_line() -> None:
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


def test_split_request_strips_the_id_before_the_command_is_decoded() -> None:
    request = split_request(b'{"id": 7, "type": "get_task", "task_id": "T1"}')
    assert request == Request(7, {"type": "get_task", "task_id": "T1"})
    plain = b'{"type": "get_task", "task_id": "T1"}'
    assert split_request(plain) == Request(None, {"type": "get_task", "task_id": "T1"})


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=50), max_size=20),
)
def test_line_reader_splits_any_chunking_and_skips_overlong_lines(
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
        reader, out = LineReader(Chunks(), max_line=20), []
        while (line := await reader.receive_line()) is not None:
            out.append(line)
        return out

    assert trio.run(read_all) == [Overlong(line[:HEAD_BYTES]) if len(line) > 20 else line for line in lines]


def test_readme_serving_example_runs_as_written(tmp_path: Path) -> None:
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


def test_serve_replaces_a_stale_socket_file_and_creates_it_owner_only() -> None:
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
def test_serve_refuses_a_bad_switch_interval_naming_the_flag(tmp_path: Path, bad: str) -> None:
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


# --- wire edges: the command a refusal names, the line limit -------------------------------------------


def test_serve_refusals_name_the_command_type_whenever_it_was_read() -> None:
    with serving() as served:
        client = served.client()
        bad_field = client.request({"id": 1, **_create("T1", priority="urgent")})["reply"]
        assert (bad_field["command"], bad_field["error"]["field"]) == ("create_task", "priority")
        unknown = client.request({"id": 2, "type": "launch_rockets"})["reply"]
        assert (unknown["command"], unknown["error"]["field"]) == ("launch_rockets", "type")
        missing = client.request({"id": 3, "type": "get_task"})["reply"]
        assert (missing["command"], missing["error"]["field"]) == ("get_task", "task_id")
        for not_a_name in ({"id": 4, "type": 7}, {"id": 5, "type": "t" * 257}, {"id": 6}, [1, 2]):
            assert client.request(not_a_name)["reply"]["command"] == "unknown"  # type: ignore[arg-type]
        client.write(b"not json\n")
        assert client.reply()["reply"]["command"] == "unknown"


def test_serve_reads_any_line_the_protocol_accepts_a_maximal_template_registration() -> None:
    """serve's default line limit is the protocol's message limit: a template near its byte cap, of
    non-ASCII text that JSON escapes six bytes a character of two, is one line of ~3 times the cap, and it
    registers."""
    assert ServeOptions().max_line == MAX_MESSAGE_BYTES
    text = WORKFLOW.read_text(encoding="utf-8").replace("id: fixture", "id: wide", 1)
    text += "# " + "é" * ((MAX_TEMPLATE_BYTES - len(text.encode()) - 3) // 2) + "\n"
    assert MAX_TEMPLATE_BYTES - 2 <= len(text.encode()) <= MAX_TEMPLATE_BYTES
    line = json.dumps({"id": "wide", "type": "register_workflow", "yaml": text}).encode() + b"\n"
    assert MAX_MESSAGE_BYTES > len(line) > 2.9 * MAX_TEMPLATE_BYTES
    with serving() as served:
        client = served.client()
        client.write(line)
        frame = client.reply()
        assert (frame["id"], frame["reply"]["ok"]) == ("wide", True), frame["reply"]["error"]
        client.write(b'{"id": "big", "type": "get_task", "task_id": "' + b"x" * MAX_MESSAGE_BYTES + b'"}\n')
        overlong = client.reply()
        assert (overlong["id"], overlong["reply"]["command"]) == ("big", "get_task")
        assert f"longer than {MAX_MESSAGE_BYTES} bytes" in overlong["reply"]["error"]["message"]
        created = client.request({"id": 1, "type": "create_task", "task_id": "W1", "workflow_id": "wide"})
        assert created["reply"]["ok"]


# --- outgoing bytes are bounded ---------------------------------------------------------------------------

BIG_RUNS = """\
id: fixture
name: Big runs
steps:
  - id: todo
    name: Todo
    position: 0
    is_start_step: true
  - id: work
    name: Work
    position: 1
    events:
      on_enter:
        - type: queue_run
          config:
            payload:
              blob: {blob}
"""


def test_serve_never_reading_client_is_dropped_near_queue_bytes_and_others_keep_being_served(
    tmp_path: Path,
) -> None:
    """Each list_runs reply here is ~1.2 MB (40 runs with a 30 KB payload each). A client that pipelines
    200 of them and never reads would have 240 MB queued for it under the line bound alone; the byte
    bound drops it once 4 MiB wait, the server's memory stays flat, and a reading client is served all
    along."""
    workflow = tmp_path / "big.yml"
    workflow.write_text(BIG_RUNS.format(blob="x" * 30_000), encoding="utf-8")
    limit = 4 << 20
    with serving("--queue-bytes", str(limit), "--grace", "60", workflow=workflow) as served:
        fast = served.client()
        for n in range(40):
            assert fast.request(_create(f"T{n}", primary_agent_id="agent"))["reply"]["ok"]
            assert fast.request({"type": "move_task", "task_id": f"T{n}", "step_id": "work"})["reply"]["ok"]
        runs = fast.request({"type": "list_runs"})
        reply_bytes = len(json.dumps(runs))
        assert len(runs["reply"]["result"]["runs"]) == 40 and reply_bytes > 1_000_000
        baseline = served.rss()

        slow = served.client()
        slow.write(*[{"id": n, "type": "list_runs"} for n in range(200)])  # and reads nothing, for now
        dropped = served.wait_log("client_disconnected", timeout=60)
        assert "code=slow_consumer" in dropped
        peak = int(re.search(r"peak_queued_bytes=(\d+)", dropped).group(1))  # type: ignore[union-attr]
        assert limit - reply_bytes < peak <= limit  # held about the limit, never more
        for n in range(40, 45):  # served meanwhile, and after
            assert fast.request(_create(f"T{n}"))["reply"]["ok"]
            assert fast.request({"type": "list_runs", "task_id": "T0"})["reply"]["ok"]
        assert served.rss() - baseline < 64 << 20

        frames = []
        while (frame := slow.line()) is not None:  # the slow client reads at last: queue, error, EOF
            frames.append(frame)
        assert frames[-1]["error"]["code"] == "slow_consumer"
        assert [f["id"] for f in frames[:-1]] == list(range(len(frames) - 1))
        assert 0 < len(frames) - 1 <= limit // reply_bytes + 1


def test_serve_a_single_reply_larger_than_queue_bytes_makes_a_slow_consumer(tmp_path: Path) -> None:
    workflow = tmp_path / "big.yml"
    workflow.write_text(BIG_RUNS.format(blob="x" * 30_000), encoding="utf-8")
    with serving("--queue-bytes", "20000", workflow=workflow) as served:
        client = served.client()
        assert client.request(_create("T1", primary_agent_id="agent"))["reply"]["ok"]
        assert client.request({"type": "move_task", "task_id": "T1", "step_id": "work"})["reply"]["ok"]
        client.write({"id": "runs", "type": "list_runs"})  # ~30 KB: more than the whole queue may hold
        error = client.line()
        assert error is not None and error["error"]["code"] == "slow_consumer"
        assert "the limit is 20000" in error["error"]["message"]
        assert client.line() is None
        assert served.client().request({"type": "get_task", "task_id": "T1"})["reply"]["ok"]


# --- bounded clients: a connection cap, eviction, an idle timeout, refusing on EMFILE -----------------------


def _within_a_second(connect: Callable[[], WireClient]) -> tuple[WireClient, dict[str, Any] | None]:
    """A new client and its first line, which must arrive within one second of connecting."""
    began = time.monotonic()
    client = connect()
    client.sock.settimeout(1.0)
    first = client.line()
    assert time.monotonic() - began < 1.0
    return client, first


def test_serve_at_the_cap_a_new_client_evicts_the_longest_idle_never_a_busy_one() -> None:
    """A 3-connection cap: a subscriber (busy, and the oldest), then two idle clients. Each new client is
    served at once, the longest-idle connection being closed for it with one retryable `evicted` line; once
    every connection is busy (subscribed), a new client gets one `busy` line within a second instead. The
    subscriber is never evicted, and the whole episode logs one WARNING."""
    with serving("--max-connections", "3", "--idle-timeout", "0") as served:
        watcher = served.client()
        assert watcher.request({"id": "w", "type": "subscribe"})["reply"]["ok"]
        idle = [served.client() for _ in range(2)]
        for n, client in enumerate(idle):
            assert client.request({"id": n, "type": "get_task", "task_id": "none"})["id"] == n
            time.sleep(0.05)  # idle[0] has been idle the longest
        newcomers = []
        for n, evicted in enumerate(idle):
            began = time.monotonic()
            newcomer = served.client()
            newcomer.sock.settimeout(1.0)
            assert newcomer.request({"id": f"new{n}", "type": "subscribe"})["reply"]["ok"]
            assert time.monotonic() - began < 1.0
            newcomers.append(newcomer)
            closing = evicted.line()
            assert closing is not None and set(closing) == {"error"}
            assert (closing["error"]["code"], closing["error"]["retryable"]) == ("evicted", True)
            assert "3 connections" in closing["error"]["message"]
            assert evicted.line() is None  # then closed
        over, refused = _within_a_second(served.client)
        assert refused is not None and (refused["error"]["code"], refused["error"]["retryable"]) == (
            "busy",
            True,
        )
        assert "3 connections" in refused["error"]["message"]
        assert over.line() is None
        frame = newcomers[0].request({"id": "c", **_create("T1")})  # the subscribers still served, all told
        assert frame["reply"]["ok"]
        for subscriber in [watcher, newcomers[1]]:
            event = subscriber.line()
            assert event is not None and event["event"]["type"] == "task_created"
        assert len([line for line in served.log if "connections_at_cap" in line]) == 1
        assert not [line for line in served.log if "client_disconnected" in line]  # evictions: INFO


def settled_descriptors(pid: int) -> set[int]:
    """The descriptor numbers the process has open, once they have stood still for 0.2 s (a server still
    finishing its start-up under load may open and close some: numbers read meanwhile would shift)."""
    used: set[int] = set()
    for _ in range(50):
        seen, used = used, {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        if seen == used:
            break
        time.sleep(0.2)
    return used


def _free_fds(pid: int, count: int) -> list[int]:
    """The `count` lowest descriptor numbers the process has free (`settled_descriptors`)."""
    used = settled_descriptors(pid)
    return list(itertools.islice((n for n in itertools.count() if n not in used), count))


def test_serve_out_of_file_descriptors_tells_each_waiting_client_busy_and_serves_the_others() -> None:
    """The server's RLIMIT_NOFILE is lowered (prlimit) so that two clients take its last descriptors: each
    client after them, for whom accept fails with EMFILE, still gets one retryable `busy` line within a
    second (the server's spare descriptor answers it) instead of waiting in the backlog; the first two are
    served throughout, one WARNING covers the episode, and accepting never pauses. With its limit
    restored, a new client is served again."""
    with serving("--idle-timeout", "0") as served:
        pid = served.process.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_free_fds(pid, 3)[2], hard))
        first = [served.client() for _ in range(2)]
        for n, client in enumerate(first):
            assert client.request({"id": n, "type": "get_task", "task_id": "none"})["id"] == n
        for _ in range(3):
            late, refused = _within_a_second(served.client)
            assert refused is not None and set(refused) == {"error"}
            assert (refused["error"]["code"], refused["error"]["retryable"]) == ("busy", True)
            assert (
                "no file descriptor" in refused["error"]["message"]
                and "EMFILE" in refused["error"]["message"]
            )
            assert late.line() is None
        for n, client in enumerate(first):  # connected clients are served throughout
            assert client.request({"id": n, "type": "get_task", "task_id": "none"})["id"] == n
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert served.client().request({"id": "after", **_create("T1")})["reply"]["ok"]
        warnings = [line for line in served.log if "accept_out_of_descriptors" in line]
        assert len(warnings) == 1 and "errno=EMFILE" in warnings[0]
        assert not [line for line in served.log if "accept_paused" in line]
        assert not [line for line in served.log if "Traceback" in line or "[error" in line]


# --- in process: the idle timeout and accept pausing on the Trio clock (MockClock), real sockets -------


class Peer:
    """The client end of a socketpair, non-blocking: what arrived can be looked at without waiting."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock, self._buffer = sock, b""

    def send(self, *requests: dict[str, Any] | bytes) -> None:
        self.sock.sendall(
            b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in requests)
        )

    def _fill(self) -> bool:
        """Take what arrived; False at end of stream."""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self._buffer += chunk

    def arrived(self) -> list[dict[str, Any]]:
        """The whole lines that arrived so far, without waiting."""
        self._fill()
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines]

    async def line(self) -> dict[str, Any] | None:
        """The next line, waiting for it; None at end of stream."""
        while b"\n" not in self._buffer:
            if not self._fill():
                return None
            if b"\n" not in self._buffer:
                await trio.lowlevel.wait_readable(self.sock)
        raw, self._buffer = self._buffer.split(b"\n", 1)
        value: dict[str, Any] = json.loads(raw)
        return value


@asynccontextmanager
async def served_in_process(
    db: Path, options: ServeOptions
) -> AsyncIterator[tuple[Runtime, Server, Callable[[], Peer]]]:
    """A Server on a real runtime (both yielded); `connect()` hands it one end of a real socketpair."""
    peers: list[Peer] = []
    async with open_runtime(db) as rt:
        await register(rt, WORKFLOW.read_text(encoding="utf-8"))
        async with trio.open_nursery() as commands:
            server = Server(rt, commands, options)
            async with trio.open_nursery() as connections:

                def connect() -> Peer:
                    ours, theirs = socket.socketpair()
                    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
                    connections.start_soon(server.handle, stream)
                    peers.append(Peer(theirs))
                    return peers[-1]

                yield rt, server, connect
                for peer in peers:
                    peer.sock.close()
                server.stop()


async def elapse(clock: trio.testing.MockClock, seconds: float) -> None:
    await trio.testing.wait_all_tasks_blocked()
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()


async def test_serve_idle_timeout_counts_from_the_last_activity_and_spares_subscribers(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with served_in_process(tmp_path / "b.db", ServeOptions(idle_timeout=10, grace=1)) as (
        _,
        _,
        connect,
    ):
        quiet, chatty, watcher = connect(), connect(), connect()
        chatty.send({"id": 1, "type": "get_task", "task_id": "none"})
        assert (await chatty.line() or {})["id"] == 1
        watcher.send({"id": "s", "type": "subscribe"})
        assert (await watcher.line() or {})["reply"]["ok"]

        await elapse(mock_clock, 6)
        chatty.send(b"\n")  # a blank line is activity too: its idle time starts again
        await elapse(mock_clock, 3.9)
        assert quiet.arrived() == [] and chatty.arrived() == []  # 9.9 s idle: still open
        await elapse(mock_clock, 0.2)
        (closing,) = quiet.arrived()
        assert closing["error"]["code"] == "idle_timeout" and "10 seconds" in closing["error"]["message"]
        assert await quiet.line() is None  # then closed
        assert chatty.arrived() == []
        await elapse(mock_clock, 6)
        assert [frame["error"]["code"] for frame in chatty.arrived()] == ["idle_timeout"]

        await elapse(mock_clock, 1000)
        assert watcher.arrived() == []  # a subscriber waits for events, never idle
        worker = connect()
        worker.send({"id": "c", **_create("T1")})
        assert (await worker.line() or {})["reply"]["ok"]
        event = await watcher.line()
        assert event is not None and event["event"]["type"] == "task_created"


class _FlakyListener(trio.abc.Listener[trio.SocketStream]):
    """The accept seam: each item of `script` is an errno to fail with, or a stream to return; then it
    waits forever. Records the Trio time of every call."""

    def __init__(self, script: list[int | trio.SocketStream]) -> None:
        self.script, self.calls = script, list[float]()

    async def accept(self) -> trio.SocketStream:
        self.calls.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if not self.script:
            await trio.sleep_forever()
        step = self.script.pop(0)
        if isinstance(step, int):
            raise OSError(step, os.strerror(step))
        return step

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_serve_accept_pauses_grow_to_a_bound_with_one_warning_per_episode(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A shortage of memory (ENOBUFS, ENOMEM) injected at the accept seam: the pauses double from 10 ms to
    1 s and stay there; each episode logs one WARNING (then one INFO when an accept succeeds); the streams
    accepted between the failures are served."""
    options = ServeOptions(idle_timeout=0)  # the autojump clock would time idle clients out at once
    async with served_in_process(tmp_path / "b.db", options) as (_, server, _):
        ours = [socket.socketpair() for _ in range(2)]
        streams = [trio.SocketStream(trio.socket.from_stdlib_socket(a)) for a, _ in ours]
        listener = _FlakyListener([*[errno.ENOBUFS] * 9, streams[0], errno.ENOMEM, errno.ENOBUFS, streams[1]])
        accepting = trio.CancelScope()
        with capture_logs() as logs:
            async with trio.open_nursery() as connections:
                connections.start_soon(accept_clients, server, listener, accepting, connections)
                for _, theirs in ours:
                    peer = Peer(theirs)
                    peer.send({"id": "p", "type": "get_task", "task_id": "none"})
                    assert (await peer.line() or {})["id"] == "p"
                    peer.sock.close()
                accepting.cancel()
        gaps = [round(b - a, 6) for a, b in itertools.pairwise(listener.calls)]
        assert gaps[:10] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0, 0.0]
        assert gaps[10:13] == [0.01, 0.02, 0.0]  # the second episode starts again from 10 ms
        episodes = [(e["event"], e.get("errno"), e.get("retries")) for e in logs if "accept" in e["event"]]
        assert episodes == [
            ("accept_paused", "ENOBUFS", None),
            ("accept_resumed", None, 9),
            ("accept_paused", "ENOMEM", None),
            ("accept_resumed", None, 2),
        ]
        assert [e["log_level"] for e in logs if e["event"] == "accept_paused"] == ["warning", "warning"]


async def test_serve_accept_out_of_descriptors_takes_the_next_client_in_the_spare_descriptors_place(
    tmp_path: Path,
) -> None:
    """EMFILE injected at the accept seam, twice: the spare descriptor is closed and the next client accepted
    in its place; a descriptor being free again by then (the spare is held again), that client is served,
    with no pause and no refusal. When the accept in the spare's place fails too (another thread took the
    descriptor), accepting pauses as for a memory shortage. The spare is held throughout and closed at the
    end: the process ends with the descriptors it began with. (Refusals: the subprocess test above.)"""
    options = ServeOptions(idle_timeout=0)
    async with served_in_process(tmp_path / "b.db", options) as (_, server, _):
        pairs = [socket.socketpair() for _ in range(2)]
        streams = [trio.SocketStream(trio.socket.from_stdlib_socket(a)) for a, _ in pairs]
        listener = _FlakyListener([errno.EMFILE, streams[0], errno.ENFILE, errno.EMFILE, streams[1]])
        accepting = trio.CancelScope()
        before = len(os.listdir("/proc/self/fd"))
        with capture_logs() as logs:
            async with trio.open_nursery() as connections:
                connections.start_soon(accept_clients, server, listener, accepting, connections)
                for _, theirs in pairs:
                    peer = Peer(theirs)
                    peer.send({"id": "p", "type": "get_task", "task_id": "none"})
                    assert (await peer.line() or {})["id"] == "p"
                    peer.sock.close()
                accepting.cancel()
        assert len(os.listdir("/proc/self/fd")) == before - 4  # both ends of both pairs; the spare too
        seen = [(e["event"], e.get("errno"), e.get("retries")) for e in logs if "accept" in e["event"]]
        assert seen == [("accept_paused", "EMFILE", None), ("accept_resumed", None, 1)]
        assert listener.calls[4] - listener.calls[3] >= 0.01  # the one pause


def _stderr_of_serve(db: Path, *, tty: bool, env: dict[str, str] | None = None) -> bytes:
    """The stderr of a --verbose `serve --stdio` run on empty input: a pipe, or a terminal (a pty)."""
    command = [sys.executable, "-m", "onceflow.cli", "--verbose", "serve", "--db", str(db), "--stdio"]
    environment = {**os.environ, **(env or {})}
    if not tty:
        return subprocess.run(command, input=b"", capture_output=True, timeout=60, env=environment).stderr
    controller, terminal = pty.openpty()
    try:
        subprocess.run(
            command, input=b"", stdout=subprocess.DEVNULL, stderr=terminal, timeout=60, env=environment
        )
    finally:
        os.close(terminal)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once everything written was read
        while chunk := os.read(controller, 65536):
            seen += chunk
    os.close(controller)
    return seen


def test_serve_logs_carry_no_colour_codes_unless_stderr_is_a_terminal(tmp_path: Path) -> None:
    piped = _stderr_of_serve(tmp_path / "a.db", tty=False)
    assert b"store_opened" in piped and b"\x1b[" not in piped
    terminal = _stderr_of_serve(tmp_path / "b.db", tty=True)
    assert b"store_opened" in terminal and b"\x1b[" in terminal
    no_color = _stderr_of_serve(tmp_path / "c.db", tty=True, env={"NO_COLOR": "1"})
    assert b"store_opened" in no_color and b"\x1b[" not in no_color


async def test_serve_pipeline_holds_at_most_max_line_received_bytes(
    tmp_path: Path, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Received lines wait their turn up to `max_line` bytes in all (one line always fits), whatever the
    line count allows: a client pipelining big lines is read no faster than they are applied."""
    held: list[int] = []
    admit = Connection.admit

    async def recorded(conn: Connection, size: int) -> None:
        await admit(conn, size)
        held.append(conn.pending_bytes)  # what the server holds of this client's lines, each admission

    monkeypatch.setattr(Connection, "admit", recorded)
    options = ServeOptions(max_line=10_000, max_pipeline=64, idle_timeout=0)
    async with served_in_process(tmp_path / "b.db", options) as (_, _, connect):
        peer = connect()
        padding = " " * 3_000  # JSON allows it: each line ~3 KB, 3 fit in 10 KB
        lines = [
            f'{{"id": {n}, "type": "get_task", "task_id": "none"{padding}}}\n'.encode() for n in range(40)
        ]
        peer.send(*lines)
        seen = []
        while len(seen) < 40:
            frame = await peer.line()
            assert frame is not None
            seen.append(frame["id"])
        assert seen == list(range(40))
    assert len(held) == 40
    assert max(held) <= options.max_line
    assert max(held) > len(lines[0])  # still pipelined: lines wait while one runs


def test_serve_stdio_client_is_never_timed_out_as_idle(tmp_path: Path) -> None:
    """Over --stdio the one client's end ends the server, so a quiet host is never closed as idle."""
    process = _start(tmp_path / "s.db", ["--stdio"], "--idle-timeout", "0.2")
    assert process.stdin is not None and process.stdout is not None
    try:
        _wait_ready(process)
        process.stdin.write(json.dumps({"id": 1, **_create("T1")}).encode() + b"\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline())["id"] == 1
        time.sleep(1.0)  # five idle timeouts
        process.stdin.write(json.dumps({"id": 2, "type": "get_task", "task_id": "T1"}).encode() + b"\n")
        process.stdin.close()
        frame = json.loads(process.stdout.readline())
        assert (frame["id"], frame["reply"]["ok"]) == (2, True)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_lines_it_cannot_read_whole_still_echo_the_id_they_began_with() -> None:
    """An overlong line or one that is not JSON is answered with the id (and names the command) found at
    its start; a bad id there is echoed as its text, as for a readable line; never null for a line that
    had one."""
    with serving("--max-line", "2000") as served:
        client = served.client()
        pad = b"x" * 3000
        cases = [
            (b'{"id": "r-1", "type": "get_task", "task_id": "' + pad + b'"}', "r-1", "get_task"),
            (b'{"type": "create_task", "id": 7, "title": "' + pad + b'"}', 7, "create_task"),
            (b'{"id": 1.5, "type": "get_task", "task_id": "' + pad + b'"}', "1.5", "get_task"),
            (b'{"id": ' + str(2**64).encode() + b', "type": "get_task", "x": "' + pad + b'"}',
             str(2**64), "get_task"),
            (b'{"id": [1, "a"], "type": "move_task", "x": "' + pad + b'"}', '[1,"a"]', "move_task"),
            (b'{"id": {"n": 1}, "type": "move_task", "x": "' + pad + b'"}', '{"n":1}', "move_task"),
            (b'{"id": "r-2", "type": "get_task", "task_id": }', "r-2", "get_task"),  # not JSON
            (b'{"id": 9, "type": "launch_rockets", ', 9, "launch_rockets"),  # cut off
            (b'{"task_id": "' + pad * 2 + b'", "id": 3}', None, "unknown"),  # its id past the 4 KiB scanned
        ]  # fmt: skip
        for line, expected_id, command in cases:
            client.write(line + b"\n")
            frame = client.reply()
            assert (frame["id"], frame["reply"]["command"]) == (expected_id, command), line[:40]
            assert frame["reply"]["error"]["code"] == "invalid_message"
        assert client.request({"id": 4, **_create("T1")})["reply"]["ok"]  # the connection still serves


def test_serve_head_fields_reads_only_complete_top_level_members() -> None:
    missing = head_fields(b"")[0]
    assert head_fields(b'{"id": 5, "type": "get_task", "task_id": "T') == (5, "get_task")
    assert head_fields(b'{"a": {"id": 1, "type": "x"}, "id": 2}') == (2, missing)  # a nested id is not it
    assert head_fields(b'{"id": "a\\"b", "type"') == ('a"b', missing)
    assert head_fields(b"[1, 2]") == (missing, missing)
    assert head_fields(b'{"type": "get_task", "id": "r-') == (missing, "get_task")  # cut off mid-value
    assert head_fields(b'{"id": ' + b"[" * 10_000) == (missing, missing)  # deep nesting: no recursion error


def test_serve_line_limit_is_at_most_the_message_limit() -> None:
    """One limit, owned by protocol.limits: serve never reads a line the runtime refuses for its size."""
    with pytest.raises(ValueError, match="max_line"):
        ServeOptions(max_line=MAX_MESSAGE_BYTES + 1)
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "serve", "--db", "x.db", "--stdio", "--max-line",
         str(MAX_MESSAGE_BYTES + 1)],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and b"at most the message limit" in done.stderr
