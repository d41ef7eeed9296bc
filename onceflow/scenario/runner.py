"""Running scenarios: each on a fresh database under one mock clock, compared step by step. Main thread,
one Trio run per scenario.

Each scenario runs on a fresh database in a temporary directory, with a `RecordingHost` (and, when the
scenario declares one, a `RecordingCoordinator`). Time: the runtime's wall clock (Unix seconds, starting
at 1,700,000,000) and Trio's clock are one mock clock, and `advance` moves both, stopping at every Trio
deadline on the way (coordinator retries, redelivery timers) and letting the runtime go idle before moving
on. On a mismatch the failing step is reported with one line per differing value (its path and both
values, `result.task.step_id: expected "work", got "backlog"`), then a unified diff of expected vs actual
(actual events shown with the fields the expectation names), and the scenario stops; exit status 1. On
success one line per scenario: `ok: NAME (N steps)`. The format is onceflow/scenario/format.py's.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.events import Event, Reply
from onceflow.scenario.format import (
    START,
    ExpectedError,
    LoadedScenario,
    ScenarioError,
    Step,
    load_scenarios,
)
from onceflow.store.backends.connection import Connection
from onceflow.store.writer import Durability, StoreActor
from onceflow.testing import RecordingCoordinator, RecordingHost

if TYPE_CHECKING:
    import trio.testing  # imported when a scenario runs: it imports pytest where pytest is installed


@attrs.frozen
class ScenarioResult:
    """`failure` is None when every step held, else the report of the first step that did not."""

    name: str
    steps: int
    failure: str | None = None


def run_scenario(scenario: LoadedScenario) -> ScenarioResult:
    """Run one scenario on a fresh database under a mock clock; never raises for a failing step.

    Raises only what the runtime itself raises on open (e.g. an OSError for the temporary directory).
    """
    import trio.testing

    clock = trio.testing.MockClock()
    with tempfile.TemporaryDirectory(prefix="onceflow-scenario-") as tmp:
        failure = trio.run(_Runner(scenario, clock, Path(tmp) / "scenario.db").run, clock=clock)
    return ScenarioResult(scenario.name, len(scenario.spec.steps), failure)


class _Runner:
    def __init__(self, scenario: LoadedScenario, clock: trio.testing.MockClock, db: Path) -> None:
        self.scenario, self.spec, self.mock, self.db = scenario, scenario.spec, clock, db
        settings = self.spec.coordinator
        self.coordinator = (
            None if settings is None else RecordingCoordinator(fence=settings.fence, down=settings.down)
        )

    def now(self) -> float:
        return START + self.mock.current_time()

    async def run(self) -> str | None:
        """Every step in order, reopening the runtime at each restart; the first failure's report."""
        index, setup = 0, True
        while True:
            async with open_runtime(
                self.db,
                host=RecordingHost(),
                clock=self.now,
                durability=Durability.NORMAL,  # a scenario never survives a power loss anyway
                coordinator=self.coordinator,
                redelivery_interval=self.spec.redelivery_interval,
            ) as rt:
                events = rt.subscribe()
                if setup:
                    setup = False
                    failure = await self._setup(rt)
                    if failure is not None:
                        return failure
                while index < len(self.spec.steps):
                    step, at = self.spec.steps[index], index
                    index += 1
                    if step.restart:
                        break
                    failure = await self._step(rt, step, events)
                    if failure is not None:
                        return f"steps[{at}] ({_describe(step)}): {failure}"
                else:
                    return None

    async def _setup(self, rt: Runtime) -> str | None:
        register = {
            "type": "register_workflow",
            "yaml": self.scenario.template_text,
            "source": str(self.scenario.template_path),
            "import_path": self.spec.import_path,
        }
        reply = await rt.send(register)
        if not reply.ok or not isinstance(reply.result, dict):
            return f"template: register_workflow refused: {_refusal(reply)}"
        workflow_id = reply.result["workflow_id"]
        for number, seat in enumerate(self.spec.participants):
            reply = await rt.send(
                {"type": "add_participant", "workflow_id": workflow_id, **seat.model_dump()}
            )
            if not reply.ok:
                return f"participants[{number}]: add_participant refused: {_refusal(reply)}"
        await _settle(rt.services.store)
        return None

    async def _step(
        self, rt: Runtime, step: Step, background: trio.MemoryReceiveChannel[Event]
    ) -> str | None:
        _drain(background)  # what earlier steps emitted
        if step.coordinator is not None:
            assert self.coordinator is not None
            if step.coordinator.down is not None:
                self.coordinator.down = step.coordinator.down
            if step.coordinator.fence is not None:
                self.coordinator.fence = step.coordinator.fence
            return None
        if step.advance is not None:
            await _advance(rt.services.store, self.mock, step.advance)
            return _compare_events(step, _drain(background))
        assert step.send is not None
        reply = await rt.send(step.send)
        await _settle(rt.services.store)
        own = {id(event) for event in reply.events}
        emitted = reply.events + [event for event in _drain(background) if id(event) not in own]
        return _compare_reply(step, reply) or _compare_events(step, emitted)


