"""PostgreSQL's start-up recovery scan, set-based and under task locks (AC-B9): common open entries are
finished by a few statements for many entries, each batch holding its tasks' locks; an entry whose task
another runtime holds is recovered alone once that lock is free; and runtimes starting at once over the same
dead runtime's entries finish each entry once, running each action once.

Crash states are written through a store (a runtime's writer) that then closes, as a SIGKILLed runtime
leaves them: open entries with no marker (the set path's), and entries whose first action a dead epoch
claimed (the per-entry path's re-claim by epoch).
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from helpers import FakeClock
from pg_support import PostgresServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "on_enter"))

import test_recovery_set as recovery_set
from entry_support import REVIEWERS, add_decision, admit, mark, new_task, setup_entries

import onceflow.actors.runtime.startup as supervisor
import onceflow.store.entries.recovery as recovery
from onceflow.actors.kernel.outbox import EventHub
from onceflow.actors.kernel.services import Services
from onceflow.actors.runtime.startup import open_runtime
from onceflow.store.backends.epochs import TASK_NAMESPACE
from onceflow.store.backends.postgres import PgConnection
from onceflow.store.runs import keys
from onceflow.store.writer import open_store

KINDS = recovery_set.KINDS
RUNS_PER_ENTRY = 2 * len(REVIEWERS)  # two fan-outs over the template reviewers
DEAD_EPOCH = "epoch-of-a-dead-runtime"
_names = itertools.count(1)


async def prepare(url: str, tasks: int) -> list[str]:
    """`entries` registered with REVIEW (clear, two fan-outs), two template reviewers, `tasks` tasks at work;
    their ids, in the scan's order."""
    ids = [f"T{i:03d}" for i in range(tasks)]
    async with open_runtime(url, clock=FakeClock()) as rt:
        await setup_entries(rt, recovery_set.REVIEW)
        for task_id in ids:
            await new_task(rt, task_id)
    return ids


async def crash(url: str, ids: list[str], claimed: Collection[str] = ()) -> None:
    """Each task moved to review with one open entry and a decision to clear, as a runtime killed between the
    admitting commit and the dispatch leaves it; the tasks of `claimed` with their clear claimed by a dead
    epoch."""

    def write(conn: Any) -> None:
        for task_id in ids:
            add_decision(conn, task_id, "review")
            key = admit(conn, task_id, "review", KINDS)
            if task_id in claimed:
                mark(conn, key, 0, "clear_decisions", "in_progress", epoch=DEAD_EPOCH)

    async with open_store(url) as store:
        await store.transact(write)


def facts(url: str) -> dict[str, Any]:
    """What the invariants read: open entries, runs and distinct keys per entry, done markers per position,
    decisions left."""
    with psycopg.connect(url) as conn:
        open_entries = conn.execute("SELECT count(*) FROM step_entries WHERE terminal = 0").fetchone()
        runs = conn.execute(
            f"SELECT task_id, count(*), count(DISTINCT {keys.STORED_KEY_SQL}) FROM runs GROUP BY task_id"
        ).fetchall()
        markers = conn.execute(
            "SELECT task_id, position, count(*) FROM step_entry_markers WHERE state = 'done'"
            " GROUP BY task_id, position"
        ).fetchall()
        other = conn.execute("SELECT count(*) FROM step_entry_markers WHERE state <> 'done'").fetchone()
        decisions = conn.execute("SELECT count(*) FROM decisions").fetchone()
    assert open_entries is not None and other is not None and decisions is not None
    return {
        "open": open_entries[0],
        "runs": {task: (n, keys) for task, n, keys in runs},
        "markers": {(task, position): n for task, position, n in markers},
        "not_done": other[0],
        "decisions": decisions[0],
    }


def assert_each_action_once(url: str, ids: list[str]) -> None:
    found = facts(url)
    assert found["open"] == 0
    assert found["runs"] == {task: (RUNS_PER_ENTRY, RUNS_PER_ENTRY) for task in ids}
    assert found["markers"] == {(task, position): 1 for task in ids for position in range(len(KINDS))}
    assert found["not_done"] == 0
    assert found["decisions"] == 0


@contextmanager
def observed_scans() -> Iterator[list[tuple[int, int]]]:
    """Per start-up scan while inside: the entries it re-dispatched and the round trips of this process
    meanwhile (`PgConnection.total_round_trips`)."""
    scans: list[tuple[int, int]] = []
    scan = supervisor.recover_open_entries

    async def observed(services: Services, hub: EventHub) -> int:
        before = PgConnection.total_round_trips
        done = await scan(services, hub)
        scans.append((done, PgConnection.total_round_trips - before))
        return done

    supervisor.recover_open_entries = observed  # type: ignore[assignment]
    try:
        yield scans
    finally:
        supervisor.recover_open_entries = scan


