"""A program embedding the runtime as a host would: `open_runtime` in a Trio program, eight tasks sending
commands in a loop (load). Run by tests/runtime/test_cancellation.py as `python embedding_child.py DB`; it
prints `ready` once commands flow, and is stopped by SIGINT like any Trio program.

`python embedding_child.py DB FILE:TEXT` raises the SIGINT itself, from inside the runtime: at the first
execution (after `ready`) of the line of `onceflow/FILE` that contains TEXT, so a test can land it exactly
where a KeyboardInterrupt would break the runtime if it were raised there. It prints `interrupting` then."""

from __future__ import annotations

import linecache
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

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


def _interrupt_at(where: str) -> None:
    """Raise SIGINT in this (the Trio) thread when the line of onceflow/FILE containing TEXT next runs."""
    path, text = where.split(":", 1)
    suffix = str(Path(onceflow.__file__).parent / path)

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and text in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            sys.settrace(None)
            print("interrupting", flush=True)
            signal.raise_signal(signal.SIGINT)  # the handler runs here, in this frame
            return None
        return line

    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename == suffix else None)


async def main(db: str, interrupt_at: str | None) -> None:
    async with onceflow.open_runtime(db) as rt:
        reply = await rt.send({"type": "register_workflow", "yaml": TEMPLATE.read_text()})
        assert reply.ok, reply.error
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            for worker in range(8):
                nursery.start_soon(_load, rt, worker, started)
            await started.wait()
            print("ready", flush=True)
            if interrupt_at is not None:
                _interrupt_at(interrupt_at)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