def _drain(channel: trio.MemoryReceiveChannel[Event]) -> list[Event]:
    out = []
    while True:
        try:
            out.append(channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


def _total_changes(conn: Connection) -> int:
    """How many rows the connection has changed since it opened (a scenario runs on a SQLite file)."""
    return cast(sqlite3.Connection, conn).total_changes


async def _settle(store: StoreActor) -> None:
    """Return once the runtime is idle: every task blocked, and a full round in which no store write ran.

    A task waiting for the store's writer thread counts as blocked, so each round ends with a no-op store
    request: requests queued before it are answered first (the store is FIFO) and their callers run on.
    """
    import trio.testing

    await trio.testing.wait_all_tasks_blocked()
    changes = await store.transact(_total_changes)
    while True:
        await trio.testing.wait_all_tasks_blocked()
        now = await store.transact(_total_changes)
        if now == changes:
            return
        changes = now


async def _advance(store: StoreActor, clock: trio.testing.MockClock, seconds: float) -> None:
    """Move the mock clock `seconds` forward, stopping at each Trio deadline on the way until idle."""
    target = trio.current_time() + seconds
    while True:
        await _settle(store)
        wait = trio.lowlevel.current_statistics().seconds_to_next_deadline
        if trio.current_time() + wait > target:
            break
        clock.jump(wait)
    clock.jump(target - trio.current_time())
    await _settle(store)


# --- comparing ------------------------------------------------------------------------------------------


def _describe(step: Step) -> str:
    what = (
        f"send {step.send.get('type', '?')}"
        if step.send is not None
        else f"advance {step.advance:g} s"
        if step.advance is not None
        else "coordinator"
    )
    return f"{what}: {step.note}" if step.note else what


def _refusal(reply: Reply) -> str:
    if reply.error is None:
        return "no error"
    field = f" (field {reply.error.field})" if reply.error.field else ""
    return f"{reply.error.code}{field}: {reply.error.message}"


def _compare_reply(step: Step, reply: Reply) -> str | None:
    expected = step.error
    if expected is not None:
        want = expected if isinstance(expected, ExpectedError) else ExpectedError(code=expected)
        field = f" (field {want.field})" if want.field else ""
        if reply.ok:
            return f"expected error {want.code}{field}, but the command succeeded"
        assert reply.error is not None
        if reply.error.code != want.code or (want.field is not None and reply.error.field != want.field):
            return f"expected error {want.code}{field}, got {_refusal(reply)}"
        return None
    if not reply.ok:
        return f"refused: {_refusal(reply)}"
    if "result" in step.model_fields_set:
        actual = reply.model_dump(mode="json")["result"]
        if not matches(step.result, actual):
            where = "".join(f"\n    {line}" for line in mismatches(step.result, actual, "result"))
            return (
                "result differs"
                + where
                + "\n"
                + _diff(_render(step.result), _render(_project(step.result, actual)))
            )
    return None


def matches(expected: Any, actual: Any) -> bool:
    """Subset match: a mapping's named keys match recursively (others are ignored); a list matches item by
    item and must have the same length; a bool equals only a bool; other values are compared with `==`."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and matches(value, actual[key]) for key, value in expected.items()
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(matches(want, got) for want, got in zip(expected, actual, strict=True))
        )
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    return bool(expected == actual)


_MISSING = object()


def mismatches(expected: Any, actual: Any, path: str) -> list[str]:
    """Where `actual` fails `matches(expected, actual)`: one line per differing leaf, naming its path
    (`result.task.step_id`, `events[1].agent_profile_id`) and both values as JSON (`(missing)` for a key
    the actual value lacks), so a difference deep inside a mapping is named, not shown as a changed `{}`.
    Empty when they match."""
    if actual is _MISSING:
        return [f"{path}: expected {_json(expected)}, got (missing)"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        return [
            line
            for key, value in expected.items()
            for line in mismatches(value, actual.get(key, _MISSING), f"{path}.{key}")
        ]
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [
            line
            for index, (want, got) in enumerate(zip(expected, actual, strict=True))
            for line in mismatches(want, got, f"{path}[{index}]")
        ]
    if isinstance(expected, list) and isinstance(actual, list):
        return [f"{path}: expected {len(expected)} items, got {len(actual)}"]
    return [] if matches(expected, actual) else [f"{path}: expected {_json(expected)}, got {_json(actual)}"]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "), sort_keys=True)


def _project(expected: Any, actual: Any) -> Any:
    """`actual` cut down to what `expected` names, so a diff shows only what the author asked about."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return {key: _project(expected[key], actual[key]) for key in expected if key in actual}
    if isinstance(expected, list) and isinstance(actual, list):
        shape = expected[-1] if expected else None
        return [_project(expected[i] if i < len(expected) else shape, got) for i, got in enumerate(actual)]
    return actual


def _compare_events(step: Step, emitted: list[Event]) -> str | None:
    if step.events is None and step.event_types is None:
        return None
    expected = step.events or []
    types = step.event_types if step.event_types is not None else sorted({p["type"] for p in expected})
    actual = [event.model_dump(mode="json") for event in emitted if types == "all" or event.type in types]
    if step.events_order == "in_order":
        same = len(expected) == len(actual) and all(map(matches, expected, actual))
    else:
        same = len(expected) == len(actual) and _perfect_matching(expected, actual)
    if same:
        return None
    keys: dict[str, list[str]] = {}  # per type, every field some pattern of that type names
    for pattern in expected:
        names = keys.setdefault(pattern["type"], [])
        names += [key for key in pattern if key not in names]

    def shown(index: int, event: dict[str, Any]) -> dict[str, Any]:
        if step.events_order == "in_order" and index < len(expected):  # line up with what was expected
            names = list(expected[index])
        else:
            names = keys.get(event["type"]) or list(event)
        return {key: event[key] for key in names if key in event}

    want = [_line(p) for p in expected]
    got = [_line(shown(i, event)) for i, event in enumerate(actual)]
    if step.events_order == "any_order":
        want, got = sorted(want), sorted(got)
    scope = "all types" if types == "all" else ", ".join(types) or "none"
    where = [f"expected {len(expected)} events, got {len(actual)}"] if len(expected) != len(actual) else []
    if step.events_order == "in_order":
        where += [
            line
            for i, pair in enumerate(zip(expected, actual, strict=False))  # the shorter: counted above
            for line in mismatches(*pair, f"events[{i}]")
        ]
    named = "".join(f"\n    {line}" for line in where)
    return f"events differ ({step.events_order}; compared types: {scope}){named}\n" + _diff(want, got)


def _perfect_matching(patterns: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
    """Whether each pattern can take a distinct event it matches (Kuhn's augmenting paths)."""
    owner: dict[int, int] = {}

    def place(p: int, seen: set[int]) -> bool:
        for e, event in enumerate(events):
            if e not in seen and matches(patterns[p], event):
                seen.add(e)
                if e not in owner or place(owner[e], seen):
                    owner[e] = p
                    return True
        return False

    return all(place(p, set()) for p in range(len(patterns)))


def _line(data: dict[str, Any]) -> str:
    ordered = {"type": data["type"], **data} if "type" in data else data
    return json.dumps(ordered, separators=(", ", ": "))


def _render(value: Any) -> list[str]:
    return json.dumps(value, indent=2, sort_keys=True).splitlines()


def _diff(expected: list[str], actual: list[str]) -> str:
    lines = difflib.unified_diff(expected, actual, "expected", "actual", lineterm="", n=max(len(expected), 3))
    return "\n".join(f"    {line}" for line in lines)


# --- the command ----------------------------------------------------------------------------------------


def run_files(paths: list[Path], out: Callable[[str], None] = print) -> int:
    """Load and run the scenarios of every file; print `ok: NAME (N steps)` or a failure report for each.

    Returns the exit status: 0 when every scenario held, 1 when one failed or a file was invalid (reported
    on stderr as `invalid: FILE: FIELD: message`; the other files still run).
    """
    status = 0
    for path in paths:
        try:
            scenarios = load_scenarios(path)
        except ScenarioError as exc:
            print(f"invalid: {exc}", file=sys.stderr)
            status = 1
            continue
        for scenario in scenarios:
            result = run_scenario(scenario)
            if result.failure is None:
                out(f"ok: {result.name} ({result.steps} steps)")
            else:
                out(f"FAIL: {result.name}: {result.failure}")
                status = 1
    return status


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `onceflow test SCENARIO.yml...` to the `onceflow` parser (it sets `handler`)."""
    test = sub.add_parser("test", help="run scenario tests of workflow templates")
    test.add_argument("files", type=Path, nargs="+", help="scenario YAML files")
    test.set_defaults(handler=lambda args: run_files(args.files))
