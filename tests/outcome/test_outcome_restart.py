"""Outcomes across runtime restarts, the behaviour version, bounded records, crashes (AC-CO-12 .. AC-CO-14,
AC-CO-17).

Ids AC-CO-n are listed in onceflow.actors.runtime.outcome. A "crash" is leaving the runtime while an outcome
is in flight: its actor is cancelled where it stands and only what was committed survives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import structlog
import trio
from helpers import START, FakeClock, ok, send
from outcome_support import (
    ack,
    acknowledged,
    diagnostic,
    envelope,
    ready,
    state,
    until,
    within_real_time,
)
from structlog.testing import capture_logs
from trio.testing import MockClock

from onceflow.actors.runtime.startup import open_runtime
from onceflow.protocol.coordinator import DeliveryRequest
from onceflow.protocol.outcome import OutcomeEnvelope
from onceflow.protocol.times import rfc3339, unix_seconds
from onceflow.store.outcomes import outcomes
from onceflow.store.outcomes.outcomes import MAX_PENDING_ACKS
from onceflow.store.writer import open_store
from onceflow.testing import RecordingCoordinator


async def test_ac_co_14_a_restart_between_delivery_and_ack_redelivers_under_the_new_fence(
    db_path: Path, autojump_clock: MockClock
) -> None:
    env = envelope()
    clock = FakeClock()
    async with open_runtime(db_path, clock=clock, coordinator=RecordingCoordinator(fence="coord-1")) as rt:
        events = rt.subscribe()
        await ready(rt, env)
        await diagnostic(events, "outcome_delivered")
    clock.advance(300)
    restarted = RecordingCoordinator(fence="coord-2")
    async with open_runtime(db_path, clock=clock, coordinator=restarted) as rt:
        events = rt.subscribe()
        await until(restarted, lambda: len(restarted.deliveries) == 1)  # resumed at once, cycle 2
        assert restarted.delivery_ids() == [(f"deliver/{env['outcome_id']}/cycle-000002", 1)]
        await ok(rt, ack(env, "coord-1"))  # the coordinator session before the restart
        await ok(rt, ack(env, "coord-2"))
        await diagnostic(events, "outcome_acknowledged")
        got = await state(rt, env["outcome_id"])
    assert [request.acknowledgement.coordinator_fence for _, request in restarted.acks] == ["coord-2"]
    # cycle 2, or 3 if the timer fired while the acks were being stored: the ack names its delivery's cycle
    assert got["delivery_attempts"] in (2, 3)
    assert restarted.ack_ids() == [(f"ack/{env['outcome_id']}/cycle-{got['delivery_attempts']:06d}", 1)]
    assert (got["phase"], got["stale_acknowledgements"]) == ("acknowledged", 1)
    # each runtime's clock starts at its wall clock's reading: the restarted one's 300 s later
    assert got["delivered_at"] == rfc3339(START)
    assert unix_seconds(got["acknowledged_at"]) >= START + 300


async def test_ac_co_14_an_ack_that_arrived_before_a_crash_is_not_lost(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    env = envelope()
    crashed = RecordingCoordinator(hanging_acks=100)
    async with open_runtime(db_path, clock=clock, coordinator=crashed) as rt:
        events = rt.subscribe()
        await ready(rt, env)
        await diagnostic(events, "outcome_delivered")
        await ok(rt, ack(env, "coord-1"))
        await until(crashed, lambda: len(crashed.acks) == 1)  # committing the ack when the runtime goes
    after = RecordingCoordinator(fence="coord-2")
    async with open_runtime(db_path, clock=clock, coordinator=after) as rt:
        await until(after, lambda: len(after.acks) == 1)
        got = await state(rt, env["outcome_id"])
    assert after.deliveries == []  # the stored ack matched the stored delivery: nothing redelivered
    assert after.ack_ids() == [(f"ack/{env['outcome_id']}/cycle-000001", 1)]
    assert (got["phase"], got["delivery_attempts"], got["coordinator_fence"]) == (
        "acknowledged",
        1,
        "coord-1",
    )


async def test_ac_co_14_without_a_coordinator_an_outcome_waits_pending_until_one_is_supplied(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    env = envelope()
    async with open_runtime(db_path, clock=clock) as rt:
        reply = await ok(rt, {"type": "outcome_ready", "envelope": env})
        assert reply.result["phase"] == "pending"
        assert [(e.code, e.level) for e in reply.events] == [("outcome_waiting_for_coordinator", "warning")]
        got = await state(rt, env["outcome_id"])
        assert (got["phase"], got["delivery_attempts"]) == ("pending", 0)
    coordinator = RecordingCoordinator()
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        events = rt.subscribe()
        await until(coordinator, lambda: len(coordinator.deliveries) == 1)
        await ok(rt, ack(env, "coord-1"))
        await diagnostic(events, "outcome_acknowledged")
        assert (await state(rt, env["outcome_id"]))["phase"] == "acknowledged"


async def test_ac_co_13_identical_acks_share_an_inbox_row_and_distinct_ones_are_bounded(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    env = envelope()
    async with open_runtime(db_path, clock=clock) as rt:  # no coordinator: acks wait in the inbox
        await ready(rt, env)
        for _ in range(100):
            await ok(rt, ack(env, "coord-0"))
        for n in range(1, MAX_PENDING_ACKS):
            await ok(rt, ack(env, f"coord-old-{n}"))
        full = await send(rt, ack(env, "coord-one-too-many"))
        assert full.error is not None and (full.error.code, full.error.field) == ("busy", "outcome_id")
        await ok(rt, ack(env, "coord-0"))  # a copy of a waiting ack still fits
        rows = await rt.services.store.transact(
            lambda conn: conn.execute("SELECT COUNT(*), SUM(copies) FROM outcome_acks").fetchone()
        )
        assert rows == (MAX_PENDING_ACKS, 101 + MAX_PENDING_ACKS - 1)
    coordinator = RecordingCoordinator()
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        await until(coordinator, lambda: len(coordinator.deliveries) == 1)
        got = await state(rt, env["outcome_id"])
    # never delivered before the restart, so none of them matched: each copy counted stale once
    assert got["stale_acknowledgements"] == 101 + MAX_PENDING_ACKS - 1


async def test_ac_co_13_the_record_does_not_grow_with_the_number_of_attempts(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    env = envelope()
    coordinator = RecordingCoordinator(down=True)
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        events = rt.subscribe()
        await ready(rt, env)
        for _ in range(12):
            await diagnostic(events, "outcome_delivery_failed")
        counts = await rt.services.store.transact(
            lambda conn: [
                conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                for table in ("outcomes", "outcome_acks")
            ]
        )
        got = await state(rt, env["outcome_id"])
    assert len(coordinator.deliveries) >= 12 * 5
    assert counts == [1, 0]
    assert got["delivery_attempts"] >= 12 and got["last_delivery_error"] == "local-delivery-failed"


async def _seed(db_path: Path, behavior_version: int) -> dict[str, object]:
    """An outcome record written as a runtime of `behavior_version` would have (before an upgrade)."""
    env = envelope()
    data = OutcomeEnvelope.model_validate(env).model_dump(mode="json")
    async with open_store(db_path) as store:
        await store.transact(
            lambda conn: outcomes.record_ready(conn, env["outcome_id"], data, behavior_version)
        )
    return env


async def test_ac_co_12_a_version_1_record_commits_an_ack_that_arrives_while_redelivery_fails(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    env = await _seed(db_path, behavior_version=1)
    coordinator = RecordingCoordinator()
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        events = rt.subscribe()
        await until(coordinator, lambda: len(coordinator.deliveries) == 1)
        coordinator.down = True
        await diagnostic(events, "outcome_delivery_failed")  # cycle 2
        await ok(rt, ack(env, "coord-1"))
        await diagnostic(events, "outcome_acknowledged")
        got = await state(rt, str(env["outcome_id"]))
    assert (got["behavior_version"], got["phase"], got["delivery_attempts"]) == (1, "acknowledged", 2)


async def test_ac_co_12_a_version_0_record_keeps_the_old_rule_and_only_sleeps_while_redelivery_fails(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    env = await _seed(db_path, behavior_version=0)
    coordinator = RecordingCoordinator()
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        events = rt.subscribe()
        await until(coordinator, lambda: len(coordinator.deliveries) == 1)
        coordinator.down = True
        await diagnostic(events, "outcome_delivery_failed")  # cycle 2
        await ok(rt, ack(env, "coord-1"))
        await diagnostic(events, "outcome_delivery_failed")  # cycle 3: the ack was not looked at
        assert coordinator.acks == []
        assert (await state(rt, str(env["outcome_id"])))["phase"] == "needs-coordinator-ack"
        coordinator.down = False
        await diagnostic(events, "outcome_acknowledged")  # drained after the next successful delivery
        got = await state(rt, str(env["outcome_id"]))
    assert (got["behavior_version"], got["phase"]) == (0, "acknowledged")
    assert got["delivery_attempts"] >= 4


@attrs.define
@attrs.define
class BreakingClock:
    """The runtime's clock, raising once when armed: a fault outside the host's callables, inside an outcome
    actor. Put in place of the outcome actors' clock (the runtime reads the wall clock only at open)."""

    clock: Callable[[], float]
    armed: bool = False

    def __call__(self) -> float:
        if self.armed:
            self.armed = False
            raise RuntimeError("clock hardware fault")
        return self.clock()


