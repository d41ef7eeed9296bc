"""Coordinator outcome delivery with several runtimes on one PostgreSQL database.

An outcome is delivered by the runtime holding its claim (store/outcomes/outcome_claims.py) until a fenced
acknowledgement completes it; no other runtime delivers or acknowledges it meanwhile, and when the claiming
runtime dies (SIGKILL) a live one resumes it from its stored state within the sweep interval: the cycle left
in flight is retried under its own id (AC-CO-17), acks waiting in the inbox are judged (AC-CO-14). Real
time, not a MockClock: the runtimes share a real server.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio
from helpers import ok
from structlog.testing import capture_logs

from onceflow.actors.runtime.epoch_sweep import SWEEP_INTERVAL
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.store.backends import postgres
from onceflow.store.outcomes import outcome_claims
from onceflow.testing import RecordingCoordinator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "outcome"))
from outcome_support import ack, envelope, ready, state

CHILD = Path(__file__).with_name("outcome_child.py")
INTERVAL = 0.5  # seconds: the redelivery interval, short so an ack another runtime took in is seen soon


@contextlib.asynccontextmanager
async def runtime(url: str, coordinator: RecordingCoordinator) -> AsyncIterator[Runtime]:
    async with open_runtime(url, coordinator=coordinator, redelivery_interval=INTERVAL) as rt:
        yield rt


async def until_acknowledged(rt: Runtime, outcome_ids: list[str], limit: float) -> dict[str, dict[str, Any]]:
    with trio.fail_after(limit):
        while True:
            got = {outcome_id: await state(rt, outcome_id) for outcome_id in outcome_ids}
            if all(record["phase"] == "acknowledged" for record in got.values()):
                return got
            await trio.sleep(0.1)


def acks_by_outcome(coordinators: list[RecordingCoordinator]) -> dict[str, list[str]]:
    """Every host `acknowledge` call, as the ack cycle ids per outcome, all runtimes together."""
    calls: dict[str, list[str]] = {}
    for coordinator in coordinators:
        for _, request in coordinator.acks:
            calls.setdefault(request.acknowledgement.outcome_id, []).append(request.cycle_id)
    return calls


async def test_outcomes_resumed_by_several_runtimes_are_delivered_and_acknowledged_once(
    pg_url: str,
) -> None:
    """Three runtimes; twenty outcomes readied at random ones; then two runtimes restart, so that each
    start finds every outcome unfinished. Acks (each twice) go to random runtimes, mostly not the one
    delivering. Every outcome is acknowledged, each through exactly one host `acknowledge` call, by the
    runtime that delivered it; runtimes that did not claim an outcome never delivered it."""
    envelopes = [envelope(work_id=f"gc-{n}") for n in range(20)]
    ids = [env["outcome_id"] for env in envelopes]
    coordinators: list[RecordingCoordinator] = []
    rng = random.Random(15)

    def fresh() -> RecordingCoordinator:
        coordinators.append(RecordingCoordinator())
        return coordinators[-1]

    async with contextlib.AsyncExitStack() as stack:
        rts = [await stack.enter_async_context(runtime(pg_url, fresh())) for _ in range(3)]
        for env in envelopes:
            await ready(rng.choice(rts), env)
        with trio.fail_after(10):  # every outcome delivered once before the restarts
            while sum(len(c.deliveries) for c in coordinators) < len(ids):
                await trio.sleep(0.05)
        async with runtime(pg_url, fresh()) as late, runtime(pg_url, fresh()) as later:
            everyone = [*rts, late, later]
            for env in envelopes:
                for _ in range(2):
                    await ok(rng.choice(everyone), ack(env, "coord-1"))
            finals = await until_acknowledged(late, ids, limit=20)
    assert {outcome_id: record["acknowledged_by"] for outcome_id, record in finals.items()} == dict.fromkeys(
        ids, "mayor"
    )
    calls = acks_by_outcome(coordinators)
    assert {outcome_id: len(calls.get(outcome_id, [])) for outcome_id in ids} == dict.fromkeys(ids, 1)
    for coordinator in coordinators:  # acknowledged only by the runtime that delivered it
        delivered = {request.message.envelope.outcome_id for _, request in coordinator.deliveries}
        assert {request.acknowledgement.outcome_id for _, request in coordinator.acks} <= delivered
    assert not coordinators[3].deliveries and not coordinators[4].deliveries  # the late ones claimed none


async def test_an_outcome_whose_delivering_runtime_was_sigkilled_is_resumed_by_a_live_one(
    pg_url: str,
) -> None:
    """A runtime process begins delivery cycle 1 and is SIGKILLed before the coordinator answers. A runtime
    that was already running (not restarted) retries cycle 1 under its own id within the sweep interval
    (AC-CO-17); an ack sent meanwhile to a third runtime completes the outcome, once."""
    env = envelope()
    outcome_id = env["outcome_id"]
    survivor, bystander = RecordingCoordinator(), RecordingCoordinator()
    async with runtime(pg_url, survivor) as rt, runtime(pg_url, bystander) as other:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), pg_url, json.dumps(env)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert child.stdout is not None
            line = await trio.to_thread.run_sync(child.stdout.readline)
            assert line.decode().split() == ["delivering", f"deliver/{outcome_id}/cycle-000001"]
            before = await state(rt, outcome_id)
            assert (before["delivery_attempts"], before["cycle_in_flight"]) == (1, True)
            assert not await claimable(pg_url, outcome_id)  # the child holds the claim
        finally:
            child.kill()
            child.wait()
        killed_at = trio.current_time()
        with trio.fail_after(SWEEP_INTERVAL + 5):
            while not survivor.deliveries and not bystander.deliveries:
                await trio.sleep(0.05)
        resumed_after = trio.current_time() - killed_at
        resumer = survivor if survivor.deliveries else bystander
        assert [request.cycle_id for _, request in resumer.deliveries] == [
            f"deliver/{outcome_id}/cycle-000001"
        ]
        await ok(other if resumer is survivor else rt, ack(env, "coord-1"))
        final = (await until_acknowledged(rt, [outcome_id], limit=10))[outcome_id]
    assert resumed_after <= SWEEP_INTERVAL + 1
    assert [request.cycle_id for _, request in resumer.acks] == [f"ack/{outcome_id}/cycle-000001"]
    assert (survivor.acks if resumer is bystander else bystander.acks) == []
    assert (final["delivery_attempts"], final["stale_acknowledgements"]) == (1, 0)
    assert await claimable(pg_url, outcome_id)  # released once acknowledged


async def claimable(url: str, outcome_id: str) -> bool:
    """Whether no session holds the outcome's claim: another session can take its lock."""

    def ask() -> bool:
        with contextlib.closing(postgres.connect(url)) as conn:
            return bool(
                conn.scalar("SELECT pg_try_advisory_lock(?)", (outcome_claims.claim_key(outcome_id),))
            )

    return await trio.to_thread.run_sync(ask)


