"""Child process of tests/postgres/test_pg_outcomes.py: a runtime that begins delivering an outcome and
never finishes, so that its parent can SIGKILL it with the delivery cycle in flight.

Usage: python outcome_child.py URL ENVELOPE_JSON. Opens a runtime on URL whose coordinator begins every
delivery and answers none, sends `outcome_ready` with the envelope, prints `delivering <cycle_id>` once the
first delivery began, and waits.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import structlog
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.testing import RecordingCoordinator


async def main(url: str, envelope: dict[str, Any]) -> None:
    coordinator = RecordingCoordinator(hanging_deliveries=2**62)  # begins every delivery, answers none
    async with open_runtime(url, coordinator=coordinator) as rt:
        reply = await rt.send(json.dumps({"type": "outcome_ready", "envelope": envelope}))
        assert reply.ok, reply.error
        await coordinator.until(lambda: bool(coordinator.deliveries))
        print(f"delivering {coordinator.deliveries[0][1].cycle_id}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    trio.run(main, sys.argv[1], json.loads(sys.argv[2]))
