"""Child process of tests/store/test_writer.py: a second Ctrl-C while the store closes behind a busy writer.

Usage: python close_interrupt_child.py DB_PATH. Opens the store, occupies its writer with a request that
holds for 0.6 s, and leaves `open_store` (so it waits for the writer to stop) while SIGINT arrives 0.2 s in.
Prints one JSON object once `trio.run` has raised: whether it raised KeyboardInterrupt and whether the writer
thread was still alive at that moment.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import threading
from pathlib import Path

import trio

from onceflow.store.writer import StoreActor, open_store

opened: list[StoreActor] = []


def hold(conn: sqlite3.Connection) -> None:
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    threading.Event().wait(0.6)
    conn.execute(
        "INSERT INTO workflows (id, name, source, definition, registered_at)"
        " VALUES ('held', 'w', 't', '{}', 0)"
    )


async def main(db: Path) -> None:
    async with trio.open_nursery() as nursery, open_store(db) as store:
        opened.append(store)
        nursery.start_soon(store.transact, hold)
        await trio.sleep(0.05)  # the writer is in `hold` when the store starts closing


if __name__ == "__main__":
    report = {"keyboard_interrupt": False}
    try:
        trio.run(main, Path(sys.argv[1]))
    except* KeyboardInterrupt:  # out of the nursery, in a group
        report["keyboard_interrupt"] = True
    report["writer_alive"] = opened[0]._thread.is_alive()
    print(json.dumps(report))
