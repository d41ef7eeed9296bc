"""Templates are bounded and cheap.

Hostile YAML is refused by the loader with a WorkflowError naming the file, the step and the field (or the
line, for what YAML itself refuses); validation is linear in the steps; a restart costs a transaction only
for a step someone can be promoted into.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from helpers import FIXTURES, ok, register, send
from pydantic import ValidationError

from onceflow.actors.runtime import versions
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.limits import (
    MAX_PAYLOAD_BYTES,
    MAX_TEMPLATE_ACTIONS,
    MAX_TEMPLATE_BYTES,
    MAX_TEMPLATE_STEPS,
    MAX_YAML_DEPTH,
)
from onceflow.protocol.template import parse as workflow_parse
from onceflow.protocol.template.model import _feeder_cycles
from onceflow.protocol.template.problems import problem
from onceflow.protocol.workflow import (
    IMPORT_ALLOWED_ACTIONS,
    ConfigureSessionConfig,
    Step,
    Trigger,
    Workflow,
    WorkflowError,
    load_workflow_text,
)
from onceflow.store.writer import StoreActor

WORKFLOWS = FIXTURES / "workflows"
MINIMAL = (WORKFLOWS / "minimal.yml").read_text(encoding="utf-8")
WIP = (WORKFLOWS / "wip.yml").read_text(encoding="utf-8")


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
def test_date_like_scalars_stay_their_text_as_kandev_reads_them(value: str) -> None:
    """A scalar YAML 1.1 resolves as a timestamp is kept as its text (Go's yaml.v3 does so for a string
    field): `name: 2001-13-45` no longer raises ValueError from inside PyYAML, and no date object escapes."""
    workflow = load_workflow_text(MINIMAL.replace("name: Fixture", f"name: {value}", 1))
    assert workflow.name == value.removeprefix("!!timestamp ")


def test_a_date_where_an_integer_belongs_names_step_and_field() -> None:
    error = refused(MINIMAL.replace("position: 0", "position: 2001-12-25", 1))
    assert (error.step_id, error.field) == ("todo", "steps[0].position")
    assert "valid integer" in error.message


@pytest.mark.parametrize("literal", ["9" * 5000, "-" + "9" * 5000, "0x" + "f" * 5000, "1" + "_0" * 4000])
def test_a_5000_digit_position_names_step_and_field(literal: str) -> None:
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
        "description2:\n" + "".join("  " * i + "- \n" for i in range(1, 300)),  # 300: indentation's bytes
    ],
    ids=["flow_sequences", "flow_mappings", "block_sequences"],
)
def test_hundreds_of_levels_of_nesting_are_refused_naming_the_line(deep: str) -> None:
    error = refused(MINIMAL + deep + "\n")
    assert error.field == "" and f"nested deeper than {MAX_YAML_DEPTH} levels" in error.message
    assert "(line " in error.message


def test_nesting_up_to_the_limit_loads_into_a_payload() -> None:
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


def test_yaml_aliases_are_refused_naming_the_line() -> None:
    """An 823-byte alias bomb nested 9 deep under a queue_run payload used to register and then freeze the
    process at every entry of the step (the payload expanded and hashed); aliases are now refused."""
    text = with_payload(ALIAS_BOMB)
    started = time.perf_counter()
    error = refused(text, "bomb.yml")
    assert error.field == "" and "YAML aliases (*l0) are not allowed" in error.message
    line = next(n for n, row in enumerate(text.splitlines(), start=1) if "*l0" in row)
    assert f"(line {line}, " in error.message
    assert time.perf_counter() - started < 5  # refused before anything is expanded


def test_an_anchor_without_alias_still_loads() -> None:
    assert load_workflow_text(MINIMAL.replace("name: Fixture", "name: &n Fixture", 1)).name == "Fixture"


def test_template_size_is_capped_in_utf8_bytes() -> None:
    padding = "# " + "é" * (MAX_TEMPLATE_BYTES // 2) + "\n"  # fewer characters than the cap, more bytes
    assert len(MINIMAL + padding) < MAX_TEMPLATE_BYTES < len((MINIMAL + padding).encode())
    error = refused(MINIMAL + padding)
    assert error.field == "" and f"at most {MAX_TEMPLATE_BYTES} bytes" in error.message


def test_payload_encoded_size_is_capped_naming_step_and_field() -> None:
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
def test_a_payload_that_is_not_json_is_refused_at_load(payload: str, fragment: str) -> None:
    """Refused when registered, not when the step is entered (its canonical JSON is hashed per entry)."""
    error = refused(with_payload(payload))
    assert (error.step_id, error.field) == ("review", "steps[2].events.on_enter[0].config.payload")
    assert fragment in error.message


def test_step_count_is_capped() -> None:
    error = refused(chain(MAX_TEMPLATE_STEPS + 1))
    assert error.field == "steps" and str(MAX_TEMPLATE_STEPS) in error.message


def test_actions_per_trigger_are_capped() -> None:
    actions = "".join("        - type: move_to_next\n" for _ in range(MAX_TEMPLATE_ACTIONS + 1))
    text = MINIMAL.replace(
        "      on_turn_complete:\n        - type: move_to_next\n", "      on_turn_complete:\n" + actions
    )
    error = refused(text)
    assert (error.step_id, error.field) == ("work", "steps[1].events.on_turn_complete")


def test_a_step_id_is_bounded_like_a_protocol_id() -> None:
    error = refused(MINIMAL.replace("id: todo", "id: " + "t" * 257, 1))
    assert error.field == "steps[0].id"
    assert refused(MINIMAL.replace("id: todo", 'id: "to\\ndo"', 1)).field == "steps[0].id"


async def test_hostile_templates_over_the_protocol_get_workflow_invalid(runtime: Runtime) -> None:
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


def test_feeder_cycle_check_is_linear() -> None:
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


def test_a_feeder_chain_at_the_step_cap_validates() -> None:
    workflow = load_workflow_text(chain(MAX_TEMPLATE_STEPS))
    assert (
        workflow.fed_by("s0") == (workflow.step("s1"),)
        and workflow.fed_by(f"s{MAX_TEMPLATE_STEPS - 1}") == ()
    )


def test_a_cycle_is_reported_at_its_first_step_with_its_links() -> None:
    """A chain leading into a cycle is not itself reported; the cycle's first step (in file order) is."""
    text = chain(4).replace(
        "    wip_limit: 5\n    pull_from_step_id: s0\n", "    wip_limit: 5\n    pull_from_step_id: s3\n", 1
    )
    text += "  - id: tail\n    name: Tail\n    position: 9\n    pull_from_step_id: s2\n"
    error = refused(text)
    assert (error.step_id, error.field) == ("s1", "steps[1].pull_from_step_id")
    assert error.message == "pull_from_step_id links form a cycle: s1 -> s3 -> s2 -> s1"


