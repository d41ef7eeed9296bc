"""Delivery, redelivery and acknowledgement of one outcome, driven by Trio's MockClock (AC-CO-3 .. AC-CO-12).

Ids AC-CO-n are listed in onceflow.actors.runtime.outcome. The clock autojumps (threshold 0) whenever every
task is blocked, including while a SQLite transaction runs on the writer thread: so whenever a test itself
talks to the runtime, an actor's pending timer may fire at that moment. Every assertion here holds either way
(the actor reads the inbox before it redelivers, and replies come in transaction order).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import START, FakeClock, ok, send
from outcome_support import ack, diagnostic, envelope, ready, state, wire_ack
from trio.testing import MockClock

from onceflow.actors.runtime.outcome import run_cycle
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.protocol.coordinator import DeliveryRequest, RetryPolicy
from onceflow.protocol.events import Event
from onceflow.protocol.outcome import OutcomeAcknowledgement
from onceflow.protocol.times import rfc3339, unix_seconds
from onceflow.store.outcomes import outcomes
from onceflow.testing import RecordingCoordinator


@pytest.fixture
def coordinator() -> RecordingCoordinator:
    return RecordingCoordinator()


@pytest.fixture
async def rt(db_path: Path, clock: FakeClock, coordinator: RecordingCoordinator) -> AsyncIterator[Runtime]:
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as runtime:
        yield runtime


async def start(rt: Runtime) -> tuple[trio.MemoryReceiveChannel[Event], dict[str, Any]]:
    """Subscribe to the runtime's events, then send outcome_ready for a fresh valid envelope."""
    events = rt.subscribe()
    env = envelope()
    await ready(rt, env)
    return events, env


def gaps(calls: list[tuple[float, Any]]) -> list[float]:
    times = [at for at, _ in calls]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def deliver_id(env: dict[str, Any], cycle: int) -> str:
    return f"deliver/{env['outcome_id']}/cycle-{cycle:06d}"


def ack_id(env: dict[str, Any], cycle: int) -> str:
    return f"ack/{env['outcome_id']}/cycle-{cycle:06d}"


@pytest.mark.parametrize("as_model", [False, True], ids=["mapping", "model"])
async def test_ac_co_4_a_failed_first_delivery_is_retried_inside_cycle_1(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock, as_model: bool
) -> None:
    coordinator.failing_deliveries, coordinator.receipt_model = 2, as_model
    events = rt.subscribe()
    env = envelope()
    assert await ready(rt, env) == {
        "outcome_id": env["outcome_id"],
        "received": "started",
        "phase": "pending",
    }
    delivered = await diagnostic(events, "outcome_delivered")
    assert delivered.fields["cycle_id"] == deliver_id(env, 1)
    assert coordinator.delivery_ids() == [(deliver_id(env, 1), n) for n in (1, 2, 3)]
    assert gaps(coordinator.deliveries) == [1.0, 2.0]  # the retry policy's first two waits
    assert [request.delivery_cycle for _, request in coordinator.deliveries] == ["cycle-000001"] * 3
    got = await state(rt, env["outcome_id"])
    assert got["phase"] == "needs-coordinator-ack"
    assert (got["delivery_attempts"], got["last_delivery_error"]) == (1, None)
    assert (got["coordinator_fence"], got["delivery_ref"]) == ("coord-1", "bead:hq-mail-3")


async def test_ac_co_4_ac_co_7_an_exhausted_cycle_fails_and_the_next_cycle_comes_one_interval_later(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    coordinator.down = True
    events, env = await start(rt)
    failed = await diagnostic(events, "outcome_delivery_failed")
    assert failed.fields["error_type"] == "ConnectionError"
    assert coordinator.delivery_ids() == [(deliver_id(env, 1), n) for n in range(1, 6)]
    assert gaps(coordinator.deliveries) == [1.0, 2.0, 4.0, 8.0]
    failed_at = coordinator.deliveries[-1][0]
    coordinator.down = False
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["delivery_attempts"]) == ("pending", 1)
    assert got["last_delivery_error"] == "local-delivery-failed"
    assert got["delivered_at"] is None
    await diagnostic(events, "outcome_delivered")
    at, request = coordinator.deliveries[-1]
    assert (request.cycle_id, request.attempt) == (deliver_id(env, 2), 1)
    assert at - failed_at == pytest.approx(60.0)
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["delivery_attempts"], got["last_delivery_error"]) == (
        "needs-coordinator-ack",
        2,
        None,
    )


