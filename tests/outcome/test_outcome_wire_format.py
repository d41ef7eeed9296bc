"""Gas City's wire format, byte for byte (gascity-wire-format.md; AC-CO-1, -2, -4, -5, -16).

The vectors here do not come from onceflow: every JSON text is written out by hand exactly as Go's
json.Marshal emits Gas City's structs (fields in struct order, no whitespace, `omitempty` optionals left out,
`time.Time` in UTC as RFC 3339 with up to nine fraction digits and `Z`, HTML characters escaped as
`\\u003c`...), and every outcome id is a SHA-256 taken here with hashlib over a hand-built string.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import FakeClock, ok, send
from hypothesis import given
from hypothesis import strategies as st
from outcome_support import ack, diagnostic, envelope, ready, state
from trio.testing import MockClock

import onceflow
from onceflow.actors.runtime.startup import open_runtime
from onceflow.actors.runtime.supervisor import Runtime
from onceflow.testing import RecordingCoordinator

SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

IDENTITY = (
    '{"contract_version":1,"producer":"formula-step","store_ref":"rig:hq","work_id":"hq-42",'
    '"state":"verified","fence":{"producer_id":"polecat-3","generation":12,"token":"lease-7f3a"}}'
)
OUTCOME_ID = "outcome-" + hashlib.sha256(IDENTITY.encode()).hexdigest()[:32]

# An envelope as a Go producer marshals it: every optional present, a nanosecond timestamp, ASCII only.
GO_ENVELOPE = (
    '{"contract_version":1,"outcome_id":"' + OUTCOME_ID + '","producer":"formula-step",'
    '"store_ref":"rig:hq","work_id":"hq-42","source_root_id":"hq-40",'
    '"workflow_id":"coordinator-outcome/formula:42","workflow_run_id":"5f1c0d9e-0000-4000-8000-000000000001",'
    '"step_key":"review","summary":"Reviewed the parser.","impact":"Two findings fixed.","state":"verified",'
    '"evidence":[{"kind":"review-record","uri":"bead:hq-review-9","sha256":"' + SHA + '"},'
    '{"kind":"commit","uri":"git:hq@4be0c1d","sha256":"' + SHA + '"}],'
    '"fence":{"producer_id":"polecat-3","generation":12,"token":"lease-7f3a"},'
    '"occurred_at":"2026-03-01T12:00:00.123456789Z"}'
)

# The same outcome with Go's escapes in the prose (<, >, & as \u003c.., U+2028 as \u2028, newline as \n,
# non-ASCII as raw UTF-8), no workflow correlation (omitempty) and a whole-second timestamp.
GO_ENVELOPE_ESCAPED = (
    '{"contract_version":1,"outcome_id":"' + OUTCOME_ID + '","producer":"formula-step",'
    '"store_ref":"rig:hq","work_id":"hq-42","source_root_id":"hq-40","step_key":"review",'
    '"summary":"Fixed a\\u003cb \\u0026\\u0026 c\\u003ed — naïve",'
    '"impact":"line one\\nline two\\u2028end","state":"verified",'
    '"evidence":[{"kind":"test-report","uri":"https://ci.example/run?id=1\\u0026x=2","sha256":"'
    + SHA
    + '"}],'
    '"fence":{"producer_id":"polecat-3","generation":12,"token":"lease-7f3a"},'
    '"occurred_at":"2026-03-01T12:00:00Z"}'
)

GO_ACK = (
    '{"store_ref":"rig:hq","outcome_id":"' + OUTCOME_ID + '","work_id":"hq-42",'
    '"coordinator_fence":"mayor-session-9","acknowledged_by":"mayor"}'
)


@pytest.fixture
def coordinator() -> RecordingCoordinator:
    return RecordingCoordinator(fence="mayor-session-9", receipt={"delivery_ref": "bead:hq-mail-42"})


@pytest.fixture
async def rt(db_path: Path, clock: FakeClock, coordinator: RecordingCoordinator) -> AsyncIterator[Runtime]:
    async with open_runtime(db_path, clock=clock, coordinator=coordinator) as runtime:
        yield runtime


def test_ac_co_2_the_outcome_id_of_a_hand_built_vector() -> None:
    fence = {"producer_id": "polecat-3", "generation": 12, "token": "lease-7f3a"}
    derived = onceflow.derive_outcome_id(
        producer="formula-step", store_ref="rig:hq", work_id="hq-42", state="verified", fence=fence
    )
    assert derived == OUTCOME_ID == "outcome-e2507f6ddf9c9e864c39c621307f0940"


SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
PRODUCERS = ["direct-worker", "formula-step", "project-lead", "maintenance-order", "temporal"]


@given(
    producer=st.sampled_from(PRODUCERS),
    store=st.sampled_from(["city", "rig"]),
    store_name=st.from_regex(SEGMENT, fullmatch=True),
    work_id=st.from_regex(SEGMENT, fullmatch=True),
    state=st.sampled_from(["terminal", "verified"]),
    producer_id=st.from_regex(SEGMENT, fullmatch=True),
    generation=st.integers(min_value=1, max_value=2**63 - 1),
    token=st.from_regex(SEGMENT, fullmatch=True),
)
def test_ac_co_2_the_outcome_id_is_the_sha256_of_gas_citys_compact_json_in_key_order(
    producer: str,
    store: str,
    store_name: str,
    work_id: str,
    state: str,
    producer_id: str,
    generation: int,
    token: str,
) -> None:
    canonical = (
        f'{{"contract_version":1,"producer":"{producer}","store_ref":"{store}:{store_name}",'
        f'"work_id":"{work_id}","state":"{state}",'
        f'"fence":{{"producer_id":"{producer_id}","generation":{generation},"token":"{token}"}}}}'
    )
    derived = onceflow.derive_outcome_id(
        producer=producer,
        store_ref=f"{store}:{store_name}",
        work_id=work_id,
        state=state,
        fence=onceflow.ProducerFence(producer_id=producer_id, generation=generation, token=token),
    )
    assert derived == "outcome-" + hashlib.sha256(canonical.encode()).digest()[:16].hex()


def test_ac_co_2_derive_outcome_id_refuses_a_field_no_envelope_could_carry() -> None:
    """Only validated fields are hashed, so no JSON escaping (where Go and Python differ) can ever apply."""
    with pytest.raises(ValueError, match="work_id"):
        onceflow.derive_outcome_id(
            producer="temporal",
            store_ref="city:hq",
            work_id="a<b",
            state="terminal",
            fence={"producer_id": "p", "generation": 1, "token": "t"},
        )


def test_a_go_envelope_round_trips_byte_for_byte_through_the_exported_types() -> None:
    parsed = onceflow.OutcomeEnvelope.model_validate_json(GO_ENVELOPE)
    assert parsed.model_dump_json() == GO_ENVELOPE
    request = onceflow.OutcomeDeliveryRequest(envelope=parsed, delivery_cycle="cycle-000003")
    assert request.model_dump_json() == '{"envelope":' + GO_ENVELOPE + ',"delivery_cycle":"cycle-000003"}'
    assert onceflow.OutcomeAcknowledgement.model_validate_json(GO_ACK).model_dump_json() == GO_ACK
    receipt = onceflow.OutcomeDelivery.model_validate_json(
        '{"delivery_ref":"bead:hq-mail-42","coordinator_fence":"mayor-session-9"}'
    )
    assert (
        receipt.model_dump_json()
        == '{"delivery_ref":"bead:hq-mail-42","coordinator_fence":"mayor-session-9"}'
    )


async def test_ac_co_1_ac_co_4_a_go_producers_envelope_is_accepted_and_handed_on_exactly(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events = rt.subscribe()
    reply = await ok(rt, '{"type":"outcome_ready","envelope":' + GO_ENVELOPE + "}")
    assert reply.result == {"outcome_id": OUTCOME_ID, "received": "started", "phase": "pending"}
    await diagnostic(events, "outcome_delivered")
    (_, request), *_ = coordinator.deliveries
    assert (request.cycle_id, request.attempt) == (f"deliver/{OUTCOME_ID}/cycle-000001", 1)
    assert request.message.model_dump_json() == (
        '{"envelope":' + GO_ENVELOPE + ',"delivery_cycle":"cycle-000001"}'
    )
    got = await state(rt, OUTCOME_ID)
    assert got["envelope"] == json.loads(GO_ENVELOPE)
    assert list(got["envelope"]) == list(json.loads(GO_ENVELOPE))  # Go's field order, kept


async def test_ac_co_1_a_go_envelope_with_escaped_prose_and_no_correlation_is_accepted(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events = rt.subscribe()
    await ok(rt, '{"type":"outcome_ready","envelope":' + GO_ENVELOPE_ESCAPED + "}")
    await diagnostic(events, "outcome_delivered")
    sent = coordinator.deliveries[0][1].message.envelope
    assert sent.summary == "Fixed a<b && c>d — naïve"
    assert sent.impact == "line one\nline two\u2028end"
    assert json.loads(sent.model_dump_json()) == json.loads(GO_ENVELOPE_ESCAPED)
    assert "workflow_id" not in sent.model_dump_json()  # omitted, as Go's omitempty does


async def test_ac_co_5_a_receipt_with_a_bead_uri_is_recorded(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events = rt.subscribe()
    await ok(rt, '{"type":"outcome_ready","envelope":' + GO_ENVELOPE + "}")
    await diagnostic(events, "outcome_delivered")
    got = await state(rt, OUTCOME_ID)
    assert (got["phase"], got["delivery_ref"], got["coordinator_fence"], got["last_delivery_error"]) == (
        "needs-coordinator-ack",
        "bead:hq-mail-42",
        "mayor-session-9",
        None,
    )


@pytest.mark.parametrize(
    "ref",
    [
        "bead:hq-mail-42",
        "mail-7",
        "https://mail.example/hq/42?read=1",
        "bead:" + "m" * 507,
    ],  # the last: 512 bytes
)
async def test_ac_co_5_any_uri_like_delivery_ref_up_to_512_bytes_is_accepted(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock, ref: str
) -> None:
    coordinator.receipt = {"delivery_ref": ref}
    events = rt.subscribe()
    env = envelope()
    await ready(rt, env)
    await diagnostic(events, "outcome_delivered")
    assert (await state(rt, env["outcome_id"]))["delivery_ref"] == ref


async def test_ac_co_9_ac_co_16_a_go_coordinators_ack_completes_and_is_committed_as_written(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events = rt.subscribe()
    await ok(rt, '{"type":"outcome_ready","envelope":' + GO_ENVELOPE + "}")
    await diagnostic(events, "outcome_delivered")
    queued = await ok(rt, '{"type":"coordinator_ack",' + GO_ACK[1:])
    assert queued.result["queued"] is True
    acknowledged = await diagnostic(events, "outcome_acknowledged")
    assert acknowledged.fields["acknowledged_by"] == "mayor"
    assert [request.acknowledgement.model_dump_json() for _, request in coordinator.acks] == [GO_ACK]
    got = await state(rt, OUTCOME_ID)
    assert (got["phase"], got["acknowledged_by"], got["stale_acknowledgements"]) == (
        "acknowledged",
        "mayor",
        0,
    )


async def test_ac_co_16_after_completion_the_same_acknowledger_is_a_no_op_and_another_is_a_conflict(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    events = rt.subscribe()
    env = envelope()
    await ready(rt, env)
    await diagnostic(events, "outcome_delivered")
    await ok(rt, ack(env, "mayor-session-9", acknowledged_by="mayor"))
    await diagnostic(events, "outcome_acknowledged")
    done = await state(rt, env["outcome_id"])
    assert (done["phase"], done["acknowledged_by"]) == ("acknowledged", "mayor")
    for repeat in (ack(env, "mayor-session-9"), ack(env, "an-older-session")):  # by mayor: no-ops
        again = await ok(rt, repeat)
        assert again.result == {
            "outcome_id": env["outcome_id"],
            "queued": False,
            "phase": "acknowledged",
            "acknowledged_by": "mayor",
        }
    other = await send(rt, ack(env, "mayor-session-9", acknowledged_by="deacon"))
    assert other.error is not None
    assert (other.error.code, other.error.field) == ("conflict", "acknowledged_by")
    assert "mayor" in other.error.message
    assert await state(rt, env["outcome_id"]) == done  # neither changed anything
    assert len(coordinator.acks) == 1


async def test_ac_co_16_the_first_matching_ack_names_the_acknowledger(
    rt: Runtime, coordinator: RecordingCoordinator, autojump_clock: MockClock
) -> None:
    """Two acknowledgers answer the same delivery; the first to arrive is the one committed and recorded."""
    env = envelope()
    replies: list[Any] = []

    async def both_answer(_: object) -> None:
        # Shielded: the autojump clock may pass the attempt's deadline while the acks wait on the store's
        # thread, and a send in a cancelled scope raises Cancelled (the acks themselves would still commit).
        with trio.CancelScope(shield=True):
            for by in ("deacon", "mayor"):
                replies.append(await ok(rt, ack(env, "mayor-session-9", acknowledged_by=by)))

    coordinator.during_delivery = both_answer
    events = rt.subscribe()
    await ready(rt, env)
    await diagnostic(events, "outcome_acknowledged")
    assert [r.result["queued"] for r in replies] == [True, True]
    assert [request.acknowledgement.acknowledged_by for _, request in coordinator.acks] == ["deacon"]
    got = await state(rt, env["outcome_id"])
    assert (got["acknowledged_by"], got["stale_acknowledgements"]) == ("deacon", 0)
    late = await send(rt, ack(env, "mayor-session-9", acknowledged_by="mayor"))
    assert late.error is not None and late.error.code == "conflict"


def test_the_outcome_types_a_host_needs_are_exported_from_onceflow() -> None:
    for name in (
        "OutcomeEnvelope",
        "OutcomeDeliveryRequest",
        "OutcomeDelivery",
        "OutcomeAcknowledgement",
        "ProducerFence",
        "Evidence",
        "derive_outcome_id",
        "DeliveryRequest",
        "AcknowledgeRequest",
        "RetryPolicy",
        "Coordinator",
    ):
        assert name in onceflow.__all__ and getattr(onceflow, name) is not None
