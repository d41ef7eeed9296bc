"""Host calls over `onceflow serve`'s host role against an in-process host.

Run: python bench/hosts.py [-n 1000] [-c 64] [-l 300] [--rounds 3]

Every task is moved into a step whose on_enter declares one session action (`auto_start_agent`), so each
move is one step entry and one host call. Three setups, interleaved round by round (inproc, serve without a
host, serve with a host, then the next round), each on a fresh SQLite file:

- `inproc`: `open_runtime` in this process with an in-process host that does nothing (the call is an await);
- `serve`: `onceflow serve` in its own process, the moves sent over its socket; no host registered, so
  session actions get the default answer (no call leaves the server);
- `serve+host`: the same server with one host process (a remote host, as in any language: standard library
  only, a blocking loop) registered for `session_action`, answering every call as soon as it reads it.

Per setup: latency, one move at a time (`-l` moves, one client): the median of the time from sending a
move to its reply; throughput, `-n` moves from `-c` concurrent tasks (in process) or connections (over the
socket), in session actions per second. Then the two targets: the median latency a host call over the
socket adds to a dispatch (`serve+host` minus `serve`, ms; target at most 1 ms) and `serve+host`'s session
actions per second as a multiple of `inproc`'s (target at least 0.5x), medians over the rounds.

Checks (exit 1 on a violation): every move's reply is ok and carries one `session_action` event; with a
host, every call is answered once (`list_host_calls`: one `answered` record per task, none other).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
import trio

from onceflow.actors.runtime.startup import SWITCH_INTERVAL, open_runtime
from onceflow.protocol.host import BaseHost

WORKFLOW = """\
id: hosts
name: Hosts
steps:
  - id: todo
    name: Todo
    position: 0
    is_start_step: true
  - id: act
    name: Act
    position: 1
    events:
      on_enter:
        - type: auto_start_agent
"""


HOST = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.sendall(b'{"type": "register_host", "capabilities": ["session_action"]}\\n')
reader = sock.makefile("rb")
json.loads(reader.readline())
print("registered", flush=True)
for line in reader:
    frame = json.loads(line)
    if "call" in frame:
        answer = {"type": "host_reply", "call_id": frame["call"]["call_id"], "ok": True}
        sock.sendall(json.dumps(answer).encode() + b"\\n")
"""
"""The remote host: registers for session_action, answers each call at once (replies to its answers are
read and dropped)."""


def _create(task: str) -> dict[str, Any]:
    return {"type": "create_task", "task_id": task, "workflow_id": "hosts", "session_id": f"s-{task}"}


def _move(task: str) -> dict[str, Any]:
    return {"type": "move_task", "task_id": task, "step_id": "act"}


def _check(reply: dict[str, Any]) -> None:
    if not reply["ok"] or [e["type"] for e in reply["events"]].count("session_action") != 1:
        print(f"VIOLATION: a move's reply: {json.dumps(reply)[:400]}")
        sys.exit(1)


class Line:
    """A JSON-lines connection to the server's socket."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buffer = stream, b""

    @classmethod
    async def open(cls, path: Path) -> Line:
        return cls(await trio.open_unix_socket(str(path)))

    async def send(self, message: dict[str, Any]) -> None:
        await self.stream.send_all(json.dumps(message).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError("the server closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        frame: dict[str, Any] = json.loads(line)
        return frame

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.send(message)
        frame = await self.receive()
        reply: dict[str, Any] = frame["reply"]
        return reply


async def _latency(send: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], tasks: list[str]) -> float:
    """Median seconds from a move's send to its reply, one move at a time."""
    samples = []
    for task in tasks:
        began = time.perf_counter()
        reply = await send(_move(task))
        samples.append(time.perf_counter() - began)
        _check(reply)
    return statistics.median(samples)


async def _throughput(
    sends: list[Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]], tasks: list[str]
) -> float:
    """Session actions per second, the moves spread over the concurrent senders."""

    async def mover(send: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], mine: list[str]) -> None:
        for task in mine:
            _check(await send(_move(task)))

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k, send in enumerate(sends):
            nursery.start_soon(mover, send, tasks[k :: len(sends)])
    return len(tasks) / (time.perf_counter() - began)


