"""A host in another process, as one in any language would be written: standard library only (socket, json),
no onceflow import. Run by tests/facade/test_serve_hosts.py as

    python -I host_process.py SOCKET CAPABILITIES MODE LOG

It registers on `onceflow serve`'s socket with the comma-separated CAPABILITIES, prints `registered
<host_id>`, then appends every call it is sent to LOG (one JSON line each, flushed) and, by MODE, answers
it `ok` (`answer`), refuses it (`refuse`: `{"code": "not_now", "message": "busy elsewhere"}`), or never
answers (`hang`, to be killed). A `deliver` call is answered with a receipt naming the call.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any


def run(path: str, capabilities: list[str], mode: str, log_path: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reader = sock.makefile("rb")
    register = {"id": "register", "type": "register_host", "capabilities": capabilities}
    sock.sendall(json.dumps(register).encode() + b"\n")
    with open(log_path, "a", encoding="utf-8") as log:
        for raw in reader:
            frame: dict[str, Any] = json.loads(raw)
            if frame.get("id") == "register":
                print("registered", frame["reply"]["result"]["host_id"], flush=True)
            call = frame.get("call")
            if call is None:
                continue
            log.write(json.dumps(call) + "\n")
            log.flush()
            os.fsync(log.fileno())
            if mode == "hang":
                continue
            answer: dict[str, Any] = {
                "type": "host_reply",
                "call_id": call["call_id"],
                "ok": mode == "answer",
            }
            if mode == "refuse":
                answer["error"] = {"code": "not_now", "message": "busy elsewhere"}
            elif call["kind"] == "deliver":
                answer["result"] = {"delivery_ref": f"bead:{call['call_id']}", "coordinator_fence": "f-1"}
            sock.sendall(json.dumps({"id": call["call_id"], **answer}).encode() + b"\n")


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4])
