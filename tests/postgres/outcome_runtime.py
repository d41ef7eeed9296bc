"""Child process of tests/postgres/test_pg_outcome_kills.py: one runtime on a PostgreSQL database whose
coordinator records every attempt on stdout, and which applies the commands its parent writes on stdin.

Usage: python outcome_runtime.py URL FENCE. Opens a runtime on URL (redelivery every INTERVAL seconds)
with a `LoggingCoordinator` answering every delivery with coordinator fence FENCE (the coordinator session
this process talks to: a restarted process gets a new one), prints `{"event": "ready"}`, then reads
`{"id": n, "command": {...}}` lines on stdin, applying each concurrently and printing
`{"event": "reply", "id": n, "reply": {...}}`. Every line on stdout is one JSON object, flushed at once, so
what the parent read before a SIGKILL is what happened before it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import structlog
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.coordinator import AcknowledgeRequest, DeliveryRequest

INTERVAL = 0.5  # seconds between redeliveries: short, so an ack another runtime took in is seen soon


def emit(event: str, **fields: Any) -> None:
    """One line on stdout: `event`, this process's pid, the system-wide monotonic time, and `fields`."""
    line = json.dumps({"event": event, "pid": os.getpid(), "t": time.monotonic(), **fields})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class LoggingCoordinator:
    """A Gas City coordinator session with fence `fence`: every attempt is logged when it begins
    (`deliver`, `ack`) and when it returns (`delivered`, `acked`); each takes a random 20-200 ms, so a
    SIGKILL often lands in one."""

    def __init__(self, fence: str) -> None:
        self.fence = fence
        self.rng = random.Random()

    async def deliver(self, request: DeliveryRequest) -> dict[str, Any]:
        outcome_id = request.envelope.outcome_id
        emit("deliver", outcome=outcome_id, cycle=request.cycle_id, attempt=request.attempt)
        await trio.sleep(self.rng.uniform(0.02, 0.2))
        emit("delivered", outcome=outcome_id, cycle=request.cycle_id, fence=self.fence)
        ref = f"bead:{self.fence}-{request.delivery_cycle}"
        return {"delivery_ref": ref, "coordinator_fence": self.fence}

    async def acknowledge(self, request: AcknowledgeRequest) -> None:
        ack = request.acknowledgement
        emit("ack", outcome=ack.outcome_id, cycle=request.cycle_id, fence=ack.coordinator_fence)
        await trio.sleep(self.rng.uniform(0.02, 0.2))
        emit("acked", outcome=ack.outcome_id, cycle=request.cycle_id, fence=ack.coordinator_fence)


async def main(url: str, fence: str) -> None:
    async with open_runtime(url, coordinator=LoggingCoordinator(fence), redelivery_interval=INTERVAL) as rt:

        async def apply(line: str) -> None:
            message = json.loads(line)
            reply = await rt.send(message["command"])
            emit("reply", id=message["id"], reply=reply.model_dump(mode="json"))

        emit("ready")
        stdin = trio.wrap_file(sys.stdin)
        async with trio.open_nursery() as nursery:
            async for line in stdin:
                nursery.start_soon(apply, line)
        await trio.sleep_forever()  # stdin closed: keep delivering until killed


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    trio.run(main, sys.argv[1], sys.argv[2])