async def inproc(folder: Path, n: int, c: int, l_moves: int) -> tuple[float, float]:
    """(median latency seconds, session actions per second) with an in-process host."""
    async with open_runtime(folder / "inproc.db", host=BaseHost(), switch_interval=SWITCH_INTERVAL) as rt:

        async def send(message: dict[str, Any]) -> dict[str, Any]:
            reply = await rt.send(message)
            return json.loads(reply.model_dump_json())  # type: ignore[no-any-return]

        await send({"type": "register_workflow", "yaml": WORKFLOW})
        names = [f"T{i}" for i in range(l_moves + n)]
        for task in names:
            await send(_create(task))
        latency = await _latency(send, names[:l_moves])
        rate = await _throughput([send] * c, names[l_moves:])
    return latency, rate


async def served(folder: Path, n: int, c: int, l_moves: int, *, host: bool) -> tuple[float, float]:
    """(median latency seconds, session actions per second) over `onceflow serve`, with or without a host
    connection answering the calls."""
    name = "host" if host else "nohost"
    workflow, socket = folder / f"{name}.yml", folder / f"{name}.sock"
    workflow.write_text(WORKFLOW)
    command = [sys.executable, "-m", "onceflow.cli", "serve", "--db", str(folder / f"{name}.db")]
    command += ["--workflow", str(workflow), "--socket", str(socket)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        assert server.stderr is not None
        while not server.stderr.readline().startswith(b"serving on"):
            if server.poll() is not None:
                raise RuntimeError("onceflow serve did not start")
        async with trio.open_nursery() as nursery:
            answering = None
            if host:
                answering = subprocess.Popen(
                    [sys.executable, "-I", "-c", HOST, str(socket)], stdout=subprocess.PIPE
                )
                assert answering.stdout is not None and answering.stdout.readline() == b"registered\n"
            lines = [await Line.open(socket) for _ in range(c)]
            names = [f"T{i}" for i in range(l_moves + n)]
            for k, task in enumerate(names):
                await lines[k % c].request(_create(task))
            latency = await _latency(lines[0].request, names[:l_moves])
            rate = await _throughput([line.request for line in lines], names[l_moves:])
            if host:
                calls, after = [], None
                while True:
                    page = await lines[0].request(
                        {"type": "list_host_calls", "after_id": after, "limit": 1000}
                    )
                    calls += page["result"]["calls"]
                    if (after := page["result"]["next_after_id"]) is None:
                        break
                statuses = {call["status"] for call in calls}
                if len(calls) != len(names) or statuses != {"answered"}:
                    print(f"VIOLATION: {len(calls)} calls recorded ({statuses}), {len(names)} moves")
                    sys.exit(1)
            if answering is not None:
                answering.kill()
                answering.wait()
            nursery.cancel_scope.cancel()
    finally:
        server.terminate()
        server.wait(30)
    return latency, rate


async def main(args: argparse.Namespace) -> None:
    figures: dict[str, list[tuple[float, float]]] = {"inproc": [], "serve": [], "serve+host": []}
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="of-hosts-", dir="/tmp") as tmp:
            folder = Path(tmp)
            figures["inproc"].append(await inproc(folder, args.n, args.c, args.l))
            figures["serve"].append(await served(folder, args.n, args.c, args.l, host=False))
            figures["serve+host"].append(await served(folder, args.n, args.c, args.l, host=True))
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1][1]:,.0f}/s p50 {v[-1][0] * 1e3:.2f} ms" for k, v in figures.items())
        )
    print(
        f"\n{args.n} session actions, {args.c} concurrent senders; latency over {args.l} moves, one at a time"
    )
    print(f"{'setup':<12}{'actions/s (median)':>20}{'p50 latency (median)':>24}")
    medians = {}
    for name, runs in figures.items():
        latency = statistics.median(r[0] for r in runs)
        rate = statistics.median(r[1] for r in runs)
        medians[name] = (latency, rate)
        print(f"{name:<12}{rate:>20,.0f}{latency * 1e3:>21.2f} ms")
    added = [h[0] - s[0] for h, s in zip(figures["serve+host"], figures["serve"], strict=True)]
    ratios = [h[1] / i[1] for h, i in zip(figures["serve+host"], figures["inproc"], strict=True)]
    added_ms = statistics.median(added) * 1e3
    print(f"\nadded by a host call over the socket, p50: {added_ms:.2f} ms (target <= 1 ms)")
    print(f"serve+host / inproc actions per second: {statistics.median(ratios):.2f}x (target >= 0.5x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="session actions in the throughput phase")
    parser.add_argument("-c", type=int, default=64, help="concurrent senders in the throughput phase")
    parser.add_argument("-l", type=int, default=300, help="moves in the latency phase (one at a time)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over them)")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trio.run(main, parser.parse_args())
