"""The common entry's one-savepoint path decides every admission exactly as the per-action path does.

An on_enter of built-in clears and fan-outs is
admitted and finished in one savepoint; any anomaly rolls it back to the per-action path. Each example
draws a review step declaration (clears, fan-outs with reasons and payloads, sometimes an action the common
path does not take), seats (some without an agent, per-task ones, duplicates), a WIP limit, and a sequence
of commands (moves, redeliveries, decisions, a key taken or merged in advance). The same sequence runs on
two runtimes, the common path on and off; the database, every reply and every log must be the same.
Rules compared: AC-A3, AC-A5, AC-B5, AC-B6, AC-B7, AC-C1, AC-H6, coalesced keys, WIP
admission (E2, queued placements).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from entry_support import snapshot
from hand_clock import run_still
from helpers import START, FakeClock, send
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import onceflow.actors.engine.entry as entry
import onceflow.store.entries.admission as admission
from onceflow.actors.engine.order import dispatch_order
from onceflow.actors.kernel.outbox import EventHub, Outbox
from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.workflow import IMPORT_ALLOWED_ACTIONS, load_workflow_text
from onceflow.store.entries.common_entry import admit_common, common_plan
from onceflow.store.entries.executors import fan_out_digest, fan_out_reason
from onceflow.store.entries.participants import add_participant, dedupe_seats, step_participants
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.runs import keys, runs
from onceflow.store.tasks import tasks, workflows
from onceflow.store.writer import open_store


def run_key(key: EntryKey, position: int, agent: str, action: Any) -> str:
    """The on_enter idempotency key the fan-out `action` at `position` of entry `key` gives `agent`."""
    digest = fan_out_digest(action, fan_out_reason(action, "on_enter"))
    return keys.entry_key(key.task_id, key.step_id, key.entry_seq, position, agent, digest)


TASKS = ("T0", "T1", "T2")
ACTIONS = {
    "clear": "- type: clear_decisions",
    "fan_out": "- type: queue_run_for_each_participant\n  config: {role: reviewer}",
    "fan_out_r2": "- type: queue_run_for_each_participant\n  config: {role: reviewer, reason: r2}",
    "fan_out_approver": "- type: queue_run_for_each_participant\n  config: {role: approver, reason: ok}",
    "fan_out_payload": (
        "- type: queue_run_for_each_participant\n  config: {role: reviewer, reason: p, payload: {n: 1}}"
    ),
    "queue_run": "- type: queue_run\n  config: {target: primary}",
    "auto_start": "- type: auto_start_agent",
}


def workflow_yaml(review: list[str], wip_limit: int) -> str:
    on_enter = "\n".join(ACTIONS[name] for name in review) or "[]"
    indented = "\n".join("        " + line for line in on_enter.splitlines())
    return f"""\
id: common
name: Common
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
  - id: review
    name: Review
    position: 1
    wip_limit: {wip_limit}
    events:
      on_enter:
{indented}
"""


def mostly_common() -> st.SearchStrategy[list[str]]:
    common = st.sampled_from(["clear", "fan_out", "fan_out_r2", "fan_out_approver", "fan_out_payload"])
    rare = st.sampled_from(["queue_run", "auto_start"])
    return st.lists(st.one_of(common, common, common, rare), min_size=1, max_size=4)


commands = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "move_review",
                "move_review",
                "move_review",
                "move_work",
                "decide",
                "take_key",
                "merge_key",
                "behind",
            ]
        ),
        st.sampled_from(TASKS),
    ),
    min_size=1,
    max_size=10,
)
scenarios = st.fixed_dictionaries(
    {
        "review": mostly_common(),
        "wip_limit": st.sampled_from([0, 0, 0, 1, 2]),
        "seats": st.lists(
            st.sampled_from(
                ["rev-a", "rev-b", "rev-a", "", "approver:app-1", "own:T0:rev-a", "own:T1:rev-c"]
            ),
            max_size=4,
        ),
        "commands": commands,
    }
)


@contextmanager
def per_action_only() -> Iterator[None]:
    """The per-action path alone: no declaration qualifies for the common path."""
    original = entry.common_order
    entry.common_order = lambda executors, step, path: None  # type: ignore[assignment]
    try:
        yield
    finally:
        entry.common_order = original


async def play(
    db: Path, scenario: dict[str, Any], task_row_cache: int = 16384
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Run the scenario on a fresh runtime; every reply (as JSON) and every log of the command phase."""
    text = workflow_yaml(scenario["review"], scenario["wip_limit"])
    review = load_workflow_text(text, "t.yml", allowed_actions=IMPORT_ALLOWED_ACTIONS).step("review")
    replies: list[Any] = []
    async with open_runtime(db, clock=FakeClock(), task_row_cache=task_row_cache) as rt:
        await send(rt, {"type": "register_workflow", "yaml": text, "source": "t.yml", "import_path": True})
        for task_id in TASKS:
            await send(rt, {"type": "create_task", "task_id": task_id, "workflow_id": "common"})
        for seat in scenario["seats"]:
            replies.append((await send(rt, seat_message(seat))).model_dump())
        with capture_logs() as logs:
            for seq, (command, task_id) in enumerate(scenario["commands"]):
                if command in ("move_review", "move_work"):
                    step = command.removeprefix("move_")
                    reply = await send(rt, {"type": "move_task", "task_id": task_id, "step_id": step})
                elif command == "behind":  # the row changes behind any cached copy (no entry)
                    replies.append(await rt.services.store.transact(lambda conn, t=task_id: behind(conn, t)))
                    continue
                elif command == "decide":
                    message = {"type": "record_decision", "task_id": task_id, "step_id": "review"}
                    message |= {"decider_type": "user", "decider_id": f"u{seq}", "decision": "approved"}
                    reply = await send(rt, message)
                else:
                    requests = key_in_advance(command, task_id, review, seq)
                    results = []
                    for request in requests:
                        results.append(
                            await rt.services.store.transact(
                                lambda conn, r=request: attrs.asdict(runs.enqueue_run(conn, r, START))
                            )
                        )
                    replies.append(results)
                    continue
                replies.append(reply.model_dump())
                await settle(rt)
    return replies, logs


