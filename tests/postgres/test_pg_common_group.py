"""Common entries admitted together on PostgreSQL: one set of statements per writer batch decides exactly
what the entries decide one after another, as on SQLite (tests/on_enter/test_common_entry_group.py).

The writer runs a batch's grouped requests together on PostgreSQL too (after taking the batch's task
locks): the common entries of one plan, workflow and path (`common_entry.admit_group`, whose seqs, clears
and runs PostgreSQL answers with RETURNING: other runtimes insert runs meanwhile), and the task-row reads
(`tasks.get_tasks`). Compared with the same entries admitted one at a time on a second database, by SQL,
run ids by rank (PostgreSQL's identity values are not rolled back with a savepoint). Rules: AC-A3, AC-A5,
AC-B5, AC-B6, AC-C1, AC-H6.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psycopg
from hand_clock import run_still
from hypothesis import HealthCheck, event, given, settings
from pg_support import PostgresServer
from test_pg_common_paths import COLUMNS, fresh, run_ranks, snapshot, unfolded

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "on_enter"))

import test_common_entry_group as group

import onceflow.store.entries.admission as admission
from onceflow.store.entries.common_entry import Admission, Admitted
from onceflow.store.runs import keys
from onceflow.store.tasks import tasks

TASKS = group.TASKS


def ranked(results: list[Any], ranks: dict[int, int]) -> list[Any]:
    """Each admission's result with its run ids replaced by their rank in the database (`run_ranks`)."""
    out: list[Any] = []
    for result in results:
        if not isinstance(result, Admitted):
            out.append(result)
            continue
        done = []
        for position, did in result.done:
            if isinstance(did, tuple):
                did = tuple((agent, ranks[run_id], key) for agent, run_id, key in did)
            done.append((position, did))
        out.append((result.key, tuple(done), result.left))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=group.scenarios)
def test_pg_a_group_of_common_entries_decides_each_as_one_after_another_AC_B5_AC_A5(
    postgres_server: PostgresServer, scenario: dict[str, Any]
) -> None:
    together_url, separately_url = fresh(postgres_server), fresh(postgres_server)
    together, ran = run_still(group.batched, together_url, scenario)
    separately = run_still(group.one_by_one, separately_url, scenario)
    assert snapshot(together_url) == snapshot(separately_url)
    assert ranked(together, run_ranks(together_url)) == ranked(separately, run_ranks(separately_url))
    assert len(ran) == 1  # the writer ran the group once
    event("group decided" if ran[0] is not None else "group declined")
    assert (ran[0] is not None) == all(result is not None for result in separately)


def test_pg_a_clean_batch_is_admitted_by_one_group_run_AC_B6(postgres_server: PostgresServer) -> None:
    """Not vacuous: on PostgreSQL too the group decides entries with nothing in the way, seqs, clears and
    run ids in entry order."""
    group.admitted_by_one_group_run(fresh(postgres_server))


def test_pg_one_anomaly_sends_the_whole_group_back_to_one_at_a_time_AC_H6(
    postgres_server: PostgresServer,
) -> None:
    """T1's first key is taken in advance: the group is rolled back (its error read inside the group's
    savepoint) and each entry decided alone; T1 by the per-action path, the others by the common path."""
    group.sent_back_one_at_a_time(fresh(postgres_server))


def test_pg_an_hourly_rate_declines_the_group_after_its_statements_ran(
    postgres_server: PostgresServer,
) -> None:
    """On PostgreSQL the rate is read with the group's other answers, after its statements were sent: the
    group still declines, its savepoint undoing every statement."""
    group.declined_for_an_hourly_rate(fresh(postgres_server))


def test_pg_concurrent_moves_share_group_runs_and_grouped_reads_AC_B5_AC_C1(
    postgres_server: PostgresServer,
) -> None:
    """End to end through `Runtime.send` on PostgreSQL: 32 tasks moved at once are read and admitted by
    group runs (the writer's batches), and every entry has its markers, its clear and one run per seat."""
    url = fresh(postgres_server)
    admitted: list[int] = []
    read: list[int] = []
    original_admit, original_read = admission.admit_group, tasks.get_tasks

    def counted_admit(conn: Any, admissions: list[Admission]) -> Any:
        result = original_admit(conn, admissions)
        admitted.append(len(admissions) if result is not None else 0)
        return result

    def counted_read(conn: Any, task_ids: list[str]) -> Any:
        result = original_read(conn, task_ids)
        read.append(len(task_ids) if result is not None else 0)
        return result

    admission.admit_group = counted_admit  # type: ignore[assignment]
    tasks.get_tasks = counted_read  # type: ignore[assignment]
    try:
        replies = run_still(group.moved_at_once, url)
    finally:
        admission.admit_group = original_admit
        tasks.get_tasks = original_read
    assert sum(admitted) >= 16 and 0 not in admitted  # most entries went through groups, none declined
    assert sum(read) >= 16 and 0 not in read  # and most rows were read by grouped reads
    for reply in replies:
        types = [event.type for event in reply.events]
        assert types.count("run_queued") == 2 and "decisions_cleared" in types
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*), sum(terminal) FROM step_entries").fetchone() == (32, 32)
        state = unfolded(
            {
                "step_entries": conn.execute(
                    f"SELECT {COLUMNS['step_entries']} FROM step_entries"
                ).fetchall(),
                "step_entry_markers": conn.execute("SELECT * FROM step_entry_markers").fetchall(),
            }
        )
        assert [marker[5] for marker in state["step_entry_markers"]] == ["done"] * 64
        runs = conn.execute(f"SELECT count(DISTINCT {keys.STORED_KEY_SQL}), count(*) FROM runs").fetchone()
        assert runs == (64, 64)
        history = conn.execute("SELECT count(*) FROM task_history WHERE kind = 'transition'").fetchone()
        assert history == (32,)
