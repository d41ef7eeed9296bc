"""Flow control through the runtime's commands, on both backends: ceilings (`set_limits`), pauses, priority
classes with aging, claims across agents, causation limits, hourly rates, `retry_run`, `requeue_run`,
stored results and `queue_stats`; a clock moved by hand (tests/hand_clock.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hand_clock import HandClock
from helpers import events, list_runs, ok, send

from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.actors.runtime.worker import HandBack
from onceflow.store.backends import schema
from onceflow.store.runs import flow, runs
from onceflow.store.runs.runs import RunRequest

T0 = 1_800_000_000.0


def template(workflow_id: str, priority: int | None = None) -> str:
    extra = "" if priority is None else f", priority: {priority}"
    return f"""\
id: {workflow_id}
name: {workflow_id}
steps:
  - id: work
    name: Work
    position: 0
    is_start_step: true
    events:
      on_comment:
        - type: queue_run
          config: {{target: primary, reason: task_comment{extra}}}
  - id: done
    name: Done
    position: 1
"""


async def _register(runtime: Runtime) -> None:
    for workflow_id, priority in (("m", None), ("human", 0), ("periodic", 3)):
        await ok(runtime, {"type": "register_workflow", "yaml": template(workflow_id, priority)})


@pytest.fixture
async def rt(db_path: Path | str, hand_clock: HandClock) -> AsyncIterator[Runtime]:
    async with open_runtime(db_path, clock=hand_clock.wall, lease_sweep_interval=1.0) as runtime:
        await _register(runtime)
        yield runtime


async def queue(
    rt: Runtime, task_id: str, agent: str, comment: str, workflow: str = "m", **extra: Any
) -> Any:
    """A comment on `task_id` (created for `agent` in `workflow` when new): one run queued for `agent`."""
    if not (await send(rt, {"type": "get_task", "task_id": task_id})).ok:
        create = {
            "type": "create_task",
            "task_id": task_id,
            "workflow_id": workflow,
            "primary_agent_id": agent,
        }
        await ok(rt, create)
    comment_id = f"{task_id}/{comment}"  # operation ids are the runtime's, not a task's
    return await ok(rt, {"type": "task_comment", "task_id": task_id, "comment_id": comment_id, **extra})


async def claim(rt: Runtime, agent: str | list[str] | None = None, **extra: Any) -> Any:
    command: dict[str, Any] = {"type": "claim_run", **extra}
    if isinstance(agent, str):
        command["agent_profile_id"] = agent
    elif agent is not None:
        command["agent_profile_ids"] = agent
    return await ok(rt, command)


async def finish(rt: Runtime, run: dict[str, Any], **extra: Any) -> Any:
    return await ok(
        rt, {"type": "finish_run", "run_id": run["id"], "claim_token": run["claim_token"], **extra}
    )


def held(reply: Any) -> tuple[Any, ...]:
    [event] = events(reply, "run_claim_held")
    return (event.reason, event.limit_scope, event.limit_id, event.max_concurrent)


async def test_an_agent_at_its_ceiling_gets_no_run_and_the_reply_says_why(rt: Runtime) -> None:
    await ok(rt, {"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": 2})
    for n in range(4):
        await queue(rt, "T1", "w", f"c-{n}")
    first, second = (await claim(rt, "w")).result, (await claim(rt, "w")).result
    refused = await claim(rt, "w")
    assert refused.result is None and held(refused) == ("at_capacity", "agent", "w", 2)
    await finish(rt, first)
    third = (await claim(rt, "w")).result
    assert third is not None and third["id"] not in (first["id"], second["id"])
    await ok(rt, {"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": None})
    assert (await claim(rt, "w")).result is not None  # null removed the ceiling
    assert events(await claim(rt, "w"), "run_claim_held") == []  # nothing left: no reason to give


async def test_the_global_ceiling_is_one_ceiling_over_every_agent(rt: Runtime) -> None:
    await ok(rt, {"type": "set_limits", "scope": "global", "max_concurrent": 2})
    for agent in ("a", "b", "c"):
        await queue(rt, f"T-{agent}", agent, "c-1")
    assert (await claim(rt, "a")).result is not None
    assert (await claim(rt, None)).result is not None
    refused = await claim(rt, ["b", "c"])
    assert refused.result is None and held(refused) == ("at_capacity", "global", None, 2)


async def test_waiting_runs_hold_no_slot_and_a_finish_wakes_a_claim_at_the_ceiling(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await ok(rt, {"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": 1})
    await queue(rt, "T1", "w", "c-1")
    await queue(rt, "T1", "w", "c-2")
    first = (await claim(rt, "w")).result
    got: list[Any] = []

    async def waiter() -> None:
        got.append((await claim(rt, "w", wait_seconds=30)).result)

    import trio

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await hand_clock.elapse(rt, 5)
        assert got == []
        await finish(rt, first)
        await hand_clock.elapse(rt, 1)
    assert got[0] is not None and got[0]["id"] != first["id"]


@pytest.mark.parametrize("scope", ["agent", "task", "workflow", "all"])
async def test_paused_runs_wait_and_go_out_in_their_order_on_resume(
    db_path: Path | str, hand_clock: HandClock, scope: str
) -> None:
    target = {"agent": "w", "task": "T1", "workflow": "m", "all": None}[scope]
    pause: dict[str, Any] = {"type": "pause", "scope": scope, "reason": "deploy"}
    if target is not None:
        pause["id"] = target
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:
        await _register(rt)
        for n in range(3):
            await queue(rt, "T1", "w", f"c-{n}")
        paused = await ok(rt, pause)
        assert paused.result["created"] and [e.change for e in events(paused, "flow_changed")] == ["paused"]
        assert not (await ok(rt, pause)).result["created"]
        refused = await claim(rt, "w")
        assert refused.result is None and held(refused)[0] == "paused"
    async with open_runtime(db_path, clock=hand_clock.wall) as rt:  # a pause survives a restart
        [listed] = (await ok(rt, {"type": "list_pauses"})).result["pauses"]
        assert (listed["scope"], listed["id"], listed["reason"]) == (scope, target, "deploy")
        assert (await claim(rt, "w")).result is None
        resume = {k: v for k, v in pause.items() if k != "reason"} | {"type": "resume"}
        assert (await ok(rt, resume)).result == {"resumed": True}
        queued = [r["id"] for r in await list_runs(rt, status="queued")]
        assert [(await claim(rt, "w")).result["id"] for _ in queued] == queued


async def test_claims_take_the_lowest_class_first_and_aging_promotes_never_into_human(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await queue(rt, "P", "w", "c-1", workflow="periodic")  # class 3, oldest
    await queue(rt, "E", "w", "c-1")  # class 2
    await queue(rt, "H", "w", "c-1", workflow="human")  # class 0, newest
    order = [(await claim(rt, "w")).result for _ in range(3)]
    assert [(r["task_id"], r["priority"]) for r in order] == [("H", 0), ("E", 2), ("P", 3)]
    for run in order:
        await finish(rt, run)
    await queue(rt, "P", "w", "c-2", workflow="periodic")
    await hand_clock.elapse(rt, 900)  # one aging_s waited: the periodic run is class 2 now, and older
    await queue(rt, "E", "w", "c-2")
    await queue(rt, "H", "w", "c-2", workflow="human")
    order = [(await claim(rt, "w")).result for _ in range(3)]
    assert [r["task_id"] for r in order] == ["H", "P", "E"]
    for run in order:
        await finish(rt, run)
    await queue(rt, "P", "w", "c-3", workflow="periodic")
    await hand_clock.elapse(rt, 5 * 900)  # promoted down to class 1, never 0
    await queue(rt, "H", "w", "c-3", workflow="human")
    assert [(await claim(rt, "w")).result["task_id"] for _ in range(2)] == ["H", "P"]


async def test_a_claim_across_agents_serves_the_least_recently_served_agent_first(rt: Runtime) -> None:
    for n in range(3):
        await queue(rt, "TA", "a", f"c-{n}")  # a's runs are all older than b's
    for n in range(2):
        await queue(rt, "TB", "b", f"c-{n}")
    served = []
    for _ in range(5):
        run = (await claim(rt, ["a", "b"])).result
        served.append(run["agent_profile_id"])
        await finish(rt, run)
    assert served == ["a", "b", "a", "b", "a"]
    assert (await claim(rt, ["a", "b"])).result is None


async def _chain(rt: Runtime, agents: tuple[str, ...], reason_task: str, links: int) -> list[Any]:
    """Runs causing runs: each claimed run's work comments on the next agent's task."""
    replies = [await queue(rt, f"{reason_task}-{agents[0]}", agents[0], "c-0")]
    for n in range(1, links + 1):
        agent = agents[n % len(agents)]
        parent = (await claim(rt, agents[(n - 1) % len(agents)])).result
        assert parent is not None, n
        replies.append(
            await queue(rt, f"{reason_task}-{agent}", agent, f"c-{n}", caused_by_run_id=parent["id"])
        )
        await finish(rt, parent)
    return replies


async def test_a_loop_of_runs_causing_runs_stops_at_depth_8(rt: Runtime) -> None:
    replies = await _chain(rt, ("a", "b"), "L", 9)
    depths = [e.causation_depth for r in replies[:-1] for e in events(r, "run_queued")]
    assert depths == list(range(9))
    [refused] = events(replies[-1], "run_rate_limited")
    assert (refused.limit, refused.limit_value, refused.causation_depth) == ("max_causation_depth", 8, 9)
    [row] = [r for r in await list_runs(rt) if r["id"] == refused.run_id]
    assert (row["status"], row["enqueue_outcome"], row["rate_limit"]) == (
        "cancelled",
        "rate_limited",
        "max_causation_depth",
    )
    rows = await list_runs(rt, status="finished")
    assert {r["chain_id"] for r in rows} == {rows[0]["id"]} and not any(r["human_rooted"] for r in rows)


async def test_an_agent_retriggering_itself_is_refused_past_3_per_chain(rt: Runtime) -> None:
    replies = await _chain(rt, ("a",), "S", 4)
    assert [len(events(r, "run_queued")) for r in replies] == [1, 1, 1, 1, 0]
    [refused] = events(replies[-1], "run_rate_limited")
    assert (refused.limit, refused.limit_value) == ("self_triggers", 3)


async def test_runs_per_hour_refuses_without_using_the_key_and_spares_human_chains(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await ok(rt, {"type": "set_limits", "scope": "agent", "id": "w", "runs_per_hour": 2})
    assert (await ok(rt, {"type": "set_limits", "scope": "agent", "id": "w"})).result["runs_per_hour"] == 2
    await queue(rt, "T1", "w", "c-1")
    await queue(rt, "T1", "w", "c-2")
    refused = await queue(rt, "T1", "w", "c-3")
    [event] = events(refused, "run_rate_limited")
    assert (event.limit, event.limit_value, event.outcome) == ("runs_per_hour", 2, "rate_limited")
    human = await queue(rt, "T1", "w", "c-4", actor_kind="human")
    assert [e.outcome for e in events(human, "run_queued")] == ["queued"]
    stats = (await ok(rt, {"type": "queue_stats"})).result
    [line] = [a for a in stats["agents"] if a["agent_profile_id"] == "w"]
    assert (line["queued"], line["rate_limited_last_hour"], line["runs_per_hour"]) == (3, 1, 2)
    assert events(await queue(rt, "T1", "w", "c-5"), "run_rate_limited")
    await hand_clock.elapse(rt, 3601)  # the window moved on
    assert [e.outcome for e in events(await queue(rt, "T1", "w", "c-6"), "run_queued")] == ["queued"]


def test_a_refusal_leaves_the_idempotency_key_free(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "db", isolation_level=None)
    schema.migrate(conn)
    flow.set_limits(conn, "agent", "w", {"runs_per_hour": 1}, T0)
    first = RunRequest("w", None, None, "r", idempotency_key="k-1")
    second = RunRequest("w", None, None, "r", idempotency_key="k-2", exclude_from_coalescing=True)
    assert runs.enqueue_run(conn, first, T0).outcome == "queued"
    refused = runs.enqueue_run(conn, second, T0 + 1)
    assert (refused.outcome, refused.refusal) == ("rate_limited", flow.Refusal("runs_per_hour", 1))
    assert runs.enqueue_run(conn, first, T0 + 2).outcome == "suppressed"  # deduped before any limit
    flow.set_limits(conn, "agent", "w", {"runs_per_hour": None}, T0 + 3)
    again = runs.enqueue_run(conn, second, T0 + 4)
    assert again.outcome == "queued" and again.run_id != refused.run_id
    assert runs.enqueue_run(conn, second, T0 + 5).outcome == "suppressed"


async def test_retry_requeue_and_a_stored_result(rt: Runtime) -> None:
    await queue(rt, "T1", "w", "c-1")
    run = (await claim(rt, "w")).result
    back = await ok(rt, {"type": "requeue_run", "run_id": run["id"], "claim_token": run["claim_token"]})
    assert back.result == {"run_id": run["id"], "status": "queued"} and events(back, "run_requeued")
    stale = await send(rt, {"type": "requeue_run", "run_id": run["id"], "claim_token": run["claim_token"]})
    assert (stale.ok, stale.error.code, stale.error.field) == (False, "conflict", "claim_token")
    again = (await claim(rt, "w")).result
    assert (again["id"], again["attempt"]) == (run["id"], 2)
    await finish(rt, again, status="failed", retryable=False, error="boom", result={"tokens": 12})
    got = (await ok(rt, {"type": "get_run", "run_id": run["id"]})).result
    assert (got["status"], got["result"]) == ("failed", {"tokens": 12})
    retried = (await ok(rt, {"type": "retry_run", "run_id": run["id"]})).result
    fresh = (await claim(rt, "w")).result
    assert (fresh["id"], fresh["retry_of"], fresh["priority"]) == (retried["run_id"], run["id"], 1)
    refused = await send(rt, {"type": "retry_run", "run_id": fresh["id"]})
    assert (refused.error.code, refused.error.field) == ("conflict", "run_id")
    missing = await send(rt, {"type": "get_run", "run_id": 999})
    assert (missing.error.code, missing.error.field) == ("not_found", "run_id")


@pytest.mark.parametrize(
    ("command", "field"),
    [
        ({"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": 0}, "max_concurrent"),
        ({"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": -1}, "max_concurrent"),
        ({"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": "3"}, "max_concurrent"),
        ({"type": "set_limits", "scope": "agent", "id": "w", "max_concurrent": 2.5}, "max_concurrent"),
        ({"type": "set_limits", "scope": "team", "id": "w"}, "scope"),
        ({"type": "pause", "scope": "galaxy"}, "scope"),
        ({"type": "claim_run", "agent_profile_ids": []}, "agent_profile_ids"),
        (
            {"type": "task_comment", "task_id": "T", "comment_id": "c", "caused_by_run_id": "4"},
            "caused_by_run_id",
        ),
        ({"type": "finish_run", "run_id": 1, "claim_token": "t", "result": "x" * 70_000}, "result"),
    ],
)
async def test_bad_flow_values_are_refused_naming_the_field(
    rt: Runtime, command: dict[str, Any], field: str
) -> None:
    refused = await send(rt, command)
    assert (refused.ok, refused.error.code, refused.error.field) == (False, "invalid_message", field)


async def test_a_template_priority_outside_0_to_3_is_refused(rt: Runtime) -> None:
    refused = await send(rt, {"type": "register_workflow", "yaml": template("bad", 4)})
    assert not refused.ok and "priority" in (refused.error.field or "") + refused.error.message


async def test_queue_stats_shows_each_agent_with_its_ceiling_age_and_pause(
    rt: Runtime, hand_clock: HandClock
) -> None:
    await ok(rt, {"type": "set_limits", "scope": "agent", "id": "a", "max_concurrent": 3})
    await queue(rt, "TA", "a", "c-1")
    await queue(rt, "TA", "a", "c-2")
    await queue(rt, "TB", "b", "c-1")
    await claim(rt, "a")
    await ok(rt, {"type": "pause", "scope": "agent", "id": "b", "reason": "quota"})
    await hand_clock.elapse(rt, 30)
    stats = (await ok(rt, {"type": "queue_stats"})).result
    rows = {a["agent_profile_id"]: a for a in stats["agents"]}
    assert (rows["a"]["queued"], rows["a"]["claimed"], rows["a"]["max_concurrent"], rows["a"]["paused"]) == (
        1,
        1,
        3,
        False,
    )
    assert rows["b"]["paused"] and rows["b"]["oldest_age_s"] == pytest.approx(30, abs=0.01)
    assert [p["id"] for p in stats["pauses"]] == ["b"] and stats["limits"][0]["id"] == "a"


async def test_a_worker_across_agents_hands_a_run_back_and_stores_a_result(rt: Runtime) -> None:
    await queue(rt, "TA", "a", "c-1")
    await queue(rt, "TB", "b", "c-1")
    seen: list[tuple[str, int]] = []
    async with rt.runs(["a", "b"], until_idle=True, wait_seconds=0) as worker:
        async for run in worker:
            async with run:
                seen.append((run.agent_profile_id, run.attempt))
                if run.agent_profile_id == "a" and run.attempt == 1:
                    raise HandBack()
                run.result = {"done_by": run.agent_profile_id}
    assert seen == [("a", 1), ("b", 1), ("a", 2)]  # handed back, then served after b: b's turn came first
    rows = {r["agent_profile_id"]: r for r in await list_runs(rt)}
    assert {agent: (r["status"], r["result"]) for agent, r in rows.items()} == {
        "a": ("finished", {"done_by": "a"}),
        "b": ("finished", {"done_by": "b"}),
    }
