"""Child process of tests/postgres/test_pg_outcomes.py: a runtime that begins delivering an outcome and
never finishes, so that its parent can SIGKILL it with the delivery cycle in flight.

Usage: python outcome_child.py URL ENVELOPE_JSON. Opens a runtime on URL whose coordinator's `deliver` prints
`delivering <cycle_id>` and then waits forever, sends `outcome_ready` with the envelope, and waits.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import structlog
import trio

from onceflow.actors.coordinator import AcknowledgeRequest, DeliveryRequest
from onceflow.actors.supervisor import open_runtime


class HangingCoordinator:
    """Begins every delivery and answers none; acknowledges nothing."""

    async def deliver(self, request: DeliveryRequest) -> NoReturn:
        print(f"delivering {request.cycle_id}", flush=True)
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def acknowledge(self, request: AcknowledgeRequest) -> None:
        raise AssertionError("this runtime never gets an ack to commit")


async def main(url: str, envelope: dict[str, Any]) -> None:
    async with open_runtime(url, coordinator=HangingCoordinator()) as rt:
        reply = await rt.send(json.dumps({"type": "outcome_ready", "envelope": envelope}))
        assert reply.ok, reply.error
        await trio.sleep_forever()


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    trio.run(main, sys.argv[1], json.loads(sys.argv[2]))
