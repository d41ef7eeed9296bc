"""`onceflow serve --http` over real HTTP (httpx against a server process): the commands and resource
routes answer the socket's `Reply` with a status following its error code, events stream as SSE resuming by
`Last-Event-ID`, tokens, bounds, and the OpenAPI document holding every command."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from http_support import WORKFLOW, HttpServed, http_serving

from onceflow.protocol.commands import COMMAND_TYPES
from onceflow.protocol.events import ErrorInfo, Reply
from onceflow.serve.http.api import STATUS, status_of
from onceflow.serve.http.listen import HttpListener, open_listener
from onceflow.serve.http.openapi import openapi_document
from onceflow.serve.http.options import HttpOptions

READ_TOKEN = "r" * 24
WRITE_TOKEN = "w" * 24


@pytest.fixture(scope="module")
def served() -> Iterator[HttpServed]:
    with http_serving() as server:
        yield server


def post(served: HttpServed, body: Any, path: str = "/v1/commands", **kw: Any) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=10, **kw)


def create(task_id: str, step: str = "todo") -> dict[str, Any]:
    return {"type": "create_task", "task_id": task_id, "workflow_id": "fixture", "step_id": step}


def sse_events(
    served: HttpServed,
    count: int,
    headers: dict[str, str] | None = None,
    query: str = "",
    timeout: float = 10,
) -> tuple[list[tuple[str | None, str, Any]], str]:
    """The first `count` SSE items (id, event kind, data) of a stream (fewer if none comes for `timeout`
    seconds), and its opening comment lines."""
    items: list[tuple[str | None, str, Any]] = []
    opening = ""
    try:
        return _read_sse(served, count, headers, query, timeout, items)
    except httpx.ReadTimeout:
        return items, opening


def _read_sse(
    served: HttpServed,
    count: int,
    headers: dict[str, str] | None,
    query: str,
    timeout: float,
    items: list[tuple[str | None, str, Any]],
) -> tuple[list[tuple[str | None, str, Any]], str]:
    opening = ""
    with httpx.stream("GET", f"{served.url}/v1/events{query}", headers=headers, timeout=timeout) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        block: list[str] = []
        for line in response.iter_lines():
            if line:
                block.append(line)
                continue
            if block and block[0].startswith(("retry:", ":")):
                opening += "\n".join(block)
            elif block:
                fields = dict(entry.split(": ", 1) for entry in block)
                items.append((fields.get("id"), fields.get("event", "message"), json.loads(fields["data"])))
                if len(items) == count:
                    break
            block = []
    return items, opening


def test_a_command_over_http_answers_the_sockets_reply_with_its_status(served: HttpServed) -> None:
    created = post(served, create("h-1"))
    assert created.status_code == 200 and created.headers["x-content-type-options"] == "nosniff"
    reply = Reply.model_validate(created.json())
    assert reply.ok and reply.command == "create_task" and reply.events[0].type == "task_created"
    got = httpx.get(f"{served.url}/v1/tasks/h-1").json()
    assert got["ok"] and got["result"]["step_id"] == "todo"
    missing = httpx.get(f"{served.url}/v1/tasks/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    bad = post(served, {"type": "create_task", "task_id": "h-2"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "workflow_id"
    unknown = post(served, {"type": "no_such_command"})
    assert unknown.status_code == 400 and unknown.json()["command"] == "no_such_command"
    not_json = httpx.post(f"{served.url}/v1/commands", content=b"{nope")
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_message"


def test_the_resource_routes_send_their_commands_with_query_fields(served: HttpServed) -> None:
    for n in range(3):
        assert post(served, create(f"page-{n}")).status_code == 200
    first = httpx.get(f"{served.url}/v1/tasks", params={"limit": 2}).json()["result"]
    assert len(first["tasks"]) == 2 and first["next_after_task_id"] is not None
    rest = httpx.get(f"{served.url}/v1/tasks", params={"after": first["next_after_task_id"]}).json()
    assert rest["ok"] and rest["result"]["tasks"]
    assert post(served, {"type": "move_task", "task_id": "page-0", "step_id": "review"}).status_code == 200
    history = httpx.get(f"{served.url}/v1/tasks/page-0/history").json()["result"]["items"]
    assert [item["kind"] for item in history][:2] == ["created", "transition"]
    runs = httpx.get(f"{served.url}/v1/runs", params={"status": "queued", "limit": 5})
    assert runs.status_code == 200 and "runs" in runs.json()["result"]
    too_many = httpx.get(f"{served.url}/v1/runs", params={"limit": 5000})
    assert too_many.status_code == 400 and too_many.json()["error"]["field"] == "limit"
    calls = httpx.get(f"{served.url}/v1/host-calls", params={"status": "pending"})
    assert calls.status_code == 200 and calls.json()["result"]["calls"] == []


def test_a_typed_path_fills_the_type_and_refuses_another(served: HttpServed) -> None:
    typed = post(
        served,
        {"task_id": "typed-1", "workflow_id": "fixture", "step_id": "todo"},
        "/v1/commands/create_task",
    )
    assert typed.status_code == 200 and typed.json()["command"] == "create_task"
    clash = post(served, {"type": "get_task", "task_id": "typed-1"}, "/v1/commands/create_task")
    assert clash.status_code == 400 and clash.json()["error"]["field"] == "type"


def test_the_sockets_own_requests_are_refused_over_http(served: HttpServed) -> None:
    for kind in ("subscribe", "register_host", "host_reply"):
        refused = post(served, {"type": kind})
        assert refused.status_code == 400 and refused.json()["error"]["field"] == "type", kind


def test_a_body_over_the_limit_is_413_unread(served: HttpServed) -> None:
    big = b'{"type":"create_task","title":"' + b"x" * (8 << 20) + b'"}'
    response = httpx.post(f"{served.url}/v1/commands", content=big, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"
    assert post(served, create("after-big")).status_code == 200  # the server still serves
    chunks = (b"x" * (1 << 20) for _ in range(9))  # no Content-Length: refused as it passes the limit
    chunked = httpx.post(f"{served.url}/v1/commands", content=chunks, timeout=30)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "too_large"


def test_commands_pipelined_on_one_connection_are_answered_in_order(served: HttpServed) -> None:
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    requests = b""
    for n in range(3):
        body = json.dumps(create(f"piped-{n}")).encode()
        requests += b"POST /v1/commands HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(requests)  # one write: the second and third arrive before the first is answered
        received = b""
        while received.count(b'"type":"reply"') < 3:
            chunk = conn.recv(65536)
            assert chunk, f"closed after {received!r}"
            received += chunk
    replies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in received.split(b"HTTP/1.1 ")[1:]]
    assert [r["events"][0]["task_id"] for r in replies] == ["piped-0", "piped-1", "piped-2"]


def test_events_stream_as_sse_and_resume_after_last_event_id(served: HttpServed) -> None:
    for n in range(3):
        post(served, create(f"ev-{n}"))
    items, opening = sse_events(served, 3, query="?after=0")
    assert "retry:" in opening
    events = [(seq, data) for seq, kind, data in items if kind == "message"]
    assert all(seq is not None for seq, _ in events)
    created = [data["task_id"] for _, data in events if data["type"] == "task_created"]
    assert created  # replayed from the window, oldest first
    # resume: everything after a given id comes once, in seq order, with no gap
    all_items, _ = sse_events(served, 1000, query="?after=0", timeout=1)
    seqs = [int(seq) for seq, kind, _ in all_items if kind == "message" and seq is not None]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    middle = seqs[len(seqs) // 2]
    resumed, _ = sse_events(served, 3, headers={"Last-Event-ID": str(middle)})
    assert [kind for _, kind, _ in resumed] == ["message"] * 3
    assert [int(seq) for seq, _, _ in resumed if seq] == [s for s in seqs if s > middle][:3]
    ahead, _ = sse_events(served, 1, query=f"?after={2**62}")  # another stream's seq: told of the gap
    assert ahead[0][1] == "gap" and ahead[0][2]["after"] == 2**62
    bad = httpx.get(f"{served.url}/v1/events", params={"after": "-1"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "after"


def test_a_live_event_arrives_on_an_open_stream(served: HttpServed) -> None:
    import threading

    got: list[Any] = []

    def read() -> None:
        got.extend(sse_events(served, 1)[0])

    reader = threading.Thread(target=read)
    reader.start()
    for n in range(50):  # until the stream is open and sees one
        post(served, create(f"live-ev-{n}"))
        reader.join(0.1)
        if not reader.is_alive():
            break
    assert got and got[0][1] == "message" and got[0][2]["type"] == "task_created"


def test_tokens_gate_the_api_and_a_read_token_only_reads() -> None:
    folder = Path(tempfile.mkdtemp(prefix="of-tok-", dir="/tmp"))
    tokens = folder / "tokens"
    tokens.write_text(f"# the board's\nread {READ_TOKEN}\nwrite {WRITE_TOKEN}\n")
    with http_serving("--token-file", str(tokens)) as served:
        read = {"Authorization": f"Bearer {READ_TOKEN}"}
        write = {"Authorization": f"Bearer {WRITE_TOKEN}"}
        none = httpx.get(f"{served.url}/v1/tasks")
        assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
        unsent = post(served, create("t-0"))
        assert unsent.status_code == 401 and unsent.headers["www-authenticate"] == "Bearer"
        assert unsent.json()["error"]["code"] == "unauthorized"
        assert httpx.get(f"{served.url}/v1/tasks/t-0", headers=read).status_code == 404  # not created
        wrong = httpx.get(f"{served.url}/v1/tasks", headers={"Authorization": "Bearer " + "x" * 24})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
        assert httpx.get(f"{served.url}/v1/tasks", headers=read).status_code == 200
        forbidden = post(served, create("t-1"), headers=read)
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "forbidden"
        assert post(served, create("t-1"), headers=write).status_code == 200
        assert post(served, {"type": "get_task", "task_id": "t-1"}, headers=read).status_code == 200
        assert httpx.get(f"{served.url}/v1/session", headers=read).json()["role"] == "read"
        assert httpx.get(f"{served.url}/").status_code == 200  # the pages hold no data
        assert httpx.get(f"{served.url}/openapi.json").status_code == 200


def test_a_non_loopback_bind_without_tokens_is_refused_at_start() -> None:
    command = [
        sys.executable,
        "-m",
        "onceflow.cli",
        "serve",
        "--db",
        "/tmp/never.db",
        "--workflow",
        str(WORKFLOW),
        "--http",
        "0.0.0.0:0",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "needs --token-file" in done.stderr
    assert not Path("/tmp/never.db").exists()


def test_cors_is_off_unless_an_origin_is_named(served: HttpServed) -> None:
    origin = {"Origin": "http://elsewhere.example"}
    assert "access-control-allow-origin" not in httpx.get(f"{served.url}/v1/tasks", headers=origin).headers
    with http_serving("--cors-origin", "http://elsewhere.example") as open_to:
        allowed = httpx.get(f"{open_to.url}/v1/tasks", headers=origin)
        assert allowed.headers["access-control-allow-origin"] == "http://elsewhere.example"
        sent = post(open_to, create("cors-1"), headers=origin)
        assert sent.status_code == 200 and sent.headers["access-control-allow-origin"] == origin["Origin"]


def test_past_the_connection_cap_a_client_gets_busy() -> None:
    with http_serving("--max-connections", "2") as served:
        streams = [httpx.stream("GET", f"{served.url}/v1/events", timeout=10) for _ in range(2)]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            busy = httpx.get(f"{served.url}/v1/tasks", timeout=10)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "busy"
        finally:
            for s in streams:
                s.__exit__(None, None, None)


def test_sigterm_ends_the_event_streams_and_exits_cleanly() -> None:
    with http_serving() as served:
        with httpx.stream("GET", f"{served.url}/v1/events", timeout=10) as response:
            lines = response.iter_lines()
            next(lines)
            served.process.send_signal(signal.SIGTERM)
            list(lines)  # the stream ends
        assert served.process.wait(timeout=20) == 0


def test_every_command_is_an_operation_of_the_openapi_document(served: HttpServed) -> None:
    document = httpx.get(f"{served.url}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    kinds = {model.model_fields["type"].default for model in COMMAND_TYPES}
    operations = {op["operationId"] for path in document["paths"].values() for op in path.values()}
    assert kinds <= operations
    assert set(document["components"]["schemas"]["Command"]["discriminator"]["mapping"]) == kinds
    text = json.dumps(document)
    for name in {ref.split("/")[-1] for ref in _refs(document)}:
        assert name in document["components"]["schemas"], name
    assert "#/$defs/" not in text
    assert document == openapi_document()


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


@pytest.mark.parametrize(
    ("code", "retryable", "status"),
    [
        ("invalid_message", False, 400),
        ("not_found", False, 404),
        ("conflict", False, 409),
        ("rate_limited", False, 429),
        ("storage_busy", True, 503),
        ("storage_io", True, 503),
        ("storage_corrupt", False, 500),
        ("some_new_code", True, 503),
        ("some_new_code", False, 400),
    ],
)
def test_the_status_follows_the_error_code(code: str, retryable: bool, status: int) -> None:
    reply = Reply(command="x", ok=False, error=ErrorInfo(code=code, message="m", retryable=retryable))
    assert status_of(reply) == status
    assert STATUS.get("not_found") == 404


def test_a_workflow_graph_draws_every_step_and_transition() -> None:
    from onceflow.protocol.workflow import load_workflow_file
    from onceflow.serve.http.graph import graph_svg, transitions, workflow_of

    workflow = load_workflow_file(WORKFLOW)
    assert transitions(workflow) == [
        ("work", "review", "turn_complete"),
        ("review", "done", "turn_complete"),
        ("review", "work", "turn_complete"),
    ]
    svg = graph_svg(workflow)
    assert svg.startswith("<svg") and svg.count("<g data-step=") == 4
    assert svg.count('data-from="review"') == 2 and "http" not in svg.replace("http://www.w3.org", "")
    assert workflow_of({"yaml": WORKFLOW.read_text()}) == workflow


async def _slow_or_sized(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app: `/slow` answers after 0.6 s, anything else at once (a sized body)."""
    if scope["path"] == "/slow":
        await trio.sleep(0.6)
    body = b'{"ok":true}'
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"11")]})
    await send({"type": "http.response.body", "body": body})


