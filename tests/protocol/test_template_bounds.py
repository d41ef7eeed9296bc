"""Templates are bounded and cheap (issue 11, "`Runtime.send` never raises" and "Bounded everything").

Hostile YAML is refused by the loader with a WorkflowError naming the file, the step and the field (or the
line, for what YAML itself refuses); validation is linear in the steps; a restart costs a transaction only
for a step someone can be promoted into.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from helpers import FIXTURES, ok, register, send

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.limits import (
    MAX_PAYLOAD_BYTES,
    MAX_TEMPLATE_ACTIONS,
    MAX_TEMPLATE_BYTES,
    MAX_TEMPLATE_STEPS,
    MAX_YAML_DEPTH,
)
from onceflow.protocol.workflow import Step, WorkflowError, _feeder_cycles, load_workflow_text
from onceflow.store.writer import StoreActor

WORKFLOWS = FIXTURES / "workflows"
MINIMAL = (WORKFLOWS / "minimal.yml").read_text(encoding="utf-8")
WIP = (WORKFLOWS / "wip.yml").read_text(encoding="utf-8")
T = TypeVar("T")


def refused(text: str, source: str = "t.yml") -> WorkflowError:
    with pytest.raises(WorkflowError) as caught:
        load_workflow_text(text, source)
    assert str(caught.value).startswith(f"{source}: ")
    return caught.value


def with_payload(payload_yaml: str) -> str:
    """minimal.yml with a queue_run (payload given as YAML, indented for the config) on review's on_enter."""
    action = "        - type: queue_run\n          config:\n            payload:\n" + payload_yaml
    return MINIMAL.replace(
        "      on_enter:\n        - type: clear_decisions\n", "      on_enter:\n" + action, 1
    )


def chain(n: int) -> str:
    """n steps, each after the first pulling from the one before, with a WIP limit."""
    lines = ["id: chain", "name: Chain", "steps:"]
    for i in range(n):
        lines += [f"  - id: s{i}", f"    name: S{i}", f"    position: {i}"]
        lines += (
            ["    is_start_step: true"]
            if i == 0
            else ["    wip_limit: 5", f"    pull_from_step_id: s{i - 1}"]
        )
    return "\n".join(lines) + "\n"


# --- values YAML 1.1 reads as something else --------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["2001-13-45", "2001-12-25", "2001-12-14t21:59:43.10-05:00", "!!timestamp 2001-13-45"]
)
def test_issue11_date_like_scalars_stay_their_text_as_kandev_reads_them(value: str) -> None:
    """A scalar YAML 1.1 resolves as a timestamp is kept as its text (Go's yaml.v3 does so for a string
    field): `name: 2001-13-45` no longer raises ValueError from inside PyYAML, and no date object escapes."""
    workflow = load_workflow_text(MINIMAL.replace("name: Fixture", f"name: {value}", 1))
    assert workflow.name == value.removeprefix("!!timestamp ")


def test_issue11_a_date_where_an_integer_belongs_names_step_and_field() -> None:
    error = refused(MINIMAL.replace("position: 0", "position: 2001-12-25", 1))
    assert (error.step_id, error.field) == ("todo", "steps[0].position")
    assert "valid integer" in error.message


@pytest.mark.parametrize("literal", ["9" * 5000, "-" + "9" * 5000, "0x" + "f" * 5000, "1" + "_0" * 4000])
def test_issue11_a_5000_digit_position_names_step_and_field(literal: str) -> None:
    error = refused(MINIMAL.replace("position: 0", f"position: {literal}", 1))
    assert (error.step_id, error.field) == ("todo", "steps[0].position")
    assert "9223372036854775807" in error.message or "-9223372036854775808" in error.message
    assert "digits" in error.message  # the value is described, never converted or printed


# --- nesting, aliases, sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "deep",
    [
        "description2: " + "[" * 600 + "]" * 600,
        "description2: " + "{a: " * 600 + "}" * 600,
        "description2:\n" + "".join("  " * i + "- \n" for i in range(1, 600)),
    ],
    ids=["flow_sequences", "flow_mappings", "block_sequences"],
)
def test_issue11_600_levels_of_nesting_are_refused_naming_the_line(deep: str) -> None:
    error = refused(MINIMAL + deep + "\n")
    assert error.field == "" and f"nested deeper than {MAX_YAML_DEPTH} levels" in error.message
    assert "(line " in error.message


def test_issue11_nesting_up_to_the_limit_loads_into_a_payload() -> None:
    """The bound is on nesting past MAX_YAML_DEPTH, not on payloads: a payload nested 50 deep loads."""
    depth = 50
    payload = "              deep: " + "[" * depth + "1" + "]" * depth + "\n"
    workflow = load_workflow_text(with_payload(payload))
    value: Any = workflow.step("review").events.on_enter[0].config.payload["deep"]  # type: ignore[union-attr]
    for _ in range(depth):
        value = value[0]
    assert value == 1