async def test_ac_co_4_an_attempt_is_limited_to_30_seconds_and_a_cycle_to_120(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    coordinator.hanging_deliveries = 4
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivery_failed")
    assert trio.current_time() - coordinator.deliveries[0][0] == pytest.approx(120.0)
    # attempts start at 0, 31, 63, 97 (30 s timeout + 1, 2, 4 s waits); the fourth is cut at 120
    assert gaps(coordinator.deliveries) == [31.0, 32.0, 34.0]
    await diagnostic(events, "outcome_delivered")  # cycle 2, one interval later, no longer hanging
    assert coordinator.delivery_ids()[-1] == (deliver_id(env, 2), 1)


@pytest.mark.parametrize(
    ("receipt", "field"),
    [
        ({"work_id": "gc-9"}, "work_id"),
        ({"outcome_id": envelope(state="verified")["outcome_id"]}, "outcome_id"),
        ({"coordinator_fence": "coord 1"}, "coordinator_fence"),
        ({"delivery_ref": ""}, "delivery_ref"),
        ({"delivery_ref": "bead:hq mail-42"}, "delivery_ref"),
        ({"delivery_ref": "bead:" + "m" * 508}, "delivery_ref"),  # 513 bytes
    ],
)
@pytest.mark.parametrize("as_model", [False, True], ids=["mapping", "model"])
async def test_ac_co_5_a_bad_receipt_fails_the_cycle_without_retrying(
    rt: Runtime,
    coordinator: RecordingCoordinator,
    autojump_clock: MockClock,
    receipt: dict[str, Any],
    field: str,
    as_model: bool,
) -> None:
    coordinator.receipt, coordinator.receipt_model = receipt, as_model
    events, env = await start(rt)
    failed = await diagnostic(events, "outcome_delivery_failed")
    assert coordinator.delivery_ids() == [(deliver_id(env, 1), 1)]
    assert field in failed.fields["error"]
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["last_delivery_error"], got["coordinator_fence"]) == (
        "pending",
        "local-delivery-failed",
        None,
    )


async def test_ac_co_3_ac_co_8_without_an_ack_it_stays_in_needs_coordinator_ack_and_redelivers_each_interval(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    for cycle in (1, 2, 3):
        delivered = await diagnostic(events, "outcome_delivered")
        assert delivered.fields["cycle_id"] == deliver_id(env, cycle)
    assert coordinator.delivery_ids() == [(deliver_id(env, cycle), 1) for cycle in (1, 2, 3)]
    assert gaps(coordinator.deliveries) == [60.0, 60.0]
    got = await state(rt, env["outcome_id"])
    assert got["phase"] == "needs-coordinator-ack"
    assert got["delivery_attempts"] >= 3
    assert (got["delivered_at"], got["acknowledged_at"]) == (rfc3339(START), None)  # the first success only
    assert coordinator.acks == []


async def test_ac_co_6_ac_co_9_a_redelivery_carries_the_restarted_coordinators_fence_and_the_old_ack_is_stale(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    assert (await diagnostic(events, "outcome_delivered")).fields["coordinator_fence"] == "coord-1"
    coordinator.fence = "coord-2"  # the coordinator restarted
    assert (await diagnostic(events, "outcome_delivered")).fields["coordinator_fence"] == "coord-2"
    queued = await ok(rt, ack(env, "coord-1"))  # for the delivery before the restart
    assert queued.result == {
        "outcome_id": env["outcome_id"],
        "queued": True,
        "phase": "needs-coordinator-ack",
        "acknowledged_by": None,
    }
    await diagnostic(events, "outcome_delivered")  # the stale ack did not complete it: cycle 3 went out
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["stale_acknowledgements"], got["coordinator_fence"]) == (
        "needs-coordinator-ack",
        1,
        "coord-2",
    )
    await ok(rt, ack(env, "coord-2"))
    await diagnostic(events, "outcome_acknowledged")
    assert [request.acknowledgement.coordinator_fence for _, request in coordinator.acks] == ["coord-2"]
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["stale_acknowledgements"]) == ("acknowledged", 1)


