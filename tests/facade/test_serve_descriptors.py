"""`onceflow serve` under its open-files limit (RLIMIT_NOFILE, set in the server process before it starts):
the default `--max-connections` follows the limit, an explicit one beyond it is clamped, the soft limit is
raised toward the hard one as far as needed, and with the limit at 256 a new client is answered within a
second however many idle clients are connected. Real `onceflow serve` processes and real sockets.
"""

from __future__ import annotations

import json
import re
import resource
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_serve import _create, _start, serving, settled_descriptors
from wire_client import WireClient

from onceflow.serve.descriptors import DEFAULT_MAX_CONNECTIONS, HEADROOM


def _answered_within_a_second(socket: Path, request: dict[str, Any]) -> tuple[WireClient, dict[str, Any]]:
    """A new client's first line after sending `request`; it must arrive within a second of connecting."""
    began = time.monotonic()
    client = WireClient(str(socket), timeout=1.0)
    client.write(request)
    first = client.line()
    assert first is not None
    assert time.monotonic() - began < 1.0
    return client, first


def _descriptors(pid: int) -> int:
    """How many descriptors the process has open, once they stand still (`settled_descriptors`)."""
    return len(settled_descriptors(pid))


@pytest.mark.parametrize("explicit", [(), ("--max-connections", "256")], ids=["default", "explicit-256"])
def test_serve_at_an_open_files_limit_of_256_a_new_client_is_answered_within_a_second(
    explicit: tuple[str, ...],
) -> None:
    """RLIMIT_NOFILE 256 (soft and hard), `--max-connections` left to its default or set to 256: the cap is
    what the limit leaves (an explicit 256 is clamped, with a WARNING), so 270 idle clients connecting one
    after another are each served within a second: past the cap, each new one evicts the longest-idle
    connection, which is told so (`evicted`, retryable) and closed, oldest first. The server never runs out
    of descriptors, and the whole episode logs one WARNING."""
    with serving("--idle-timeout", "0", *explicit, nofile=(256, 256)) as served:
        clients = []
        for n in range(270):
            client, first = _answered_within_a_second(
                served.socket, {"id": n, "type": "get_task", "task_id": "x"}
            )
            assert first["id"] == n, first
            clients.append(client)
        evicted = []
        for n, client in enumerate(clients):  # an evicted client was told so before its successor was served
            if not select.select([client.sock], [], [], 0)[0]:
                continue
            frame = client.line()
            assert frame is not None and frame["error"]["code"] == "evicted" and frame["error"]["retryable"]
            evicted.append(n)
        cap = 270 - len(evicted)  # those left
        assert evicted == list(range(270 - cap))  # the longest idle first
        assert 0 < cap <= 256 - HEADROOM
        assert _descriptors(served.process.pid) < 256 - HEADROOM // 2
        assert len([line for line in served.log if "connections_at_cap" in line]) == 1
        clamped = [line for line in served.log if "max_connections_clamped" in line]
        if explicit:
            assert (
                len(clamped) == 1 and "requested=256" in clamped[0] and f"max_connections={cap}" in clamped[0]
            )
        else:
            assert not clamped
        assert not [line for line in served.log if "accept_paused" in line or "Traceback" in line]


def test_serve_default_max_connections_follows_the_open_files_limit() -> None:
    """RLIMIT_NOFILE 128: the default cap is what the limit leaves once the descriptors open at start and the
    headroom are set aside: that many subscribers (never idle, so never evicted) are served and the next
    client gets one `busy` line naming that cap, within a second, not a hang."""
    with serving("--idle-timeout", "0", nofile=(128, 128)) as served:
        open_at_start = _descriptors(served.process.pid) - 1  # but the spare descriptor
        cap = 128 - open_at_start - HEADROOM
        assert 0 < cap < DEFAULT_MAX_CONNECTIONS
        subscribers = []
        for n in range(cap):
            client, first = _answered_within_a_second(served.socket, {"id": n, "type": "subscribe"})
            assert first["id"] == n
            subscribers.append(client)
        _, refused = _answered_within_a_second(
            served.socket, {"id": "over", "type": "get_task", "task_id": "x"}
        )
        error = refused["error"]
        assert isinstance(error, dict) and (error["code"], error["retryable"]) == ("busy", True)
        assert f"its limit of {cap} connections" in error["message"]
        assert subscribers[0].request({"id": "c", **_create("T1")})["reply"]["ok"]  # still served


def test_serve_raises_its_soft_open_files_limit_toward_the_hard_one_as_far_as_it_needs() -> None:
    """A soft limit of 64 under a hard one of 4096: the server raises its soft limit enough for the default
    256 connections and its headroom, and no further."""
    with serving(nofile=(64, 4096)) as served:
        soft, hard = resource.prlimit(served.process.pid, resource.RLIMIT_NOFILE)
        open_at_start = _descriptors(served.process.pid) - 1
        assert (soft, hard) == (open_at_start + HEADROOM + DEFAULT_MAX_CONNECTIONS, 4096)


def test_serve_refuses_to_start_when_the_open_files_limit_leaves_no_descriptor_for_a_client(
    tmp_path: Path,
) -> None:
    """RLIMIT_NOFILE 40 (soft and hard): not even one client would fit beside the store and the headroom, so
    the server exits 2 at start with one error line saying so, and removes its socket."""
    socket = tmp_path / "s.sock"
    process = _start(tmp_path / "b.db", ["--socket", str(socket)], nofile=(40, 40))
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert re.fullmatch(
        r"error: RLIMIT_NOFILE: the open-files limit of 40 leaves no descriptor for a client: "
        rf"\d+ are open and {HEADROOM} are kept in reserve; raise it \(ulimit -n\)\n",
        err.decode(),
    ), err.decode()
    assert not socket.exists()


# Run in a child process that lowers its own limit (soft and hard: `connection_cap` raises a soft limit
# toward the hard one) to leave room for `room` connections beside what it has open.
_CAPS = """
import json, resource, sys
from onceflow.serve.descriptors import HEADROOM, connection_caps, descriptors_open
limit = descriptors_open() + HEADROOM + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
cases = json.loads(sys.argv[2])
caps = [connection_caps(a, b, serving_socket=s, serving_http=h) for a, b, s, h in cases]
print(json.dumps(caps))
"""


def _caps(room: int, cases: list[tuple[int | None, int | None, bool, bool]]) -> list[list[int]]:
    run = subprocess.run(
        [sys.executable, "-c", _CAPS, str(room), json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(run.stdout))


def test_the_socket_and_http_share_one_descriptor_budget() -> None:
    """Serving both listeners, their caps together stay within what the open-files limit leaves: room for
    100 connections is split in proportion to what each wants (both default: half each; 300 and 100: three
    quarters and a quarter), at least one each; with room for all they want, each gets its own figure."""
    both, http_only, socket_only = (True, True), (False, True), (True, False)
    assert _caps(100, [
        (None, None, *both), (300, 100, *both), (300, None, *both), (60, 30, *both),
        (None, 40, *http_only), (500, None, *socket_only),
    ]) == [[50, 50], [75, 25], [50, 50], [60, 30], [0, 40], [100, 0]]  # fmt: skip
    assert _caps(2, [(1000, 1, *both)]) == [[1, 1]]
    assert _caps(1, [(None, None, *both), (None, None, *socket_only)]) == [[1, 1], [1, 0]]
