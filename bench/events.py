"""Event cost on the hot path: µs to build, publish and reply the events of one common step entry.

Run: python bench/events.py [--repeat R] [--number N]

One entry of `bench/dispatch.py`'s review step (clear_decisions, then a fan-out to 3 reviewers) emits 9
events: transition, step_entered, decisions_cleared, action_outcome x2, run_queued x3 and the
fan_out_finished diagnostic. This times, in-process and without a database, the parts of that work the
events code owns: `publish_common` (what the engine publishes for a common entry committed whole, to an
`Outbox`: hub without subscribers, metrics no-op, structlog filtering at WARNING as `bench/dispatch.py`
configures it), the `Reply` that carries them, and one whole entry as the engine emits it; for comparison
`common_result` and `OnEnterDispatch.publish_segment`, what the recovery scan's set path (and, before the
fourth session, the hot path) builds and publishes for the same entry. Best of R repeats of N entries each.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import structlog
from dispatch import WORKFLOW  # bench/ is on sys.path when run as a script: the same review step

from onceflow.actors.engine.common import common_order, common_result, publish_common
from onceflow.actors.engine.on_enter import OnEnterDispatch
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.kernel.services import Services
from onceflow.protocol import trusted
from onceflow.protocol.events import RunQueued
from onceflow.protocol.workflow import load_workflow_text
from onceflow.store.entries.common_entry import common_plan
from onceflow.store.entries.executors import DEFAULT_EXECUTORS
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.records import TaskRecord


def scenario() -> dict[str, Callable[[], Any]]:
    """The timed callables: each does one entry's share of the work it names."""
    workflow = load_workflow_text(WORKFLOW)
    step = workflow.steps[1]
    services: Any = Services(None, None, None, None, None)  # type: ignore[arg-type]
    order = common_order(DEFAULT_EXECUTORS, step, "E2")
    assert order is not None
    task = TaskRecord("t-1", "bench", "review", "", None, None, None, "medium", True, None, 0.0, 0.0, 1)
    key = EntryKey("t-1", "review", 1)
    done = ((0, 2), (1, tuple((f"rev-{i}", i, f"on_enter:t-1:review:1:1:rev-{i}:abc") for i in range(3))))
    hub = EventHub()
    plan = common_plan(step, order)
    result = common_result(task.id, step, order, done)
    events = []

    def publish() -> None:
        out = Outbox(hub)
        OnEnterDispatch(services, task, workflow, step, key, "E2", out).publish_segment(result)
        events[:] = out.events

    def publish_direct() -> None:
        publish_common(Outbox(hub), task.id, plan, done)

    def entry() -> None:
        out = Outbox(hub)
        out.emit(
            trusted.transition(
                task_id="t-1", workflow_id="bench", from_step="work", to_step="review", trigger="move_task"
            )
        )
        out.emit(trusted.step_entered(task_id="t-1", step_id="review", entry_seq=1, entry_path="E2"))
        publish_common(out, task.id, plan, done)
        out.reply("move_task", result={"task_id": "t-1"})

    publish()
    return {
        "run_queued (1 event)": lambda: RunQueued(
            run_id=1,
            task_id="t-1",
            step_id="review",
            agent_profile_id="rev-1",
            reason="on_enter",
            idempotency_key="k",
        ),
        "publish_common (7 events)": publish_direct,
        "Reply (9 events)": lambda: _outbox(hub, events).reply("move_task", result={"task_id": "t-1"}),
        "one entry, as the engine emits it": entry,
        "common_result (recovery set path)": lambda: common_result(task.id, step, order, done),
        "publish_segment of it": publish,
    }


def _outbox(hub: EventHub, events: list[Any]) -> Outbox:
    out = Outbox(hub)
    out.events = list(events)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    for name, call in scenario().items():
        best = min(timeit.repeat(call, number=args.number, repeat=args.repeat)) / args.number
        print(f"{name:32s} {best * 1e6:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
