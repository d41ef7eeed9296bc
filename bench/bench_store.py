"""Store actor throughput: small insert transactions per second from concurrent Trio tasks.

Not a test. Run: `python bench/bench_store.py [--transactions N] [--concurrency C]`. Each configuration
(max_batch 1 and 32, durability FULL and NORMAL) gets a fresh database in a temporary directory; every
transaction inserts one row. Prints one line per configuration.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

import structlog
import trio

from onceflow.store.writer import Durability, open_store


async def measure(
    path: Path, durability: Durability, max_batch: int, transactions: int, concurrency: int
) -> float:
    """Return transactions per second for `transactions` inserts spread over `concurrency` tasks."""

    def create(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE bench (id INTEGER PRIMARY KEY, task INTEGER, payload TEXT)")

    def count(conn: sqlite3.Connection) -> int:
        return int(conn.execute("SELECT count(*) FROM bench").fetchone()[0])

    async with open_store(path, durability=durability, max_batch=max_batch) as store:
        await store.transact(create)

        async def worker(task: int, n: int) -> None:
            def insert(conn: sqlite3.Connection) -> None:
                conn.execute("INSERT INTO bench (task, payload) VALUES (?, 'x')", (task,))

            for _ in range(n):
                await store.transact(insert)

        share, extra = divmod(transactions, concurrency)
        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for task in range(concurrency):
                nursery.start_soon(worker, task, share + (task < extra))
        elapsed = time.perf_counter() - began
        rows = await store.transact(count)
    assert rows == transactions, (rows, transactions)
    return transactions / elapsed


async def main(transactions: int, concurrency: int, parent: Path | None) -> None:
    print(f"sqlite {sqlite3.sqlite_version}, {transactions} transactions from {concurrency} Trio tasks")
    with tempfile.TemporaryDirectory(prefix="onceflow-bench-", dir=parent) as tmp:
        print(f"databases under {tmp}")
        print(f"{'durability':<11}{'max_batch':>10}{'txn/s':>12}")
        for durability in Durability:
            for max_batch in (1, 32):
                path = Path(tmp) / f"{durability.value}-{max_batch}.db"
                rate = await measure(path, durability, max_batch, transactions, concurrency)
                print(f"{durability.value:<11}{max_batch:>10}{rate:>12,.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--transactions", "-n", type=int, default=10000)
    parser.add_argument("--concurrency", "-c", type=int, default=50)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary database directory")
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )  # warnings and up
    trio.run(main, args.transactions, args.concurrency, args.dir)
