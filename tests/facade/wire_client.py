"""A client of `onceflow serve` using only the standard library's socket and json (no onceflow imports),
as a host in another language would talk to it. Imported by tests/facade/test_serve.py, and run on its own
(`python -I wire_client.py SOCKET PREFIX COUNT`) as a separate client process: it creates COUNT tasks
named PREFIX-n, moves each to `work`, and prints one JSON object with what it saw.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any


class WireClient:
    """One connection: write request lines, read JSON lines (replies, events, a final error)."""

    def __init__(self, path: str, timeout: float = 20.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._buffer = b""
        self.events: list[dict[str, Any]] = []

    def write(self, *requests: dict[str, Any] | bytes) -> None:
        """Send requests (a dict as one JSON line, bytes as they are) in one write."""
        data = b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in requests)
        self.sock.sendall(data)

    def line(self) -> dict[str, Any] | None:
        """The next JSON line, or None at end of stream."""
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\n", 1)
        value: dict[str, Any] = json.loads(raw)
        return value

    def reply(self) -> dict[str, Any]:
        """The next reply frame, keeping event frames seen on the way in `events`."""
        while True:
            frame = self.line()
            assert frame is not None, "connection closed before the reply"
            if "event" in frame:
                self.events.append(frame["event"])
                continue
            assert set(frame) == {"id", "reply"}, frame
            return frame

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply frame."""
        self.write(request)
        return self.reply()

    def close(self) -> None:
        self.sock.close()


def create_and_move(path: str, prefix: str, count: int) -> dict[str, Any]:
    """Pipeline COUNT create_task + move_task pairs with ids; report the ids echoed, in order, and oks."""
    client = WireClient(path)
    requests: list[dict[str, Any] | bytes] = []
    for n in range(count):
        task = f"{prefix}-{n}"
        create = {"type": "create_task", "task_id": task, "workflow_id": "fixture", "step_id": "todo"}
        requests.append({"id": f"{task}/create", **create})
        requests.append({"id": n, "type": "move_task", "task_id": task, "step_id": "work"})
    client.write(*requests)
    frames = [client.reply() for _ in requests]
    client.close()
    return {"ids": [f["id"] for f in frames], "ok": [f["reply"]["ok"] for f in frames]}


if __name__ == "__main__":
    print(json.dumps(create_and_move(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
