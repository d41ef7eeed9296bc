"""Template cost at the step cap: parse + validate, registration, restart, and the Trio thread's stalls.

Run: python bench/template_cost.py [-n STEPS] [--tasks T]

Two templates of N steps (default: MAX_TEMPLATE_STEPS): `plain` (no WIP keys) and `chain` (every step has
a WIP limit and pulls from the step before it, the shape whose feeder check used to be cubic). For each:
the time of `load_workflow_text` alone (the best of `--repeat`, wall clock and CPU); `register_workflow`
through a runtime while a ticker task records the longest gap between its 1 ms ticks (parsing runs in a
worker thread, so the gap stays small); then, with T tasks created at the last step (nothing pulls from
it), the time of a restart (`open_runtime` until it yields: load, recovery scan, start-up promotion) and
the store transactions that restart ran.
Invariants (exit 1): registration succeeds and the restart runs fewer than N transactions (start-up
promotion skips steps nobody can be promoted into), and every hostile template below is refused.

Then the refusal time of hostile templates at the limits, `load_workflow_text` alone, the best of
`--repeat` runs (wall clock, and the process's CPU time, steadier on a shared machine): `cycle` (the
N-step chain whose first step pulls from its last), `steps+1` (N + 1 steps, each with an unknown key),
`actions+1` (one more action than a trigger allows, on every step that fits in the byte cap), `last+1`
(the byte cap filled with steps of as many actions as a trigger allows, the last one over: the whole text is
read before the refusal) and `alias` (an 823-byte alias bomb). `--python` forces PyYAML's pure-Python
loader (what every template used before libyaml parsed them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.limits import MAX_TEMPLATE_ACTIONS, MAX_TEMPLATE_BYTES, MAX_TEMPLATE_STEPS
from onceflow.protocol.template import parse as workflow_parse
from onceflow.protocol.workflow import WorkflowError, load_workflow_text
from onceflow.store.writer import StoreActor

T = TypeVar("T")


def template(n: int, chain: bool) -> str:
    lines = ["id: cost", "name: Cost", "steps:"]
    for i in range(n):
        lines += [f"  - id: s{i}", f"    name: Step {i}", f"    position: {i}"]
        if i == 0:
            lines.append("    is_start_step: true")
        if chain and i > 0:
            lines += ["    wip_limit: 100", f"    pull_from_step_id: s{i - 1}"]
    return "\n".join(lines) + "\n"


def _actions_up_to_the_byte_cap(n: int, over_at_the_end: bool) -> str:
    """Steps of MAX_TEMPLATE_ACTIONS + 1 actions on one trigger, as many as fit in MAX_TEMPLATE_BYTES; or,
    `over_at_the_end`, steps of MAX_TEMPLATE_ACTIONS actions with the last that fits one over."""

    def step(i: int, actions: int) -> list[str]:
        events = ["    events:", "      on_turn_complete:", *["        - type: move_to_next"] * actions]
        return [f"  - id: s{i}", f"    name: Step {i}", f"    position: {i}", *events]

    lines = ["id: cost", "name: Cost", "steps:"]
    per_step = MAX_TEMPLATE_ACTIONS if over_at_the_end else MAX_TEMPLATE_ACTIONS + 1
    for i in range(n):
        room = MAX_TEMPLATE_BYTES - sum(len(line) + 1 for line in lines + step(i, per_step))
        if over_at_the_end and room < sum(len(line) + 1 for line in step(i + 1, MAX_TEMPLATE_ACTIONS + 1)):
            lines += step(i, MAX_TEMPLATE_ACTIONS + 1)
            break
        if room < 0:
            break
        lines += step(i, per_step)
    lines.insert(6, "    is_start_step: true")
    return "\n".join(lines) + "\n"


def _unknown_key_at_the_end(n: int) -> str:
    """`last+1` with its last trigger back at the limit and an unknown key in its last step: every count
    legal, the whole text read and validated before the refusal."""
    text = _actions_up_to_the_byte_cap(n, over_at_the_end=True)
    head, last = text.rsplit("\n  - id: ", 1)
    lines = last.splitlines()
    lines = [*lines[:2], "    colour: x", *lines[2 : 4 + MAX_TEMPLATE_ACTIONS]]
    return head + "\n  - id: " + "\n".join(lines) + "\n"


def hostile(n: int) -> dict[str, str]:
    """Templates at the limits that must be refused, by name."""
    cycle = template(n, chain=True).replace(
        "    is_start_step: true\n", f"    is_start_step: true\n    pull_from_step_id: s{n - 1}\n", 1
    )
    over = template(n + 1, chain=False).replace("    position:", "    colour: x\n    position:")
    bomb = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "x"] * 9) + "]\n" for i in range(9))
    return {
        "cycle": cycle,
        "steps+1": over,
        "actions+1": _actions_up_to_the_byte_cap(n, over_at_the_end=False),
        "last+1": _actions_up_to_the_byte_cap(n, over_at_the_end=True),
        "last-key": _unknown_key_at_the_end(n),
        "alias": bomb,
    }


def refusal_time(text: str, repeat: int) -> tuple[float, float, str]:
    """The best wall-clock and CPU times of `repeat` refusals of `text` (s), and the refusal's field."""
    best, cpu, field = float("inf"), float("inf"), ""
    for _ in range(repeat):
        started, started_cpu = time.perf_counter(), time.process_time()
        try:
            load_workflow_text(text, "hostile.yml")
        except WorkflowError as exc:
            best, field = min(best, time.perf_counter() - started), exc.field
            cpu = min(cpu, time.process_time() - started_cpu)
        else:
            raise SystemExit("FAILED: a hostile template loaded")
    return best, cpu, field


