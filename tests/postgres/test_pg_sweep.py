"""The PostgreSQL sweep's liveness gaps (live runtimes periodically scan for, and finish, entries
whose epoch is dead — not only at start-up): an entry a dead runtime committed without any claim is
finished by a live runtime as soon as its creating epoch is dead, one of unknown creating epoch (from before
`step_entries.created_epoch`) once older than the grace period (`GRACE_INTERVALS` sweep intervals), a live
runtime's entry never however long its dispatch waits on a host action, and a WIP slot a dead runtime freed
without promoting is filled by a live runtime's sweep. Crash states are written by SQL through a second
store (a runtime's writer) that then closes, as a SIGKILLed runtime leaves them.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from pathlib import Path

import psycopg
import trio
from helpers import ok, register
from structlog.testing import capture_logs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "on_enter"))

from entry_support import (
    CLEAR_AND_FAN_OUT,
    REVIEWERS,
    admit,
    entries_yaml,
    executors_with,
    kinds_of,
    new_task,
    setup_entries,
)

from onceflow.actors.kernel.outbox import EventHub
from onceflow.actors.runtime.epoch_sweep import GRACE_INTERVALS, sweep_once
from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.host import SessionActionRequest
from onceflow.protocol.workflow import ActionDecl
from onceflow.store.backends.connection import Connection
from onceflow.store.entries.executors import DEFAULT_EXECUTORS, ActionContext, Effect, Executor
from onceflow.store.entries.step_entries import EntryKey
from onceflow.store.runs import keys
from onceflow.store.tasks import tasks
from onceflow.store.writer import open_store
from onceflow.testing import RecordingHost

KEY = EntryKey("T1", "review", 1)


def counting_clear() -> Executor:
    """clear_decisions, also logging each committed execution in `clear_log` (same transaction)."""
    real = DEFAULT_EXECUTORS["clear_decisions"]

    def executor(conn: object, ctx: ActionContext, action: ActionDecl) -> Effect:
        conn.execute(  # type: ignore[attr-defined]
            "INSERT INTO clear_log (task_id, step_id) VALUES (?, ?)", (ctx.task.id, ctx.step_id)
        )
        return real(conn, ctx, action)  # type: ignore[arg-type]

    return executor


def create_clear_log(url: str) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE clear_log (task_id TEXT NOT NULL, step_id TEXT NOT NULL)")


def clears(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [t for (t,) in conn.execute("SELECT task_id FROM clear_log ORDER BY task_id").fetchall()]


def runs_of(url: str, task_id: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT " + keys.STORED_KEY_SQL.replace("%", "%%") + " FROM runs WHERE task_id = %s", (task_id,)
        ).fetchall()
    return [key for (key,) in rows]


def entry_state(url: str, key: EntryKey) -> tuple[bool, list[tuple[int, str, str]]]:
    """(terminal, [(position, kind, state)]) of one entry."""
    with psycopg.connect(url) as conn:
        (terminal,) = conn.execute(
            "SELECT terminal FROM step_entries WHERE task_id = %s AND step_id = %s AND entry_seq = %s",
            (key.task_id, key.step_id, key.entry_seq),
        ).fetchone() or (None,)
        marks = conn.execute(
            "SELECT position, kind, state FROM step_entry_markers"
            " WHERE task_id = %s AND step_id = %s AND entry_seq = %s ORDER BY position",
            (key.task_id, key.step_id, key.entry_seq),
        ).fetchall()
    return bool(terminal), [tuple(m) for m in marks]  # type: ignore[misc]


async def _setup(url: str) -> list[str]:
    create_clear_log(url)
    async with open_runtime(url) as first:
        await setup_entries(first, CLEAR_AND_FAN_OUT)
        await new_task(first, "T1")
    return kinds_of(entries_yaml(CLEAR_AND_FAN_OUT), "review")


async def _dead_runtime_admits(
    url: str, kinds: list[str], created_at: float | None = None, *, epoch_unknown: bool = False
) -> None:
    """A peer runtime commits T1's move into review (the entry, no marker) and dies before dispatching.
    `epoch_unknown`: the entry's creating epoch is NULL, as for an entry from before migration 15."""
    async with open_store(url) as peer:
        key = await peer.transact(lambda conn: admit(conn, "T1", "review", kinds))
        assert created_epoch(url, key) == peer.epoch
        if created_at is not None:
            await peer.transact(
                lambda conn: conn.execute(
                    "UPDATE step_entries SET created_at = ? WHERE task_id = ? AND step_id = ?",
                    (created_at, key.task_id, key.step_id),
                )
            )
        if epoch_unknown:
            await peer.transact(
                lambda conn: conn.execute(
                    "UPDATE step_entries SET created_epoch = NULL WHERE task_id = ? AND step_id = ?",
                    (key.task_id, key.step_id),
                )
            )