def seat_message(seat: str) -> dict[str, Any]:
    """The `add_participant` of one drawn seat at review: "rev-a" (a reviewer), "approver:app-1",
    "own:T0:rev-a" (task T0's own reviewer row), "" (a reviewer seat without an agent)."""
    role, agent, task_id = "reviewer", seat, None
    if seat.startswith("approver:"):
        role, agent = "approver", seat.removeprefix("approver:")
    elif seat.startswith("own:"):
        _, task_id, agent = seat.split(":")
    message = {"type": "add_participant", "workflow_id": "common", "step_id": "review", "role": role}
    return message | {"agent_profile_id": agent} | ({"task_id": task_id} if task_id else {})


async def one_reviewer_task(rt: Any) -> None:
    """Register a review step of [clear, fan-out] without a WIP limit, create T0 in work and seat one
    reviewer (rev-a): the smallest common entry, for the single-entry tests (here and on PostgreSQL)."""
    text = workflow_yaml(["clear", "fan_out"], 0)
    await send(rt, {"type": "register_workflow", "yaml": text, "source": "t.yml", "import_path": True})
    await send(rt, {"type": "create_task", "task_id": "T0", "workflow_id": "common"})
    message = {"type": "add_participant", "workflow_id": "common", "step_id": "review"}
    await send(rt, message | {"role": "reviewer", "agent_profile_id": "rev-a"})


async def settle(rt: Any) -> None:
    """Wait until every promotion a command caused is dispatched. A promotion is dispatched by its task's
    actor after the reply that freed the slot, and Trio randomizes scheduling order: without this the next
    command (or the end of the log capture) would race it. Every forwarded promotion reaches its mailbox,
    then a read queued behind it returns once it is done."""
    await trio.testing.wait_all_tasks_blocked()
    for task_id in TASKS:
        await send(rt, {"type": "get_task", "task_id": task_id})


def behind(conn: sqlite3.Connection, task_id: str) -> int:
    """Toggle the task between work and review and bump its admission counter, in SQL: a write no cache is
    told of (actors/kernel/task_rows.py: the admission's compare-and-set must catch it)."""
    return conn.execute(
        "UPDATE tasks SET workflow_step_id = CASE workflow_step_id WHEN 'work' THEN 'review' ELSE 'work' END,"
        " admissions = admissions + 1 WHERE id = ?",
        (task_id,),
    ).rowcount


