"""`finish_run` is fenced: the same finish sent twice at once is one finish and one replay, on SQLite (one
runtime) and on PostgreSQL (two runtimes on one database, whose transactions race for the run's row), and a
finish without its claim's token is refused `fence_required` unless the host opts out (`unfenced: true`).
Real databases, real Trio scheduling."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import COMMENT_QUEUES_RUN, list_runs, ok, send

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.backends.urls import is_postgres_url

RUNS = 20


@asynccontextmanager
async def two_runtimes(db: Path | str) -> AsyncIterator[tuple[Runtime, Runtime]]:
    """Two runtimes on `db` on PostgreSQL; on SQLite, which one runtime owns, the same one twice."""
    async with open_runtime(db) as first:
        if not is_postgres_url(db):
            yield first, first
            return
        async with open_runtime(db) as second:
            yield first, second


async def queue(rt: Runtime, count: int) -> None:
    await ok(rt, {"type": "register_workflow", "yaml": COMMENT_QUEUES_RUN, "source": "m.yml"})
    for n in range(count):
        await ok(rt, {"type": "create_task", "task_id": f"T{n}", "workflow_id": "m", "primary_agent_id": "w"})
        await ok(rt, {"type": "task_comment", "task_id": f"T{n}", "comment_id": f"c-{n}"})


async def lagged(rt: Runtime, message: dict[str, Any], lag: float, replies: list[Any]) -> None:
    await trio.sleep(lag)
    replies.append(await send(rt, message))


@pytest.mark.parametrize(
    "ending",
    [{"status": "finished"}, {"status": "failed", "error": "rate limited", "retry_in": 600.0}],
    ids=["finished", "failed_and_retried"],
)
async def test_identical_finishes_sent_at_once_are_one_finish_and_one_replay(
    db_path: Path | str, ending: dict[str, Any]
) -> None:
    """20 runs, each finished twice at once (through the two runtimes on PostgreSQL) with a random lag of
    0 to 3 ms between the two: every pair is one finish and one replay, never a conflict."""
    rng = random.Random(7)
    async with two_runtimes(db_path) as (first, second):
        await queue(first, RUNS)
        for _ in range(RUNS):
            run = (await ok(first, {"type": "claim_run", "agent_profile_id": "w"})).result
            finish = {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"], **ending}
            if "retry_in" in finish:  # the host's retry time: within the run's age limit
                finish["retry_at"] = first.services.now() + finish.pop("retry_in")
            replies: list[Any] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lagged, first, finish, rng.uniform(0, 0.003), replies)
                nursery.start_soon(lagged, second, finish, rng.uniform(0, 0.003), replies)
            assert [reply.ok for reply in replies] == [True, True], [r.error for r in replies]
            assert sorted(reply.result["replay"] for reply in replies) == [False, True]
            assert {reply.result["status"] for reply in replies} == {
                "finished" if ending["status"] == "finished" else "queued"
            }
        statuses = {row["status"] for row in await list_runs(first)}
        assert statuses == {"finished" if ending["status"] == "finished" else "queued"}


async def test_a_finish_without_its_token_is_refused_fence_required_unless_unfenced(
    db_path: Path | str,
) -> None:
    async with open_runtime(db_path) as rt:
        await queue(rt, 1)
        run = (await ok(rt, {"type": "claim_run", "agent_profile_id": "w"})).result
        refused = await send(rt, {"type": "finish_run", "run_id": run["id"]})
        assert (refused.ok, refused.error.code, refused.error.field) == (
            False,
            "fence_required",
            "claim_token",
        )
        assert refused.error.retryable is False
        [row] = await list_runs(rt)
        assert (row["status"], row["attempt"]) == ("claimed", 1)  # nothing changed
        both = await send(
            rt, {"type": "finish_run", "run_id": run["id"], "claim_token": "x", "unfenced": True}
        )
        assert (both.ok, both.error.code, both.error.field) == (False, "invalid_message", "unfenced")
        opted_out = await ok(rt, {"type": "finish_run", "run_id": run["id"], "unfenced": True})
        assert (opted_out.result["status"], opted_out.result["replay"]) == ("finished", False)
        fenced = await ok(rt, {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"]})
        assert fenced.result["replay"] is True  # the opt-out finished the same claim