async def test_ac_co_14_a_crashed_outcome_actor_is_logged_and_resumed_one_interval_later(
    db_path: Path, autojump_clock: MockClock
) -> None:
    env = envelope()
    coordinator = RecordingCoordinator()
    structlog.reset_defaults()
    async with open_runtime(db_path, coordinator=coordinator) as rt:
        supervisor = rt._outcomes  # the actors it spawns read the time from it
        clock = supervisor._clock = BreakingClock(supervisor._clock)
        events = rt.subscribe()
        with capture_logs() as logs:
            await ready(rt, env)
            clock.armed = True  # the actor has not run yet: its first delivery's record will fail
            await diagnostic(events, "outcome_delivered")
        delivered = list(coordinator.deliveries)  # before the next timer can fire
        got = await state(rt, env["outcome_id"])
    crashes = [entry for entry in logs if entry["event"] == "outcome_actor_crashed"]
    assert [(c["outcome_id"], c["log_level"]) for c in crashes] == [(env["outcome_id"], "error")]
    # the crash interrupted cycle 1 before its receipt was recorded: it is retried under its own id (AC-CO-17)
    assert [request.cycle_id.rsplit("/", 1)[1] for _, request in delivered] == [
        "cycle-000001",
        "cycle-000001",
    ]
    assert delivered[1][0] - delivered[0][0] == 60.0
    assert (got["phase"], got["delivery_attempts"], got["cycle_in_flight"]) == (
        "needs-coordinator-ack",
        1,
        False,
    )