def created_epoch(url: str, key: EntryKey) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT created_epoch FROM step_entries WHERE task_id = %s AND step_id = %s AND entry_seq = %s",
            (key.task_id, key.step_id, key.entry_seq),
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


async def test_sweep_finishes_a_dead_runtimes_claimless_entry_exactly_once(pg_url: str) -> None:
    """An open entry without any marker, left by a runtime that died, is finished by a live runtime
    without any restart within ~2 sweep intervals (it is older than the grace period): one clear, each
    reviewer's run queued once, the entry terminal; later sweeps leave it alone."""
    kinds = await _setup(pg_url)
    interval = 0.2
    async with open_runtime(
        pg_url, epoch_sweep_interval=interval, executors=executors_with(clear_decisions=counting_clear())
    ):
        await _dead_runtime_admits(pg_url, kinds)  # created at START: long past the grace period
        assert entry_state(pg_url, KEY) == (False, [])
        started = time.monotonic()
        with trio.fail_after(10):
            while not entry_state(pg_url, KEY)[0]:
                await trio.sleep(0.02)
        took = time.monotonic() - started
        await trio.sleep(5 * interval)  # several more sweeps
    assert took < 2 * interval + 1.0, took
    assert entry_state(pg_url, KEY)[1] == [
        (0, "clear_decisions", "done"),
        (1, "queue_run_for_each_participant", "done"),
    ]
    assert clears(pg_url) == ["T1"]
    keys = runs_of(pg_url, "T1")
    assert len(keys) == len(REVIEWERS) == len(set(keys))


async def test_ac_b9_sweep_leaves_a_live_epochs_entry_and_takes_a_dead_ones_at_once(pg_url: str) -> None:
    """A claimless open entry whose creating runtime lives is not taken, however old (grace 0): its runtime
    may be waiting on a host action. Once that runtime is gone, the very next sweep takes it, however young
    (a grace no entry outlives), and finishes it: one clear, each reviewer's run queued once."""
    kinds = await _setup(pg_url)
    never = 1e12  # seconds: a grace no entry outlives
    async with open_runtime(  # its own sweep never runs (the first waits an interval): the test sweeps
        pg_url, epoch_sweep_interval=3600, executors=executors_with(clear_decisions=counting_clear())
    ) as live:
        async with open_store(pg_url) as peer:  # a live runtime admitted T1 and has not claimed anything yet
            await peer.transact(lambda conn: admit(conn, "T1", "review", kinds))  # created at START: old
            assert created_epoch(pg_url, KEY) == peer.epoch
            for _ in range(3):
                assert await sweep_once(live.services, EventHub(), 0.0) == 0
            assert entry_state(pg_url, KEY) == (False, [])
            assert clears(pg_url) == []
        with trio.fail_after(5):  # the peer is gone: its session's end frees its epoch lock
            while not await sweep_once(live.services, EventHub(), never):
                await trio.sleep(0.01)
        assert await sweep_once(live.services, EventHub(), never) == 0  # finished: left alone
    assert entry_state(pg_url, KEY) == (
        True,
        [(0, "clear_decisions", "done"), (1, "queue_run_for_each_participant", "done")],
    )
    assert clears(pg_url) == ["T1"]
    keys = runs_of(pg_url, "T1")
    assert len(keys) == len(REVIEWERS) == len(set(keys))


async def test_ac_b9_sweep_takes_an_entry_of_unknown_creating_epoch_only_past_the_grace(pg_url: str) -> None:
    """A claimless entry of unknown creating epoch (NULL: from before migration 15) younger than the grace
    period (GRACE_INTERVALS intervals) is not taken by the sweep, since it may be a live runtime's; once
    older, it is finished."""
    kinds = await _setup(pg_url)
    interval = 0.1
    grace = GRACE_INTERVALS * interval
    async with open_runtime(
        pg_url, epoch_sweep_interval=interval, executors=executors_with(clear_decisions=counting_clear())
    ):
        created = time.time()
        await _dead_runtime_admits(pg_url, kinds, created_at=created, epoch_unknown=True)
        await trio.sleep(max(0.0, created + 0.8 * grace - time.time()))  # several sweeps ran
        assert entry_state(pg_url, KEY) == (False, [])
        assert clears(pg_url) == []
        with trio.fail_after(10):  # past the grace period the sweep finishes it
            while not entry_state(pg_url, KEY)[0]:
                await trio.sleep(0.02)
        assert time.time() - created >= grace
    assert clears(pg_url) == ["T1"]