def test_a_feeder_chain_through_an_unknown_step_names_that_step() -> None:
    """s1 pulls from s2, which pulls from a step that does not exist: s2 is named (this used to escape the
    loader as a KeyError, raised out of `Runtime.send`)."""
    text = chain(3).replace("pull_from_step_id: s1", "pull_from_step_id: ghost", 1)
    text = text.replace("pull_from_step_id: s0", "pull_from_step_id: s2", 1)
    error = refused(text)
    assert (error.step_id, error.field) == ("s2", "steps[2].pull_from_step_id")
    assert "'ghost' is not a step" in error.message


# --- the runtime: parse off the Trio thread, restart without a transaction per step -------------------


async def test_registration_parses_in_a_worker_thread(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing a template at the step cap is CPU-bound; other Trio tasks keep running meanwhile (the parse
    runs in a worker thread, not on the Trio thread). Shown without a clock: the parse records that it is
    outside the Trio run, then waits until another Trio task has run since it began, which it would wait
    for in vain on the Trio thread."""
    real = versions.load_workflow_text
    began, ticked = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def parse(*args: Any, **kwargs: Any) -> Any:
        seen["in_trio"] = trio.lowlevel.in_trio_run()
        began.set()
        seen["others_ran"] = ticked.wait(5)
        return real(*args, **kwargs)

    async def other_task() -> None:
        while not began.is_set():
            await trio.sleep(0.001)
        ticked.set()

    monkeypatch.setattr(versions, "load_workflow_text", parse)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        reply = await send(runtime, {"type": "register_workflow", "yaml": chain(MAX_TEMPLATE_STEPS)})
    assert reply.ok, reply.error
    assert seen == {"in_trio": False, "others_ran": True}


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


async def test_restart_costs_no_transaction_per_idle_step(
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


async def test_start_up_still_pulls_from_a_feeder_and_onwards(db_path: Path) -> None:
    """What start-up promotion did before it skipped idle steps, it still does: a task admitted at a feeder
    is pulled into the step with room (rule 2), and on into the step that step feeds, in position order."""
    async with open_runtime(db_path) as rt:
        await register(rt, WIP)
        await ok(rt, {"type": "create_task", "task_id": "A", "workflow_id": "wip", "step_id": "backlog"})
        assert (await ok(rt, {"type": "get_task", "task_id": "A"})).result["step_id"] == "backlog"
    async with open_runtime(db_path) as rt:
        task = (await ok(rt, {"type": "get_task", "task_id": "A"})).result
        assert (task["step_id"], task["wip_admitted"]) == ("review", True)


# --- libyaml reads every template as the pure-Python loader does -----------------------------------------

YAML_FILES = sorted(
    [*FIXTURES.rglob("*.yml"), *(FIXTURES.parent.parent / "onceflow" / "examples").rglob("*.yml")]
)

TRICKY_DOCUMENTS = [
    "a: 0x1F\nb: 0o17\nc: 017\nd: 1_000\ne: 1:30\nf: -0b101\ng: +12\n",  # YAML 1.1 integers
    "a: 1.5\nb: .inf\nc: -.Inf\nd: .nan\ne: 1e3\nf: 6.8523015e+5\ng: 190:20:30.15\n",
    "a: yes\nb: No\nc: on\nd: OFF\ne: ~\nf: null\ng:\nh: true\n",
    "a: 2001-12-14t21:59:43.10-05:00\nb: 2002-12-14\nc: !!timestamp 2001-13-45\n",
    "a: !!str 12\nb: !!int '7'\nc: !!float '1'\nd: !!binary aGVsbG8=\ne: !!null ''\n",
    "s: !!set {a, b}\no: !!omap [{x: 1}, {y: 2}]\np: !!pairs [{x: 1}, {x: 2}]\n",
    "base: &b {x: 1}\nmerged: {<<: {y: 2}, z: 3}\n",
    "lit: |\n  one\n  two\n\nfold: >-\n  one\n  two\nkeep: |+\n  x\n\n",
    "q: \"tab\\there \\u00e9 \\x41 \\U0001F600\"\nsq: 'it''s'\nplain: a b c\n",
    "flow: [a, {b: c}, [d, e], 'f', \"g\"]\nempty: []\nnone: {}\n",
    "? complex\n: value\n? [a, b]\n: seq key\n",
    "%YAML 1.1\n---\nid: x\n...\n",
    "\ufeffid: bom\n",
    "name: café ünïcode ✓ 😀\nmulti: line one\n  continued\n",
    "# only a comment\n",
    "a:\n  - b\n  -   - c\n      - d\n  - e: f\n    g: h\n",
    "key with spaces: value # comment\n'quoted key': 1\n\"dq key\": 2\n",
    "big: 123456789012345678901234567890\nneg: -9223372036854775809\n",
    "lenient: !!binary '%%%'\n",
    "name: 'R&D *not an alias*'\nother: \"&anchor-like *text\"\n",
]

MALFORMED_DOCUMENTS = [
    "id: x\nsteps: [\n",
    "id: x\nname: a\nid: y\n",
    "a: &x 1\nb: &x 2\n",
    "a: *nowhere\n",
    "a: &x [1]\nb: *x\n",
    "a: &x [*x]\n",
    "a: &x\n  b: *x\n",
    "---\na: 1\n---\nb: 2\n",
    "a:\n\t- tab\n",
    "a: b: c\n",
    "a: [1, 2\nb: 3\n",
    "a: 'unterminated\n",
    'a: "bad escape \\q"\n',
    "a: \x01control\n",
    "a: \ud800\n",
    "x: " + "[" * 70 + "]" * 70 + "\n",
    "x: " + "[" * 2000 + "\n",
    "x:\n" + "".join("  " * i + "- \n" for i in range(1, 80)),
    "a: !!int nope\n",
    "a: !!float nope\n",
    "a: !!bool maybe\n",
    "a: !custom 1\n",
    "plain: a b: c\n",
    "[a, b]: 1\n{c: d}: 2\n",
    "- a\nb: c\n",
]


def _every_reading(text: str) -> dict[str, str]:
    """`repr` of what each path reads from `text` (or of its refusal): the pure-Python loader, what
    `load_workflow_text` parses, libyaml's loader alone and the reader of libyaml's events alone, each
    when it reads the text."""
    encoded = text.encode("utf-8", "surrogatepass")
    loaders: list[tuple[str, Callable[[], Any]]] = [
        ("python", lambda: yaml.load(text, Loader=workflow_parse._StrictLoader)),
        ("parse_yaml", lambda: workflow_parse.parse_yaml(text, encoded)),
    ]
    readings = {}
    for name, load in loaders:
        try:
            readings[name] = repr(load())
        except yaml.YAMLError as exc:
            readings[name] = f"{type(exc).__name__}: {workflow_parse.yaml_problem(exc)}"
    assert workflow_parse._CLoader is not None, "PyYAML without libyaml: nothing to compare"
    with contextlib.suppress(yaml.YAMLError, workflow_parse._Unbounded):  # else `_StrictLoader` reads it
        readings["libyaml"] = repr(yaml.load(encoded, Loader=workflow_parse._CLoader))  # type: ignore[arg-type]
    with contextlib.suppress(yaml.YAMLError, workflow_parse._NotPlain):  # else the node graph reads it
        readings["events"] = repr(workflow_parse._read_events(encoded))
    return readings


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.name for p in YAML_FILES])
def test_libyaml_reads_every_bundled_template_as_the_python_loader_does(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    readings = _every_reading(text)
    assert set(readings.values()) == {readings["python"]}, readings


@pytest.mark.parametrize("text", TRICKY_DOCUMENTS)
def test_libyaml_reads_yaml_11_corner_cases_as_the_python_loader_does(text: str) -> None:
    readings = _every_reading(text)
    assert set(readings.values()) == {readings["python"]}, readings


@pytest.mark.parametrize("text", MALFORMED_DOCUMENTS)
def test_a_refusal_reads_as_the_python_loader_words_it(text: str) -> None:
    """Whatever path refused it (libyaml's scanner, its composer, the node check, the constructor), the
    refusal `load_workflow_text` gives is the pure-Python loader's, at the same line and column."""
    readings = _every_reading(text)
    assert readings["parse_yaml"] == readings["python"], readings
    assert not readings["python"].startswith(("{", "[", "None")), readings  # each one is refused


def test_libyaml_reads_a_template_at_the_step_cap_as_the_python_loader_does() -> None:
    readings = _every_reading(chain(MAX_TEMPLATE_STEPS))
    assert set(readings.values()) == {readings["python"]}


# --- count limits first, before any step is validated ---------------------------------------------------


def _steps_yaml(n: int, extra: str = "") -> str:
    lines = ["id: counted", "name: Counted", "steps:"]
    for i in range(n):
        lines += [f"  - id: s{i}", f"    name: S{i}", f"    position: {i}"]
        lines += ["    is_start_step: true"] if i == 0 else []
        lines += [extra] if extra else []
    return "\n".join(lines) + "\n"


def test_too_many_steps_is_the_one_problem_reported_even_when_every_step_is_also_wrong() -> None:
    """Full validation would check all 1,001 steps and report 1,001 unknown keys, burying the step cap;
    the count is checked first and is the refusal, in the words full validation uses for it."""
    error = refused(_steps_yaml(MAX_TEMPLATE_STEPS + 1, "    colour: red"))
    assert (error.step_id, error.field, error.others) == (None, "steps", ())
    assert error.message.startswith(f"Tuple should have at most {MAX_TEMPLATE_STEPS} items")
    valid = _steps_yaml(MAX_TEMPLATE_STEPS + 1)
    with pytest.raises(ValidationError) as full:
        Workflow.model_validate(yaml.safe_load(valid))
    (expected,) = [problem(e, Workflow) for e in full.value.errors()]
    assert (("steps",), refused(valid).message) == expected


def _over(trigger: str = "on_turn_complete", n: int = MAX_TEMPLATE_ACTIONS + 1, kind: str = "nope") -> str:
    return f"    events:\n      {trigger}:\n" + f"        - type: {kind}\n" * n


def _configure(n: int = MAX_TEMPLATE_ACTIONS + 1, trigger: str = "on_enter") -> str:
    rules = "".join(f"                - {{agent_name: a{i}, operation: keep}}\n" for i in range(n))
    return (
        f"    events:\n      {trigger}:\n        - config:\n            rules:\n{rules}"
        "          type: configure_session\n"
    )


def _with(text: str, step: int, lines: str) -> str:
    return text.replace(f"    position: {step}\n", f"    position: {step}\n" + lines, 1)


def _every_refusal(text: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, str, str, int]]:
    """The refusal read through libyaml's events, and through the pure-Python loader then the mapping."""
    readings = [refused(text)]
    with monkeypatch.context() as patched:
        patched.setattr(workflow_parse, "_CLoader", None)
        readings.append(refused(text))
    return [(e.step_id, e.field, e.message, len(e.others)) for e in readings]


OVER_COUNTS = {
    "actions": (_with(_steps_yaml(3), 1, _over()), "s1", "steps[1].events.on_turn_complete"),
    "rules": (_with(_steps_yaml(3), 2, _configure()), "s2", "steps[2].events.on_enter[0].config.rules"),
    "first written trigger": (
        _with(_steps_yaml(3), 1, _over("on_turn_complete") + _over("on_enter")[len("    events:\n") :]),
        "s1",
        "steps[1].events.on_turn_complete",
    ),
    "rules before their list": (
        _with(_steps_yaml(3), 2, _configure() + "        - type: clear_decisions\n" * MAX_TEMPLATE_ACTIONS),
        "s2",
        "steps[2].events.on_enter[0].config.rules",
    ),
    "a step before the step count": (
        _with(_steps_yaml(MAX_TEMPLATE_STEPS + 1), 7, _over()),
        "s7",
        "steps[7].events.on_turn_complete",
    ),
    "steps": (_steps_yaml(MAX_TEMPLATE_STEPS + 1), None, "steps"),
    "the id after the events": (
        _steps_yaml(3).replace(
            "  - id: s1\n    name: S1\n    position: 1\n",
            "  - " + _over()[4:] + "    id: s1\n    name: S1\n    position: 1\n",
        ),
        "s1",
        "steps[1].events.on_turn_complete",
    ),
    "an anchor elsewhere": (
        _with(_steps_yaml(3), 1, _over()).replace("name: S0", "name: &n S0"),
        "s1",
        "steps[1].events.on_turn_complete",
    ),
}


@pytest.mark.parametrize("name", OVER_COUNTS)
def test_the_first_count_problem_is_the_refusal_alone_on_every_path(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from libyaml's events (the count measured as each list ends) or from a mapping (the pure-Python
    loader, or an anchor sending libyaml back to its node graph): the same first count problem in reading
    order, in the words full validation uses for it, and nothing else."""
    text, step_id, field = OVER_COUNTS[name]
    (first, second) = _every_refusal(text, monkeypatch)
    assert first == second
    assert first[:2] == (step_id, field) and first[3] == 0
    limit = MAX_TEMPLATE_STEPS if field == "steps" else MAX_TEMPLATE_ACTIONS
    assert f"at most {limit} items" in first[2]


def test_a_list_of_that_size_elsewhere_is_no_count_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the counted lists are counted: 65 rules under a trigger written as a mapping (not a list of
    actions) are left to validation, which refuses the mapping, on every path."""
    mapping = "      on_enter:\n        x:\n          config:"
    configure = _configure().replace("      on_enter:\n        - config:", mapping)
    (first, second) = _every_refusal(_with(_steps_yaml(3), 1, configure), monkeypatch)
    assert first == second
    assert first[:2] == ("s1", "steps[1].events.on_enter") and "expected a list" in first[2]


def test_a_count_problem_is_the_refusal_before_the_rest_of_the_text_is_read() -> None:
    """The reader stops once the step holding the first count problem is read: a later count problem, an
    alias or text that is not YAML at all is never reached (a whole 1 MiB template would cost a second)."""
    text = _with(_with(_steps_yaml(3), 1, _over()), 2, _configure())
    for tail in ("oops: [\n", "x: &a [1]\ny: *a\n", "name: again\n"):
        error = refused(text + tail)
        assert (error.step_id, error.field, error.others) == ("s1", "steps[1].events.on_turn_complete", ())


def test_counts_at_the_limits_load_as_the_python_loader_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly MAX_TEMPLATE_ACTIONS actions on a trigger and rules in a configure_session is not over."""
    text = _with(_steps_yaml(3), 1, _over("on_turn_complete", MAX_TEMPLATE_ACTIONS, "move_to_next"))
    rules = _configure(MAX_TEMPLATE_ACTIONS).replace("    events:\n", "", 1)
    text = text.replace("      on_turn_complete:\n", rules + "      on_turn_complete:\n", 1)
    workflow = load_workflow_text(text, allowed_actions=IMPORT_ALLOWED_ACTIONS)
    step = workflow.step("s1")
    assert len(step.events.actions(Trigger.on_turn_complete)) == MAX_TEMPLATE_ACTIONS
    (configure,) = step.events.actions(Trigger.on_enter)
    assert (
        isinstance(configure.config, ConfigureSessionConfig)
        and len(configure.config.rules) == MAX_TEMPLATE_ACTIONS
    )
    monkeypatch.setattr(workflow_parse, "_CLoader", None)
    assert load_workflow_text(text, allowed_actions=IMPORT_ALLOWED_ACTIONS) == workflow


def test_within_the_counts_every_problem_is_still_found_in_one_pass() -> None:
    error = refused(_steps_yaml(3, "    colour: red"))
    assert [p.field for p in (error, *error.others)] == [f"steps[{i}].colour" for i in range(3)]


def test_a_pull_from_cycle_through_every_step_at_the_cap_is_refused_at_its_first_step() -> None:
    text = chain(MAX_TEMPLATE_STEPS).replace(
        "    is_start_step: true\n",
        f"    is_start_step: true\n    pull_from_step_id: s{MAX_TEMPLATE_STEPS - 1}\n",
    )
    error = refused(text)
    assert (error.step_id, error.field) == ("s0", "steps[0].pull_from_step_id")
    assert error.message.startswith(
        f"pull_from_step_id links form a cycle: s0 -> s{MAX_TEMPLATE_STEPS - 1} -> "
    )
    assert error.message.endswith(" -> s1 -> s0")