async def test_ac_co_9_an_ack_completes_only_when_store_ref_work_id_and_fence_all_match(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivered")
    for wrong in (
        ack(env, "coord-1", store_ref="rig:gascity"),
        ack(env, "coord-1", work_id="gc-9"),
        ack(env, "coord-0"),
        ack(env, "coord-0"),  # the same stale ack again counts again
    ):
        await ok(rt, wrong)
    await ok(rt, ack(env, "coord-1"))
    await diagnostic(events, "outcome_acknowledged")
    # inbox order: the four mismatching acks were drained (and counted) before the matching one
    assert len(coordinator.acks) == 1
    assert coordinator.acks[0][1].acknowledgement.model_dump() == wire_ack(ack(env, "coord-1"))
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["stale_acknowledgements"]) == ("acknowledged", 4)


async def test_ac_co_10_ac_co_15_a_matching_ack_is_committed_under_the_delivery_cycle_id(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivered")
    await trio.sleep(7)
    await ok(rt, ack(env, "coord-1"))
    await diagnostic(events, "outcome_acknowledged")
    assert coordinator.ack_ids() == [(ack_id(env, 1), 1)]
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["delivered_at"]) == ("acknowledged", rfc3339(START))
    assert unix_seconds(got["acknowledged_at"]) >= START + 7  # the runtime's clock is Trio's, moved 7 s
    again = await ok(rt, ack(env, "coord-1"))
    assert again.result == {
        "outcome_id": env["outcome_id"],
        "queued": False,
        "phase": "acknowledged",
        "acknowledged_by": "mayor",
    }
    assert len(coordinator.deliveries) == 1
    waiting = await rt.services.store.transact(
        lambda conn: conn.execute("SELECT COUNT(*) FROM outcome_acks").fetchone()[0]
    )
    assert waiting == 0  # nothing is left in the inbox of a finished outcome


async def test_ac_co_8_an_ack_sent_while_its_delivery_is_still_in_flight_completes_it(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    env = envelope()
    replies = []

    async def ack_at_once(request: DeliveryRequest) -> None:
        # Shielded: the autojump clock may pass the attempt's deadline while the ack waits on the store's
        # thread, and a send in a cancelled scope raises Cancelled (the ack itself would still commit).
        with trio.CancelScope(shield=True):
            replies.append(await ok(rt, ack(env, "coord-1")))  # before the actor has recorded this delivery

    coordinator.during_delivery = ack_at_once
    events = rt.subscribe()
    await ready(rt, env)
    await diagnostic(events, "outcome_acknowledged")
    assert replies[0].result["phase"] == "pending"
    assert coordinator.ack_ids() == [(ack_id(env, 1), 1)]
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["delivery_attempts"], got["stale_acknowledgements"]) == ("acknowledged", 1, 0)


