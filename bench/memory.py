"""Memory per idle task: N tasks created through the runtime, then left idle until their actors are evicted.

Run: python bench/memory.py [-n 10000] [-c 64] [--idle-timeout 0] [--heap]

Each task is created with `create_task` from C concurrent senders (one actor per task while it works); the
run then waits for the idle timeout so every actor is evicted, and measures against the runtime's own
baseline (workflow registered, no tasks):
- peak RSS growth per task (`ru_maxrss`, "peak memory") and RSS growth still held once idle;
- with --heap, the Python heap still allocated per idle task (tracemalloc; it inflates RSS itself), which
  RSS hides (freed pages are not always returned to the OS).
Invariants: every task exists in the store, and no task actor is alive once idle. Exit 1 if either fails.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import structlog
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime

WORKFLOW = """\
id: mem
name: Memory
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
"""


def rss_kib() -> int:
    with open("/proc/self/statm") as statm:  # Linux: resident pages
        return int(statm.read().split()[1]) * resource.getpagesize() // 1024


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB


async def _send(rt: Runtime, message: dict[str, Any]) -> Any:
    reply = await rt.send(message)
    if not reply.ok:
        raise RuntimeError(f"{message['type']} failed: {reply.error}")
    return reply.result


async def measure(db: Path, n: int, concurrency: int, idle_timeout: float) -> dict[str, Any]:
    async with open_runtime(db, actor_idle_timeout=idle_timeout) as rt:
        await _send(rt, {"type": "register_workflow", "yaml": WORKFLOW, "source": "memory.yml"})
        await _send(rt, {"type": "create_task", "task_id": "warm-up", "workflow_id": "mem"})
        await trio.sleep(idle_timeout + 0.2)
        gc.collect()
        base_rss, base_peak = rss_kib(), peak_rss_kib()
        base_heap, _ = tracemalloc.get_traced_memory()

        async def create(offset: int) -> None:
            for i in range(offset, n, concurrency):
                await _send(rt, {"type": "create_task", "task_id": f"T-{i}", "workflow_id": "mem"})

        async with trio.open_nursery() as nursery:
            for offset in range(concurrency):
                nursery.start_soon(create, offset)
        busy_actors = rt.live_actors
        await trio.sleep(idle_timeout + 0.2)  # every actor idles past its timeout
        gc.collect()
        idle_rss, peak = rss_kib(), peak_rss_kib()
        idle_heap, _ = tracemalloc.get_traced_memory()
        stored = await rt.services.store.transact(
            lambda conn: int(conn.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])
        )
        live = rt.live_actors
    violations = []
    if stored != n + 1:
        violations.append(f"{stored} tasks stored, expected {n + 1}")
    if live:
        violations.append(f"{live} task actors still alive after the idle timeout")
    return {
        "n": n,
        "actors_alive_after_creation": busy_actors,
        "peak_rss_per_task_kib": (peak - base_peak) / n if peak > base_peak else 0.0,
        "peak_growth_kib": max(0, peak - base_peak),
        "idle_rss_per_task_kib": (idle_rss - base_rss) / n,
        "idle_heap_per_task_bytes": (idle_heap - base_heap) / n,
        "violations": violations,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", "--tasks", type=int, default=10000)
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("--idle-timeout", type=float, default=0.0, help="actor_idle_timeout, seconds")
    parser.add_argument("--heap", action="store_true", help="also trace the Python heap (inflates RSS)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary database directory")
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    if args.heap:
        tracemalloc.start()
    with tempfile.TemporaryDirectory(prefix="onceflow-memory-", dir=args.dir) as tmp:
        result = trio.run(measure, Path(tmp) / "memory.db", args.tasks, args.concurrency, args.idle_timeout)
    print(f"N={result['n']} C={args.concurrency} actor_idle_timeout={args.idle_timeout} s")
    print(f"task actors alive right after creation: {result['actors_alive_after_creation']}")
    print(
        f"peak RSS growth: {result['peak_growth_kib']:,} KiB = {result['peak_rss_per_task_kib']:.2f} KiB/task"
        " (target < 2 KiB per idle task)"
    )
    print(f"RSS growth held once idle: {result['idle_rss_per_task_kib']:.2f} KiB/task")
    if args.heap:
        print(f"Python heap held per idle task: {result['idle_heap_per_task_bytes']:.0f} bytes (tracemalloc)")
    for violation in result["violations"]:
        print(f"VIOLATION: {violation}")
    print(f"invariants -> {'OK' if not result['violations'] else 'FAILED'}")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