def key_in_advance(command: str, task_id: str, review: Any, seq: int) -> list[runs.RunRequest]:
    """Enqueues (as another trigger would) carrying the key the task's first review entry would give its
    first fan-out's rev-a run: taken by a run, or (merge_key) merged into a keyless run by coalescing."""
    fan_outs = [
        (p, a) for p, a in enumerate(review.events.on_enter) if a.type == "queue_run_for_each_participant"
    ]
    key = "unused"
    if fan_outs:
        position, action = fan_outs[0]
        key = run_key(EntryKey(task_id, "review", 1), position, "rev-a", action)
    if command == "merge_key":  # a keyless run absorbs the keyed one within 5 s (same task, agent, reason)
        keyless = runs.RunRequest("rev-a", task_id, "review", f"m{seq}")
        return [keyless, attrs.evolve(keyless, idempotency_key=key)]
    return [runs.RunRequest("rev-a", task_id, "review", f"t{seq}", idempotency_key=key)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios)
def test_the_common_entry_path_decides_every_admission_as_the_per_action_path_does(
    tmp_path_factory: Any, scenario: dict[str, Any]
) -> None:
    assert_same_outcome(tmp_path_factory.mktemp("common"), scenario)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios)
def test_the_task_row_cache_changes_no_outcome(tmp_path_factory: Any, scenario: dict[str, Any]) -> None:
    """Moves starting from cached rows (actors/kernel/task_rows.py) leave the same database, replies and logs
    as moves that read every row, rows changed behind the cache ("behind") included."""
    folder = tmp_path_factory.mktemp("cache")
    cached = run_still(play, folder / "cached.db", scenario)
    uncached = run_still(play, folder / "uncached.db", scenario, 0)
    assert snapshot(folder / "cached.db") == snapshot(folder / "uncached.db")
    assert cached == uncached


def assert_same_outcome(folder: Path, scenario: dict[str, Any]) -> list[Any]:
    """Play `scenario` with the common path on and off; the same database, replies and logs. Returns the
    replies."""
    fast_replies, fast_logs = run_still(play, folder / "fast.db", scenario)
    with per_action_only():
        slow_replies, slow_logs = run_still(play, folder / "slow.db", scenario)
    assert snapshot(folder / "fast.db") == snapshot(folder / "slow.db")
    assert fast_replies == slow_replies
    assert [log for log in fast_logs if log["event"] != "common_entry_declined"] == slow_logs
    return fast_replies


def event_types(reply: Any) -> list[str]:
    return [event["type"] for event in reply["events"]]


ANOMALIES = {
    "key_taken": (["take_key"], "run_suppressed"),
    "key_merged": (["merge_key"], "run_suppressed"),
    "seat_without_agent": ([], "diagnostic"),
}


@pytest.mark.parametrize(("before", "expected"), ANOMALIES.values(), ids=ANOMALIES.keys())
def test_an_anomaly_takes_the_per_action_path(tmp_path: Path, before: list[str], expected: str) -> None:
    """Each anomaly the common path cannot decide alone is decided by the per-action path: a key already
    taken or merged is suppressed (AC-H6), a seat without an agent fails its fan-out
    (AC-E2)."""
    seats = ["rev-a", ""] if not before else ["rev-a"]
    scenario = {
        "review": ["clear", "fan_out"],
        "wip_limit": 0,
        "seats": seats,
        "commands": [(command, "T0") for command in before] + [("move_review", "T0")],
    }
    replies = assert_same_outcome(tmp_path, scenario)
    assert expected in event_types(replies[-1])
    if before:
        assert "run_queued" not in event_types(replies[-1])
    else:
        assert "fan_out_participant_failed" in [e["code"] for e in replies[-1]["events"] if "code" in e]


def test_a_step_at_its_wip_limit_queues_the_task_as_before(tmp_path: Path) -> None:
    scenario = {
        "review": ["clear", "fan_out"],
        "wip_limit": 1,
        "seats": ["rev-a"],
        "commands": [("move_review", "T0"), ("move_review", "T1")],
    }
    replies = assert_same_outcome(tmp_path, scenario)
    assert "step_entered" in event_types(replies[-2])
    assert "task_queued" in event_types(replies[-1])
    assert "run_queued" not in event_types(replies[-1])


def test_the_common_path_takes_the_common_entry(tmp_path: Path) -> None:
    """Not vacuous: an untouched entry of clears and fan-outs is admitted by the common path, in one
    savepoint holding the move, the entry, the clear, the markers and the runs."""
    calls: list[bool] = []
    admit = admission.admit_common

    def counted(*args: Any, **kwargs: Any) -> Any:
        admitted = admit(*args, **kwargs)
        calls.append(admitted is not None)
        return admitted

    admission.admit_common = counted  # type: ignore[assignment]
    try:
        scenario = {
            "review": ["clear", "fan_out"],
            "wip_limit": 0,
            "seats": ["rev-a", "rev-b"],
            "commands": [],
        }
        scenario["commands"] = [("decide", "T0"), ("move_review", "T0")]
        replies = run_still(play, tmp_path / "one.db", scenario)[0]
    finally:
        admission.admit_common = admit
    assert calls == [True]
    assert event_types(replies[-1]) == [
        "transition",
        "step_entered",
        "decisions_cleared",
        "action_outcome",
        "run_queued",
        "run_queued",
        "diagnostic",
        "action_outcome",
    ]