async def test_an_outcome_actor_whose_runtime_lost_its_connection_stops_and_is_resumed(
    pg_url: str,
) -> None:
    """The server ends the delivering runtime's session while the coordinator holds its delivery: the
    runtime reconnects under a new epoch, without the claim. The actor's next transaction finds the claim
    gone and stops (`outcome_claim_lost`, recording nothing); the sweep resumes the outcome, which retries
    cycle 1 under its own id (AC-CO-17) and is acknowledged once."""
    env = envelope()
    outcome_id = env["outcome_id"]
    release = trio.Event()

    async def hold_first(request: Any) -> None:
        await release.wait()

    coordinator = RecordingCoordinator(during_delivery=hold_first)
    with capture_logs() as logs:
        async with runtime(pg_url, coordinator) as rt:
            store = rt.services.store
            await ready(rt, env)
            with trio.fail_after(5):
                while not coordinator.deliveries:
                    await trio.sleep(0.02)
            old_epoch = store.epoch
            await trio.to_thread.run_sync(terminate_others, pg_url)
            with trio.fail_after(10):  # the heartbeat finds the session gone and reconnects
                while store.epoch == old_epoch:
                    await trio.sleep(0.05)
            coordinator.during_delivery = None
            release.set()
            with trio.fail_after(5):
                while not any(log["event"] == "outcome_claim_lost" for log in logs):
                    await trio.sleep(0.05)
            with trio.fail_after(SWEEP_INTERVAL + 5):  # resumed by the sweep: cycle 1 again
                while len(coordinator.deliveries) < 2:
                    await trio.sleep(0.05)
            await ok(rt, ack(env, "coord-1"))
            final = (await until_acknowledged(rt, [outcome_id], limit=10))[outcome_id]
    assert [request.cycle_id for _, request in coordinator.deliveries] == [
        f"deliver/{outcome_id}/cycle-000001"
    ] * 2
    assert [request.cycle_id for _, request in coordinator.acks] == [f"ack/{outcome_id}/cycle-000001"]
    assert (final["delivery_attempts"], final["phase"]) == (1, "acknowledged")


def terminate_others(url: str) -> None:
    """End every other session on the database (the runtime's writer and its probe)."""
    with contextlib.closing(postgres.connect(url)) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


async def test_ac_co_9_the_same_ack_taken_in_at_once_by_two_runtimes_is_one_inbox_entry(pg_url: str) -> None:
    """Two runtimes take in identical acks at the same moment, round after round (a coordinator sending one
    ack to several runtimes): every reply is ok and queued, none `internal` (both runtimes finding no
    identical ack waiting and both inserting it), and each round's ack waits once, with every copy
    counted (a coordinator-less runtime delivers nothing, so the inbox keeps them)."""
    env = envelope()
    rounds, copies = 12, 8
    replies: list[Any] = []
    async with open_runtime(pg_url) as one, open_runtime(pg_url) as two:
        await ready(one, env)

        async def send(rt: Runtime, fence: str) -> None:
            replies.append(await rt.send(ack(env, fence)))

        for n in range(rounds):
            async with trio.open_nursery() as nursery:
                for rt in [one, two] * (copies // 2):
                    nursery.start_soon(send, rt, f"coord-{n}")
    assert [(reply.ok, reply.error) for reply in replies] == [(True, None)] * rounds * copies
    assert all(reply.result["queued"] for reply in replies)

    def inbox() -> list[tuple[str, int]]:
        with contextlib.closing(postgres.connect(pg_url)) as conn:
            rows = conn.execute(
                "SELECT coordinator_fence, copies FROM outcome_acks WHERE outcome_id = ? ORDER BY seq",
                (env["outcome_id"],),
            ).fetchall()
        return [(fence, int(count)) for fence, count in rows]

    expected = sorted((f"coord-{n}", copies) for n in range(rounds))
    assert sorted(await trio.to_thread.run_sync(inbox)) == expected