async def _stop_with_cycle_1_in_flight(
    db_path: Path, clock: FakeClock, coordinator: RecordingCoordinator, env: dict[str, object]
) -> None:
    """Run until the coordinator has recorded cycle 1 and its ack is stored, then stop the runtime while the
    `deliver` reply is still outstanding: its receipt never reaches onceflow."""
    acked = trio.Event()

    async def ack_then_lose_the_reply(request: DeliveryRequest) -> None:
        coordinator.during_delivery = None
        await ok(rt, ack(env, "coord-1"))
        acked.set()
        await trio.sleep_forever()

    coordinator.during_delivery = ack_then_lose_the_reply
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
        await ready(rt, env)
        await within_real_time(acked.wait)
        got = await state(rt, str(env["outcome_id"]))
        assert (got["phase"], got["delivery_attempts"], got["cycle_in_flight"]) == ("pending", 1, True)
        assert got["coordinator_fence"] is None


async def test_ac_co_17_a_restart_mid_delivery_retries_the_cycle_under_its_id_and_the_waiting_ack_completes(
    db_path: Path, clock: FakeClock, mock_clock: MockClock
) -> None:
    """The coordinator (which outlives onceflow's restart) received cycle 1 and acked it under coord-1; the
    reply was lost. No timer is ever needed: the clock never moves."""
    env = envelope()
    coordinator = RecordingCoordinator(fence="coord-1")
    await _stop_with_cycle_1_in_flight(db_path, clock, coordinator, env)
    with capture_logs() as logs:
        async with open_runtime(db_path, clock=clock, coordinator=coordinator) as rt:
            got = await acknowledged(rt, str(env["outcome_id"]))
    cycle_1 = f"deliver/{env['outcome_id']}/cycle-000001"
    resumed = [entry for entry in logs if entry["event"] == "outcome_cycle_resumed"]
    assert [entry["cycle_id"] for entry in resumed] == [cycle_1]  # said, not silent
    assert coordinator.delivery_ids() == [(cycle_1, 1), (cycle_1, 1)]  # the same cycle, not cycle 2
    assert [request.delivery_cycle for _, request in coordinator.deliveries] == ["cycle-000001"] * 2
    assert coordinator.ack_ids() == [(f"ack/{env['outcome_id']}/cycle-000001", 1)]
    assert (got["phase"], got["delivery_attempts"], got["stale_acknowledgements"]) == ("acknowledged", 1, 0)
    assert (got["coordinator_fence"], got["delivery_ref"], got["cycle_in_flight"]) == (
        "coord-1",
        "bead:hq-mail-1",  # the receipt the coordinator gave cycle 1 the first time
        False,
    )
    assert trio.current_time() == 0.0


async def test_ac_co_17_a_waiting_ack_for_another_fence_than_the_retry_obtains_is_stale(
    db_path: Path, clock: FakeClock, mock_clock: MockClock
) -> None:
    """The coordinator restarted too: the retried cycle 1 is received under coord-2, so the ack for coord-1
    is stale and a second ack is needed."""
    env = envelope()
    await _stop_with_cycle_1_in_flight(db_path, clock, RecordingCoordinator(fence="coord-1"), env)
    restarted = RecordingCoordinator(fence="coord-2")
    async with open_runtime(db_path, clock=clock, coordinator=restarted) as rt:
        events = rt.subscribe()
        await until(restarted, lambda: len(restarted.deliveries) == 1)
        await ok(rt, ack(env, "coord-2"))
        await diagnostic(events, "outcome_acknowledged")
        got = await state(rt, str(env["outcome_id"]))
    assert restarted.delivery_ids() == [(f"deliver/{env['outcome_id']}/cycle-000001", 1)]
    assert [request.acknowledgement.coordinator_fence for _, request in restarted.acks] == ["coord-2"]
    assert (got["phase"], got["delivery_attempts"], got["stale_acknowledgements"]) == ("acknowledged", 1, 1)