async def _request(stream: trio.SocketStream, path: str) -> tuple[bytes, float]:
    """One GET on a kept-alive connection: the response's bytes, and how many reads it took."""
    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    data, reads = b"", 0
    while not data.endswith(b'{"ok":true}'):
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before the response ended: {data!r}"
        data, reads = data + chunk, reads + 1
    return data, reads


async def test_an_idle_connection_closes_after_keep_alive_but_never_during_a_request() -> None:
    options = HttpOptions(port=0, keep_alive=0.3)
    listener = HttpListener(_slow_or_sized, options, cap=4, grace=1.0)
    async with trio.open_nursery() as nursery:
        socket_listener = await open_listener(options, backlog=8)
        port = socket_listener.socket.getsockname()[1]
        await nursery.start(listener.run, socket_listener)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        head, reads = await _request(stream, "/slow")  # 0.6 s under way: past keep_alive, still answered
        assert head.startswith(b"HTTP/1.1 200") and reads == 1  # the head and its sized body: one write
        began = trio.current_time()
        with trio.fail_after(5):
            assert await stream.receive_some(65536) == b""  # idle: closed by the keep-alive timer
        assert 0.2 < trio.current_time() - began < 2
        with trio.fail_after(1):  # and its slot freed
            while listener.connections:
                await trio.sleep(0.01)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await _request(idle, "/")
        listener.stop()  # stopping closes an idle connection at once, not keep_alive later
        with trio.fail_after(0.25):
            assert await idle.receive_some(65536) == b""