def fresh(server: PostgresServer) -> str:
    return server.create_database(f"scan{next(_names)}")


def test_ac_b9_the_postgres_start_up_scan_finishes_common_entries_set_wise(
    postgres_server: PostgresServer,
) -> None:
    """60 untouched open entries are finished by one set-path savepoint, in a handful of round trips (the
    per-entry path spends about 8 per entry), each action once."""
    url = fresh(postgres_server)
    ids = trio.run(prepare, url, 60)
    trio.run(crash, url, ids)
    with recovery_set.counting_finishes() as calls, observed_scans() as scans:
        trio.run(lambda: recovery_set.restart(url, listening=False))
    assert calls == [len(ids)]
    [(redispatched, round_trips)] = scans
    assert redispatched == len(ids)
    assert round_trips <= 15, round_trips
    assert_each_action_once(url, ids)


def lock_holder(url: str, task_id: str) -> psycopg.Connection[Any]:
    """A session holding `task_id`'s lock in an open transaction, as another runtime's command would."""
    conn = psycopg.connect(url)
    conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (TASK_NAMESPACE, task_id))
    return conn


def test_ac_b9_an_entry_whose_task_another_runtime_holds_is_recovered_alone_once_its_lock_is_free(
    postgres_server: PostgresServer,
) -> None:
    """The scan does not wait for a held task's lock: every other entry is finished (set-wise) while the
    first task's lock is held elsewhere; that entry is then recovered alone, once the lock is free."""
    url = fresh(postgres_server)
    ids = trio.run(prepare, url, 8)
    trio.run(crash, url, ids)
    holder = lock_holder(url, ids[0])

    async def start_while_held() -> list[dict[str, Any]]:
        logs: list[dict[str, Any]] = []

        async def start() -> None:
            logs.extend((await recovery_set.restart(url, listening=False))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start)
            with trio.fail_after(30):
                while facts(url)["open"] != 1:  # every entry but the held task's
                    await trio.sleep(0.02)
            with psycopg.connect(url) as conn:
                still_open = conn.execute("SELECT task_id FROM step_entries WHERE terminal = 0").fetchall()
            assert still_open == [(ids[0],)]
            holder.commit()  # the other runtime's command ends
        return logs

    try:
        with recovery_set.counting_finishes() as calls, observed_scans() as scans:
            logs = trio.run(start_while_held)
    finally:
        holder.close()
    assert calls == [len(ids) - 1, 1]  # the batch without the held task, then that task alone
    assert scans[0][0] == len(ids)
    assert [log["entries"] for log in logs if log["event"] == "recovery_busy_entries"] == [1]
    assert_each_action_once(url, ids)


async def start_together(url: str, delays: tuple[float, ...]) -> None:
    """Open and close a runtime on `url` per delay (seconds after the call), all at once."""

    async def start(delay: float) -> None:
        await trio.sleep(delay)
        async with open_runtime(url, clock=FakeClock(), epoch_sweep_interval=3600):
            pass

    async with trio.open_nursery() as nursery:
        for delay in delays:
            nursery.start_soon(start, delay)


def test_ac_b9_two_runtimes_starting_at_once_over_a_dead_runtimes_entries_run_each_action_once(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runtimes start together, again and again, over the same entries a dead runtime left: untouched
    ones (set path) and ones whose clear the dead epoch had claimed (re-claimed by epoch, per-entry path),
    in requests of the default size (one runtime takes them all, the other finds them busy, then finished)
    and of 8 entries (the two runtimes' requests interleave, each finishing part). Between them every entry
    is re-dispatched exactly once (one finishes it, the other finds it finished under the task's lock, and
    neither sees the dead epoch live because the other is testing it), every action ran once, and none is
    left open for the sweep."""
    rng = random.Random(26)
    for round_ in range(8):
        monkeypatch.setattr(recovery, "LOCKED_REQUEST_SIZE", 8 if round_ % 2 else 512)  # interleave requests
        url = fresh(postgres_server)
        ids = trio.run(prepare, url, 40)
        claimed = {task for task in ids if rng.random() < 0.3}
        trio.run(crash, url, ids, claimed)
        delays = (rng.uniform(0, 0.05), rng.uniform(0, 0.05))
        with observed_scans() as scans:
            trio.run(start_together, url, delays)
        assert sum(done for done, _ in scans) == len(ids), (scans, delays)
        assert_each_action_once(url, ids)