ALIAS_BOMB = "".join(
    f"              l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "x"] * 9) + "]\n" for i in range(9)
)


def test_issue11_yaml_aliases_are_refused_naming_the_line() -> None:
    """An 823-byte alias bomb nested 9 deep under a queue_run payload used to register and then freeze the
    process at every entry of the step (the payload expanded and hashed); aliases are now refused."""
    text = with_payload(ALIAS_BOMB)
    started = time.perf_counter()
    error = refused(text, "bomb.yml")
    assert error.field == "" and "YAML aliases (*l0) are not allowed" in error.message
    line = next(n for n, row in enumerate(text.splitlines(), start=1) if "*l0" in row)
    assert f"(line {line}, " in error.message
    assert time.perf_counter() - started < 5  # refused before anything is expanded


def test_issue11_an_anchor_without_alias_still_loads() -> None:
    assert load_workflow_text(MINIMAL.replace("name: Fixture", "name: &n Fixture", 1)).name == "Fixture"


def test_issue11_template_size_is_capped_in_utf8_bytes() -> None:
    padding = "# " + "é" * (MAX_TEMPLATE_BYTES // 2) + "\n"  # fewer characters than the cap, more bytes
    assert len(MINIMAL + padding) < MAX_TEMPLATE_BYTES < len((MINIMAL + padding).encode())
    error = refused(MINIMAL + padding)
    assert error.field == "" and f"at most {MAX_TEMPLATE_BYTES} bytes" in error.message


def test_issue11_payload_encoded_size_is_capped_naming_step_and_field() -> None:
    error = refused(with_payload(f"              blob: {'x' * MAX_PAYLOAD_BYTES}\n"))
    assert (error.step_id, error.field) == ("review", "steps[2].events.on_enter[0].config.payload")
    assert f"the limit is {MAX_PAYLOAD_BYTES}" in error.message


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ("              nested: {1: one, b: two}\n", "JSON"),  # mixed keys: no canonical (sorted) encoding
        ("              ratio: .nan\n", "NaN"),
        ("              blob: !!binary aGVsbG8=\n", "JSON"),
    ],
)
def test_issue11_a_payload_that_is_not_json_is_refused_at_load(payload: str, fragment: str) -> None:
    """Refused when registered, not when the step is entered (its canonical JSON is hashed per entry)."""
    error = refused(with_payload(payload))
    assert (error.step_id, error.field) == ("review", "steps[2].events.on_enter[0].config.payload")
    assert fragment in error.message


def test_issue11_step_count_is_capped() -> None:
    error = refused(chain(MAX_TEMPLATE_STEPS + 1))
    assert error.field == "steps" and str(MAX_TEMPLATE_STEPS) in error.message


def test_issue11_actions_per_trigger_are_capped() -> None:
    actions = "".join("        - type: move_to_next\n" for _ in range(MAX_TEMPLATE_ACTIONS + 1))
    text = MINIMAL.replace(
        "      on_turn_complete:\n        - type: move_to_next\n", "      on_turn_complete:\n" + actions
    )
    error = refused(text)
    assert (error.step_id, error.field) == ("work", "steps[1].events.on_turn_complete")


def test_issue11_a_step_id_is_bounded_like_a_protocol_id() -> None:
    error = refused(MINIMAL.replace("id: todo", "id: " + "t" * 257, 1))
    assert error.field == "steps[0].id"
    assert refused(MINIMAL.replace("id: todo", 'id: "to\\ndo"', 1)).field == "steps[0].id"


async def test_issue11_hostile_templates_over_the_protocol_get_workflow_invalid(runtime: Runtime) -> None:
    """Through `register_workflow`: one typed reply naming the source, the runtime keeps serving."""
    for text in (
        with_payload(ALIAS_BOMB),
        MINIMAL + "x: " + "[" * 600,
        MINIMAL.replace("position: 0", "position: " + "9" * 5000),
    ):
        reply = await send(runtime, {"type": "register_workflow", "yaml": text, "source": "hostile.yml"})
        assert not reply.ok and reply.error is not None and reply.error.code == "workflow_invalid"
        assert reply.error.message.startswith("hostile.yml: ")
    await register(runtime, MINIMAL)


# --- feeder links: linear validation -----------------------------------------------------------------


def test_issue11_feeder_cycle_check_is_linear() -> None:
    """20,000 chained feeders (20 times the step cap) checked in well under 10 s: ~0.03 s here. The former
    walk, a list scan per link per step, was cubic (1,000 steps took seconds, 2,000 took 23 s), and even a
    quadratic one would need minutes at this size."""
    n = 20_000
    steps = tuple(
        Step.model_construct(id=f"s{i}", pull_from_step_id=f"s{i - 1}" if i else None) for i in range(n)
    )
    ids = {step.id: index for index, step in enumerate(steps)}
    looped = (Step.model_construct(id="s0", pull_from_step_id=f"s{n - 1}"), *steps[1:])
    started = time.perf_counter()
    assert _feeder_cycles(steps, ids) == frozenset()
    assert _feeder_cycles(looped, ids) == frozenset(ids)
    assert time.perf_counter() - started < 10