async def stall_while(work: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    """Run `work` while a ticker sleeps 1 ms at a time; return its result and the longest tick gap (s)."""
    gap = 0.0
    async with trio.open_nursery() as nursery:

        async def tick(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            nonlocal gap
            last = time.perf_counter()
            task_status.started()
            while True:
                await trio.sleep(0.001)
                now = time.perf_counter()
                gap, last = max(gap, now - last), now

        await nursery.start(tick)  # ticking before the work starts
        result = await work()
        nursery.cancel_scope.cancel()
    return result, gap


async def send(rt: Runtime, message: dict[str, Any]) -> Any:
    reply = await rt.send(message)
    if not reply.ok:
        raise SystemExit(f"refused: {message['type']}: {reply.error}")
    return reply.result


async def measure(kind: str, n: int, tasks: int, directory: Path, repeat: int) -> bool:
    text = template(n, chain=kind == "chain")
    parse, parse_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        started, started_cpu = time.perf_counter(), time.process_time()
        load_workflow_text(text, f"{kind}.yml")
        parse = min(parse, time.perf_counter() - started)
        parse_cpu = min(parse_cpu, time.process_time() - started_cpu)
    db = directory / f"{kind}.db"
    async with open_runtime(db) as rt:
        started = time.perf_counter()
        _, gap = await stall_while(
            lambda: send(rt, {"type": "register_workflow", "yaml": text, "source": f"{kind}.yml"})
        )
        register = time.perf_counter() - started
        last = f"s{n - 1}"  # in the chain nothing pulls from the last step: a restart has nobody to promote
        for i in range(tasks):
            await send(
                rt, {"type": "create_task", "task_id": f"T{i}", "workflow_id": "cost", "step_id": last}
            )
    commits = 0
    original = StoreActor._submit  # every request, grouped or not, goes through it

    def counting(self: StoreActor, *args: Any) -> None:
        nonlocal commits
        commits += 1
        original(self, *args)

    StoreActor._submit = counting  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        async with open_runtime(db):
            restart = time.perf_counter() - started
    finally:
        StoreActor._submit = original  # type: ignore[method-assign]
    print(
        f"{kind:>5} n={n:,} bytes={len(text):,}: parse+validate {parse * 1000:.1f} ms "
        f"(CPU {parse_cpu * 1000:.1f} ms), register "
        f"{register * 1000:.0f} ms (longest Trio stall {gap * 1000:.1f} ms), restart with {tasks} tasks "
        f"{restart * 1000:.0f} ms in {commits} transactions"
    )
    return commits < n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", type=int, default=MAX_TEMPLATE_STEPS)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=5, help="times each parse and refusal is timed")
    parser.add_argument("--python", action="store_true", help="PyYAML's pure-Python loader only")
    args = parser.parse_args()
    if args.python:
        workflow_parse._CLoader = None
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    directory = Path(tempfile.mkdtemp(prefix="onceflow-template-cost-", dir=args.dir))
    kinds = ("plain", "chain")
    ok = all([trio.run(measure, kind, args.n, args.tasks, directory, args.repeat) for kind in kinds])
    for name, text in hostile(args.n).items():
        best, cpu, field = refusal_time(text, args.repeat)
        print(
            f"{name:>9} bytes={len(text.encode()):,}: refused in {best * 1000:.1f} ms "
            f"(CPU {cpu * 1000:.1f} ms), field {field!r}"
        )
    if not ok:
        print("FAILED: a restart ran a transaction per step", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
