"""A program embedding the runtime as a host would: `open_runtime` in a Trio program, eight tasks sending
commands in a loop (load). Run by tests/runtime/test_cancellation.py as `python embedding_child.py DB`; it
prints `ready` once commands flow, and is stopped by SIGINT like any Trio program."""

from __future__ import annotations

import sys
from pathlib import Path

import trio

import onceflow
from onceflow.actors.runtime.supervisor import Runtime

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "workflows" / "minimal.yml"


async def _load(rt: Runtime, worker: int, started: trio.Event) -> None:
    n = 0
    while True:
        n += 1
        task = f"W{worker}-{n}"
        await rt.send({"type": "create_task", "task_id": task, "workflow_id": "fixture", "session_id": "s"})
        await rt.send({"type": "move_task", "task_id": task, "step_id": "todo"})
        started.set()


async def main(db: str) -> None:
    async with onceflow.open_runtime(db) as rt:
        reply = await rt.send({"type": "register_workflow", "yaml": TEMPLATE.read_text()})
        assert reply.ok, reply.error
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            for worker in range(8):
                nursery.start_soon(_load, rt, worker, started)
            await started.wait()
            print("ready", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