async def test_ac_co_10_ack_failures_exhaust_their_retries_and_a_later_ack_completes_under_a_new_cycle_id(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    coordinator.failing_acks = 5
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivered")
    await ok(rt, ack(env, "coord-1"))
    failed = await diagnostic(events, "outcome_acknowledgement_failed")
    assert (failed.fields["error_type"], failed.fields["error"]) == (
        "ConnectionError",
        repr(ConnectionError("canonical store unreachable")),
    )
    assert coordinator.ack_ids() == [(ack_id(env, 1), n) for n in range(1, 6)]
    assert gaps(coordinator.acks) == [1.0, 2.0, 4.0, 8.0]
    failed_at = coordinator.acks[-1][0]
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["last_delivery_error"]) == (
        "needs-coordinator-ack",
        "canonical-acknowledgement-failed",
    )
    delivered = await diagnostic(events, "outcome_delivered")  # one interval later, redelivered
    assert delivered.fields["cycle_id"] == deliver_id(env, 2)
    assert coordinator.deliveries[-1][0] - failed_at == pytest.approx(60.0)
    await diagnostic(events, "outcome_delivered")  # cycle 3: the failed ack was used up, none is pending
    assert len(coordinator.acks) == 5
    await ok(rt, ack(env, "coord-1"))
    await diagnostic(events, "outcome_acknowledged")
    got = await state(rt, env["outcome_id"])
    assert got["phase"] == "acknowledged"
    assert coordinator.ack_ids()[5:] == [
        (ack_id(env, got["delivery_attempts"]), 1)
    ]  # cycle 3 (4 if the timer won)
    assert got["delivery_attempts"] in (3, 4)


