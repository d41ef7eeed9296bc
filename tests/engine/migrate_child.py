"""A runtime process that migrates office-default's tasks onto version 2 (review renamed peer-review) with
`enter`, and hangs inside the new entry's dispatch at its `block_at`-th session action, after writing
`marker`: the test SIGKILLs it there (tests/engine/test_migration_crash.py).

    python migrate_child.py DB MARKER BLOCK_AT
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.host import SessionActionRequest
from onceflow.testing import RecordingHost

MIGRATE = {
    "type": "migrate_tasks",
    "workflow_id": "office-default",
    "to_version": 2,
    "step_map": {"review": "peer-review"},
    "enter": True,
    "operation_id": "crash-1",
}


@attrs.define
class HangingHost(RecordingHost):
    marker: Path = Path()
    block_at: int = 1

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        await super().perform_session_action(request)
        if len(self.session_actions) == self.block_at:
            self.marker.write_text(request.task_id)
            await trio.sleep_forever()  # killed here, mid-migration


async def main(db: str, marker: Path, block_at: int) -> None:
    async with open_runtime(db, host=HangingHost(marker=marker, block_at=block_at)) as rt:
        await rt.send(MIGRATE)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