WIP_FLOW = """
id: slots
name: Slots
steps:
  - {id: backlog, name: Backlog, position: 0, is_start_step: true}
  - {id: narrow, name: Narrow, position: 1, wip_limit: 1}
"""


def queued(url: str, task_id: str) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT wip_admitted FROM tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return not row[0]


async def test_sweep_promotes_into_a_slot_a_dead_runtime_freed(pg_url: str) -> None:
    """A dead runtime committed the move that freed the only slot of a WIP-limited step and died before
    promoting: a live runtime's sweep admits the queued task within ~2 intervals, without any restart."""
    interval = 0.2
    async with open_runtime(pg_url, epoch_sweep_interval=interval) as live:
        await register(live, WIP_FLOW, "slots.yml")
        for task in ("A", "B"):
            await ok(live, {"type": "create_task", "task_id": task, "workflow_id": "slots"})
            await ok(live, {"type": "move_task", "task_id": task, "step_id": "narrow"})
        assert not queued(pg_url, "A") and queued(pg_url, "B")
        async with open_store(pg_url) as peer:  # the peer's move of A out commits; it dies before promoting
            await peer.transact(
                lambda conn: tasks.move_task_step(
                    conn,
                    task_id="A",
                    expected_step_id="narrow",
                    workflow_id="slots",
                    step_id="backlog",
                    now=time.time(),
                )
            )
        started = time.monotonic()
        with trio.fail_after(10):
            while queued(pg_url, "B"):
                await trio.sleep(0.02)
        assert time.monotonic() - started < 2 * interval + 1.0


class SlowResetHost(RecordingHost):
    """A host whose session actions take a random 0.3-0.8 s, longer than the sweeps' 0.24 s grace: the entry
    stays claimless meanwhile. Records each task whose reset has completed."""

    def __init__(self) -> None:
        super().__init__()
        self.reset_done: set[str] = set()

    async def perform_session_action(self, request: SessionActionRequest) -> None:
        await trio.sleep(random.uniform(0.3, 0.8))
        await super().perform_session_action(request)
        self.reset_done.add(request.task_id)


RESET_FIRST = "- type: reset_agent_context\n" + CLEAR_AND_FAN_OUT
RACERS = 16


async def test_ac_b9_sweeps_never_race_a_live_runtimes_dispatch_waiting_on_a_host_action_past_the_grace(
    pg_url: str,
) -> None:
    """Two live runtimes sweep every 0.02 s (grace 0.24 s) while one of them dispatches its own entries,
    each waiting longer than the grace on a host action (reset_agent_context) before its engine actions: no
    sweep takes any of them (their creating epoch lives), so each entry's clear commits once and only after
    its reset completed, and each reviewer's run is queued once."""
    create_clear_log(pg_url)
    async with open_runtime(pg_url) as first:
        await setup_entries(first, RESET_FIRST)
        for n in range(RACERS):
            await new_task(first, f"T{n}")
    host = SlowResetHost()
    early: list[str] = []  # tasks whose clear ran before their reset completed
    clear = counting_clear()

    def clear_after_reset(conn: Connection, ctx: ActionContext, action: ActionDecl) -> Effect:
        if ctx.task.id not in host.reset_done:
            early.append(ctx.task.id)
        return clear(conn, ctx, action)

    executors = executors_with(clear_decisions=clear_after_reset)
    with capture_logs() as logs:
        async with contextlib.AsyncExitStack() as stack:
            own = await stack.enter_async_context(
                open_runtime(pg_url, host=host, epoch_sweep_interval=0.02, executors=executors)
            )
            await stack.enter_async_context(
                open_runtime(pg_url, epoch_sweep_interval=0.02, executors=executors)
            )
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for n in range(RACERS):
                        nursery.start_soon(
                            ok, own, {"type": "move_task", "task_id": f"T{n}", "step_id": "review"}
                        )
                while not all(entry_state(pg_url, EntryKey(f"T{n}", "review", 1))[0] for n in range(RACERS)):
                    await trio.sleep(0.02)
    swept = sum(e.get("entries", 0) for e in logs if e["event"] == "epoch_sweep_finished")
    assert swept == 0
    assert early == []
    assert host.reset_done == {f"T{n}" for n in range(RACERS)}
    assert clears(pg_url) == sorted(f"T{n}" for n in range(RACERS))
    for n in range(RACERS):
        keys = runs_of(pg_url, f"T{n}")
        assert len(keys) == len(REVIEWERS) == len(set(keys)), (n, keys)
        assert entry_state(pg_url, EntryKey(f"T{n}", "review", 1))[1] == [
            (1, "clear_decisions", "done"),
            (2, "queue_run_for_each_participant", "done"),
        ]
