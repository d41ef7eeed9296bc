"""A runtime that stops answering loses its epoch within the stated bound.

A SIGSTOPped runtime process is what the server sees of a runtime frozen or cut off while idle: its writer
sends no more heartbeats, so `idle_session_timeout` (10 s, `postgres.PARTITION_BOUND`) ends its session and
frees its epoch lock; until then the epoch is live and its claims stand. (A frozen process's kernel still
answers TCP keepalives; a real partition is also cut by the keepalives and `tcp_user_timeout`, sooner.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import trio

from onceflow.store.backends import epochs, postgres

CHILD = """
import sys, trio
from onceflow.store.writer import open_store

async def main():
    async with open_store(sys.argv[1]) as store:
        print(store.epoch, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_a_frozen_runtime_loses_its_epoch_within_the_partition_bound(pg_url: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, pg_url], stdout=subprocess.PIPE, text=True)
    probe = postgres.connect(pg_url)

    def live(epoch: str) -> bool:
        probe.execute("BEGIN")
        try:
            return epochs.is_live(probe, epoch)
        finally:
            probe.execute("ROLLBACK")

    try:
        assert child.stdout is not None
        epoch = child.stdout.readline().strip()
        await trio.sleep(postgres.PARTITION_BOUND / 2)  # idle but heartbeating: still live
        assert live(epoch)
        child.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while live(epoch):
            assert time.monotonic() - stopped < postgres.PARTITION_BOUND + 3, "the epoch outlived the bound"
            await trio.sleep(0.1)
        freed_after = time.monotonic() - stopped
        assert freed_after > postgres.PARTITION_BOUND - 2  # freed by the timeout, not by something else
    finally:
        child.send_signal(signal.SIGKILL)
        child.send_signal(signal.SIGCONT)
        child.wait()
        probe.close()
