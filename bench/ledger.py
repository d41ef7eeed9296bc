"""Ledger round-trips per second through the ledger actor, against a plain in-process set, in one run.

Run: python bench/ledger.py [-n N]. Each round-trip is one is_applied plus one mark_applied of a fresh id,
from C concurrent Trio tasks. Prints both rates and the actor's overhead factor.
"""

from __future__ import annotations

import argparse
import time

import trio

from onceflow.actors.kernel.ledger import LedgerActor


async def through_actor(n: int, concurrency: int) -> float:
    ledger = LedgerActor()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ledger.run)

        async def worker(offset: int) -> None:
            for i in range(offset, n, concurrency):
                if not await ledger.is_applied(f"op:{i}"):
                    await ledger.mark_applied(f"op:{i}")

        start = time.perf_counter()
        async with trio.open_nursery() as workers:
            for offset in range(concurrency):
                workers.start_soon(worker, offset)
        elapsed = time.perf_counter() - start
        ledger.close()
    return n / elapsed


def plain_set(n: int) -> float:
    applied: set[str] = set()
    start = time.perf_counter()
    for i in range(n):
        if f"op:{i}" not in applied:
            applied.add(f"op:{i}")
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", type=int, default=200_000, help="round-trips per measurement")
    args = parser.parse_args()
    baseline = plain_set(args.n)
    print(f"{'path':<28} {'round-trips/s':>14} {'overhead':>9}")
    print(f"{'plain set':<28} {baseline:>14,.0f} {'1.0x':>9}")
    for concurrency in (1, 16):
        rate = trio.run(through_actor, args.n, concurrency)
        print(f"{f'ledger actor, {concurrency} tasks':<28} {rate:>14,.0f} {baseline / rate:>8.1f}x")


if __name__ == "__main__":
    main()