def test_issue11_a_feeder_chain_at_the_step_cap_validates() -> None:
    workflow = load_workflow_text(chain(MAX_TEMPLATE_STEPS))
    assert (
        workflow.fed_by("s0") == (workflow.step("s1"),)
        and workflow.fed_by(f"s{MAX_TEMPLATE_STEPS - 1}") == ()
    )


def test_issue11_a_cycle_is_reported_at_its_first_step_with_its_links() -> None:
    """A chain leading into a cycle is not itself reported; the cycle's first step (in file order) is."""
    text = chain(4).replace(
        "    wip_limit: 5\n    pull_from_step_id: s0\n", "    wip_limit: 5\n    pull_from_step_id: s3\n", 1
    )
    text += "  - id: tail\n    name: Tail\n    position: 9\n    pull_from_step_id: s2\n"
    error = refused(text)
    assert (error.step_id, error.field) == ("s1", "steps[1].pull_from_step_id")
    assert error.message == "pull_from_step_id links form a cycle: s1 -> s3 -> s2 -> s1"


def test_issue11_a_feeder_chain_through_an_unknown_step_names_that_step() -> None:
    """s1 pulls from s2, which pulls from a step that does not exist: s2 is named (this used to escape the
    loader as a KeyError, raised out of `Runtime.send`)."""
    text = chain(3).replace("pull_from_step_id: s1", "pull_from_step_id: ghost", 1)
    text = text.replace("pull_from_step_id: s0", "pull_from_step_id: s2", 1)
    error = refused(text)
    assert (error.step_id, error.field) == ("s2", "steps[2].pull_from_step_id")
    assert "'ghost' is not a step" in error.message


# --- the runtime: parse off the Trio thread, restart without a transaction per step -------------------


async def longest_stall(work: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    """Run `work` while a task ticks every millisecond; return the result and the longest tick gap."""
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


async def test_issue11_registration_parses_in_a_worker_thread(runtime: Runtime) -> None:
    """Parsing a template at the step cap takes a good fraction of a second of pure-Python YAML; other
    Trio tasks keep running meanwhile (the parse runs in a worker thread, not on the Trio thread)."""
    text = chain(MAX_TEMPLATE_STEPS)
    started = time.perf_counter()
    load_workflow_text(text)
    parse = time.perf_counter() - started
    reply, gap = await longest_stall(lambda: send(runtime, {"type": "register_workflow", "yaml": text}))
    assert reply.ok, reply.error
    assert gap < parse / 2, (gap, parse)


async def count_transactions(monkeypatch: pytest.MonkeyPatch, work: Callable[[], Awaitable[None]]) -> int:
    """How many store transactions `work` runs (the real store, wrapped to count)."""
    count = 0
    real = StoreActor._submit  # every request, grouped or not, goes through it

    def counted(self: StoreActor, *args: Any) -> None:
        nonlocal count
        count += 1
        real(self, *args)

    with monkeypatch.context() as patched:
        patched.setattr(StoreActor, "_submit", counted)
        await work()
    return count


async def test_issue11_restart_costs_no_transaction_per_idle_step(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up promotion reads where tasks stand once and promotes only steps someone can enter: a
    1,000-step chain with one task at its end restarts in a handful of transactions, not 1,000."""
    async with open_runtime(db_path) as rt:
        await register(rt, chain(MAX_TEMPLATE_STEPS))
        last = f"s{MAX_TEMPLATE_STEPS - 1}"
        await ok(rt, {"type": "create_task", "task_id": "T1", "workflow_id": "chain", "step_id": last})

    async def restart() -> None:
        async with open_runtime(db_path):
            pass

    assert await count_transactions(monkeypatch, restart) < 10


async def test_issue11_start_up_still_pulls_from_a_feeder_and_onwards(db_path: Path) -> None:
    """What start-up promotion did before it skipped idle steps, it still does: a task admitted at a feeder
    is pulled into the step with room (rule 2), and on into the step that step feeds, in position order."""
    async with open_runtime(db_path) as rt:
        await register(rt, WIP)
        await ok(rt, {"type": "create_task", "task_id": "A", "workflow_id": "wip", "step_id": "backlog"})
        assert (await ok(rt, {"type": "get_task", "task_id": "A"})).result["step_id"] == "backlog"
    async with open_runtime(db_path) as rt:
        task = (await ok(rt, {"type": "get_task", "task_id": "A"})).result
        assert (task["step_id"], task["wip_admitted"]) == ("review", True)