def test_a_stale_task_row_abandons_the_move_and_writes_nothing(tmp_path: Path) -> None:
    """The common path's compare-and-set on the task's step: an admission from a row the task has already
    left is abandoned (transition_abandoned), with no entry, marker or run, as on the per-action path."""

    async def run(db: Path) -> tuple[bool, dict[str, list[tuple[Any, ...]]]]:
        async with open_runtime(db, clock=FakeClock()) as rt:
            await one_reviewer_task(rt)
            stale = await rt.engine.load_task("T0")
            await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "review"})
            await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "work"})
            moved_back = await rt.engine.load_task("T0")
            stale = attrs.evolve(stale, step_id="review")  # it was at review, it is at work now
            workflow = rt.services.workflows.get("common")
            out = Outbox(EventHub())
            moved = await rt.engine.enter_step(
                stale, workflow, workflow.step("review"), path="E2", trigger="t", out=out
            )
            assert moved_back.step_id == "work"
        return moved, snapshot(db)

    fast = run_still(run, tmp_path / "fast.db")
    with per_action_only():
        slow = run_still(run, tmp_path / "slow.db")
    assert fast == slow
    assert fast[0] is False
    assert len(fast[1]["step_entries"]) == 1  # the first, real entry only


def test_a_database_error_in_the_common_path_rolls_back_to_the_per_action_path(
    tmp_path: Path,
) -> None:
    """A statement of the common path failing (here a trigger refusing T0's runs) rolls back only its
    savepoint, is logged (common_entry_declined), and the per-action path decides the entry as it would
    alone: the clear stands, the fan-out collects the failures (AC-C1) and is marked failed."""
    refuse = (
        "CREATE TRIGGER refuse BEFORE INSERT ON runs WHEN NEW.task_id = 'T0'"
        " BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )

    async def run(db: Path) -> tuple[Any, list[dict[str, Any]], dict[str, list[tuple[Any, ...]]]]:
        async with open_runtime(db, clock=FakeClock()) as rt:
            await one_reviewer_task(rt)
            await rt.services.store.transact(lambda conn: conn.execute(refuse).fetchall())
            with capture_logs() as logs:
                reply = await send(rt, {"type": "move_task", "task_id": "T0", "step_id": "review"})
        return reply.model_dump(), logs, snapshot(db)

    fast_reply, fast_logs, fast_state = run_still(run, tmp_path / "fast.db")
    with per_action_only():
        slow_reply, slow_logs, slow_state = run_still(run, tmp_path / "slow.db")
    assert [log["event"] for log in fast_logs].count("common_entry_declined") == 1
    assert [log for log in fast_logs if log["event"] != "common_entry_declined"] == slow_logs
    assert fast_reply == slow_reply
    assert fast_state == slow_state
    assert [row[3:6] for row in fast_state["step_entry_markers"]] == [
        (0, "clear_decisions", "done"),
        (1, "queue_run_for_each_participant", "failed"),
    ]


SEAT = st.tuples(
    st.sampled_from(["reviewer", "reviewer", "approver"]),
    st.sampled_from(["rev-a", "rev-b", "rev-c", ""]),
    st.integers(min_value=0, max_value=2),  # position
    st.sampled_from([None, None, "T0", "T1"]),  # per-task (T1: another task's, never T0's seat)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seats=st.lists(SEAT, max_size=7), payload=st.booleans())
def test_ac_a5_the_runs_statement_seats_a_fan_out_as_dedupe_seats_does(
    tmp_path_factory: Any, seats: list[tuple[str, str, int, str | None]], payload: bool
) -> None:
    """The common path's runs are built by SQL from the participant rows (`_RUNS`); they must be exactly the
    per-action path's: `dedupe_seats(step_participants(...))`'s agents in its order (the task's own row
    winning a collision, positions and ids ordering the rest: AC-A5, AC-E2), keyed byte for byte as
    `run_key`, run ids in that order; a seat without an agent leaves nothing written (AC-E2's failure is
    the per-action path's). Rows of another step, workflow or task never count."""
    run_still(play_seats, tmp_path_factory.mktemp("seats") / "db", seats, payload)


class Undo(Exception):
    """Raised at the end of a seats example: its writer request rolls back, so the database keeps nothing of
    it (tests/postgres/test_pg_common_paths.py replays the examples on one database)."""


async def play_seats(db: Path | str, seats: list[tuple[str, str, int, str | None]], payload: bool) -> None:
    """One seats example in one writer request on the store at `db` (a file or a PostgreSQL URL)."""
    review = ["clear", "fan_out_payload" if payload else "fan_out", "fan_out_approver"]
    text = workflow_yaml(review, 0)
    step = load_workflow_text(text, "t.yml", allowed_actions=IMPORT_ALLOWED_ACTIONS).step("review")
    async with open_store(db) as store:
        with pytest.raises(Undo):
            await store.transact(lambda conn: seats_example(conn, step, seats))


def seats_example(conn: sqlite3.Connection, step: Any, seats: list[tuple[str, str, int, str | None]]) -> None:
    """Seat `seats`, admit T0 by the common path, compare with the per-action path's seats; raises Undo."""
    order = tuple(dispatch_order(step.events.on_enter, "E2"))
    stored = workflows.StoredWorkflow("common", "t.yml", "", import_path=True)
    workflows.save_workflow(conn, workflow_id="common", name="Common", stored=stored, now=START)
    for task_id in ("T0", "T1"):
        tasks.insert_task(
            conn, task_id=task_id, workflow_id="common", step_id="work", title="", session_id=None,
            primary_agent_id=None, ceo_agent_id=None, priority="medium", now=START,
        )  # fmt: skip
    noise = [("other", "review", None), ("common", "work", None), ("other", "review", "T0")]
    for workflow_id, step_id, task_id in noise:
        add_participant(conn, workflow_id=workflow_id, step_id=step_id, task_id=task_id, role="reviewer",
                        agent_profile_id="rev-z", decision_required=True, position=0)  # fmt: skip
    for role, agent, position, task_id in seats:
        add_participant(conn, workflow_id="common", step_id="review", task_id=task_id, role=role,
                        agent_profile_id=agent, decision_required=True, position=position)  # fmt: skip
    task = tasks.get_task(conn, "T0")
    entered = attrs.evolve(task, step_id="review")
    expected = {
        p: dedupe_seats(
            step_participants(
                conn,
                workflow_id=entered.workflow_id,
                task_id=entered.id,
                step_id="review",
                role=a.config.role,
            )
        )
        for p, a in order
        if a.type == "queue_run_for_each_participant"
    }
    # The admission must be the first write of its request (`request_savepoint`): a savepoint of that name
    # after the setup, released (kept) before Undo rolls the whole request back.
    conn.execute("SAVEPOINT request")
    try:
        admitted_as_expected(conn, task, step, order, expected)
    finally:
        conn.execute("RELEASE request")
    raise Undo


def admitted_as_expected(
    conn: sqlite3.Connection, task: Any, step: Any, order: Any, expected: dict[int, list[Any]]
) -> None:
    """Admit `task` by the common path and compare what it queued with `expected` (per fan-out position)."""
    plan = common_plan(step, tuple(order))
    admitted = admit_common(conn, task=task, workflow_id="common", plan=plan, path="E2", now=1.0)
    if any(not seat.agent_profile_id for seated in expected.values() for seat in seated):
        assert admitted is None
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)
        assert conn.execute("SELECT workflow_step_id FROM tasks WHERE id = 'T0'").fetchone() == ("work",)
        return
    assert admitted is not None
    queued = {p: did for p, did in admitted.done if not isinstance(did, int)}
    actions = dict(order)
    assert {p: [(agent, key) for agent, _, key in did] for p, did in queued.items()} == {
        p: [(s.agent_profile_id, run_key(admitted.key, p, s.agent_profile_id, actions[p])) for s in seated]
        for p, seated in expected.items()
    }
    ids = [run_id for p, _ in order if p in queued for _, run_id, _ in queued[p]]
    assert ids == sorted(ids)
    written = conn.execute(
        f"SELECT id, agent_profile_id, {keys.STORED_KEY_SQL}, reason, payload FROM runs"
    ).fetchall()
    assert sorted(written) == sorted(
        (
            run_id,
            agent,
            key,
            fan_out_reason(actions[p], "on_enter"),
            runs.payload_json(getattr(actions[p].config, "payload", None)),
        )
        for p, did in queued.items()
        for agent, run_id, key in did
    )