async def test_ac_co_8_an_ack_that_arrived_just_as_the_timer_fired_is_drained_before_redelivering(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivered")
    delivered_at = trio.current_time()
    # Committed to the inbox without waking the actor: what it finds when an ack's commit and the timer race.
    acknowledgement = OutcomeAcknowledgement.model_validate(wire_ack(ack(env, "coord-1")))
    await rt.services.store.transact(lambda conn: outcomes.enqueue_ack(conn, acknowledgement))
    await diagnostic(events, "outcome_acknowledged")
    assert trio.current_time() - delivered_at == pytest.approx(60.0)  # seen when the timer fired
    assert coordinator.delivery_ids() == [(deliver_id(env, 1), 1)]  # and not redelivered
    assert coordinator.ack_ids() == [(ack_id(env, 1), 1)]


async def test_ac_co_12_while_a_redelivery_fails_an_ack_for_the_last_delivery_still_completes(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivered")
    coordinator.down = True
    await diagnostic(events, "outcome_delivery_failed")  # cycle 2 failed; the fence is still coord-1
    await ok(rt, ack(env, "coord-1"))
    await diagnostic(events, "outcome_acknowledged")
    assert coordinator.ack_ids() == [(ack_id(env, 2), 1)]
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["delivery_attempts"], got["coordinator_fence"]) == (
        "acknowledged",
        2,
        "coord-1",
    )


async def test_ac_co_11_a_repeated_ready_does_not_start_a_second_delivery(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events, env = await start(rt)
    assert [(await ready(rt, env))["received"] for _ in range(2)] == ["duplicate", "duplicate"]
    await diagnostic(events, "outcome_delivered")
    await ok(rt, ack(env, "coord-1"))
    await diagnostic(events, "outcome_acknowledged")
    # one actor: every delivery is the timer's (a second actor would deliver at once); usually just cycle 1
    cycles = len(coordinator.deliveries)
    assert coordinator.delivery_ids() == [(deliver_id(env, cycle), 1) for cycle in range(1, cycles + 1)]
    assert gaps(coordinator.deliveries) == [60.0] * (cycles - 1)
    got = await state(rt, env["outcome_id"])
    assert (got["phase"], got["duplicate_signals"]) == ("acknowledged", 2)


async def test_ac_co_11_duplicates_are_counted_and_a_conflicting_envelope_changes_nothing(
    runtime: Runtime,
) -> None:
    env = envelope()
    assert (await ready(runtime, env))["received"] == "started"
    assert (await ready(runtime, env))["received"] == "duplicate"
    assert (await ready(runtime, env))["received"] == "duplicate"
    before = await state(runtime, env["outcome_id"])
    conflicting = envelope(summary="A different summary under the same id.")
    assert conflicting["outcome_id"] == env["outcome_id"]
    reply = await send(runtime, {"type": "outcome_ready", "envelope": conflicting})
    assert reply.error is not None and (reply.error.code, reply.error.field) == ("conflict", "envelope")
    after = await state(runtime, env["outcome_id"])
    assert after == {**before, "last_delivery_error": "conflicting-outcome-ready-signal"}
    assert (after["duplicate_signals"], after["envelope"]["summary"]) == (2, env["summary"])


async def test_ac_co_4_retry_waits_double_and_are_capped_at_10_seconds(autojump_clock: MockClock) -> None:
    """The spec's five attempts wait 1, 2, 4, 8 s; with more attempts the 10 s cap shows."""
    starts: list[tuple[float, None]] = []

    async def failing(attempt: int) -> None:
        starts.append((trio.current_time(), None))
        raise ConnectionError(f"attempt {attempt}")

    with pytest.raises(ConnectionError, match="attempt 7"):
        await run_cycle(RetryPolicy(maximum_attempts=7), failing, cycle_id="deliver/x/cycle-000001")
    assert gaps(starts) == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


async def test_ac_co_18_the_retry_policy_is_a_runtime_setting(
    db_path: Path, clock: FakeClock, autojump_clock: MockClock
) -> None:
    coordinator = RecordingCoordinator(down=True)
    policy = RetryPolicy(
        initial_interval=0.5, backoff_coefficient=3.0, maximum_interval=4.0, maximum_attempts=4
    )
    async with open_runtime(db_path, clock=clock, coordinator=coordinator, retry_policy=policy) as rt:
        events, env = await start(rt)
        await diagnostic(events, "outcome_delivery_failed")
        assert coordinator.delivery_ids() == [(deliver_id(env, 1), n) for n in range(1, 5)]
        assert gaps(coordinator.deliveries) == [0.5, 1.5, 4.0]  # 0.5, x3, capped at 4
        coordinator.down, coordinator.failing_acks = False, 1
        await diagnostic(events, "outcome_delivered")
        await ok(rt, ack(env, "coord-1"))
        await diagnostic(events, "outcome_acknowledged")
    assert coordinator.ack_ids() == [(ack_id(env, 2), 1), (ack_id(env, 2), 2)]  # acks follow it too
    assert gaps(coordinator.acks) == [0.5]


@pytest.mark.parametrize(
    "field",
    ["initial_interval", "backoff_coefficient", "maximum_interval", "attempt_timeout", "cycle_timeout"],
)
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan, "1"])
def test_ac_co_18_retry_policy_times_must_be_finite_and_positive(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RetryPolicy(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_ac_co_18_retry_policy_attempts_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(ValueError, match="maximum_attempts"):
        RetryPolicy(maximum_attempts=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("interval", [0.0, -60.0, math.inf, math.nan])
async def test_ac_co_18_the_redelivery_interval_must_be_finite_and_positive(
    db_path: Path, interval: float
) -> None:
    with pytest.raises(ValueError, match="redelivery_interval"):
        async with open_runtime(db_path, coordinator=RecordingCoordinator(), redelivery_interval=interval):
            pass


async def test_ac_co_3_a_late_delivery_report_leaves_an_acknowledged_outcome_acknowledged(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    """Acknowledged is the last phase: a delivery recorded after it (an actor of another runtime that lost
    its claim, or any late writer) changes nothing of the record."""
    events, env = await start(rt)
    await diagnostic(events, "outcome_delivered")
    await ok(rt, ack(env, "coord-1"))
    await diagnostic(events, "outcome_acknowledged")
    before = await state(rt, env["outcome_id"])
    after = await rt.services.store.transact(
        lambda conn: outcomes.record_delivery(conn, env["outcome_id"], "bead:late", "coord-9", 1e9)
    )
    assert after.info() == before
    assert (after.phase, after.coordinator_fence, after.delivery_ref) == (
        "acknowledged",
        "coord-1",
        before["delivery_ref"],
    )
