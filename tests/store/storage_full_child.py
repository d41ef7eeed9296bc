"""Child process of tests/store/test_storage_full_disk.py: the board's fan-out under a real file-size limit.

Usage: python storage_full_child.py DB_PATH. Prints one JSON object: the state before; for each of
`HEADROOMS`, the reply of a turn_complete sent while every file write more than that many bytes past the
WAL's current end fails, and the state after it; then the reply and state of the same command sent again
once the limit is lifted. The limit is `RLIMIT_FSIZE`, a real kernel limit: writes past it fail (EFBIG), as
they do on a full volume (ENOSPC).
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py

import structlog
import trio
from storage_support import board, small_cache, state

from onceflow.actors.runtime.startup import open_runtime

# Bytes the WAL may grow by in each attempt: the transaction spills pages to the WAL as it goes (its
# cache is kept small), so it fails at the first spill, or after a few reviewers' runs, or later.
HEADROOMS = (0, 40 * 1024, 80 * 1024, 120 * 1024)  # all short of the ~170 KiB the fan-out needs


async def main(db: Path) -> dict[str, Any]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a kill
    report: dict[str, Any] = {"attempts": []}
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    async with open_runtime(db) as rt:
        await board(rt)
        report["before"] = await state(rt)
        await rt.services.store.transact(small_cache)
        end = Path(f"{db}-wal").stat().st_size  # each attempt appends from here: a failed one left no frame
        for headroom in HEADROOMS:
            limit = end + headroom
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            reply = await rt.send({"type": "turn_complete", "task_id": "T1"})
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # so the state can be read back
            report["attempts"].append({"headroom": headroom, "reply": reply.model_dump(mode="json")})
            report["attempts"][-1]["state"] = await state(rt)  # still serving
        report["retry"] = (await rt.send({"type": "turn_complete", "task_id": "T1"})).model_dump(mode="json")
        report["after_retry"] = await state(rt)
    return report


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries the report
    print(json.dumps(trio.run(main, Path(sys.argv[1]))))
