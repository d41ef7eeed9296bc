"""The outcome envelope over the protocol: field-by-field validation (AC-CO-1) and the derived id (AC-CO-2).

Ids AC-CO-n are listed in onceflow.actors.outcome (coordinator-outcome-delivery.md has none of its own).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from helpers import send
from outcome_support import SHA, ack, envelope, ready, state

from onceflow.actors.supervisor import Runtime

EVIDENCE = {"kind": "commit", "uri": "git:repo@abc123", "sha256": SHA}

# (dotted path inside the envelope, bad value); the reply must name exactly `envelope.<path>`.
INVALID: list[tuple[str, Any]] = [
    ("contract_version", 2),
    ("producer", "robot"),
    ("store_ref", "town:gascity"),
    ("store_ref", "city:"),
    ("work_id", " gc-1234"),
    ("work_id", ""),
    ("work_id", "g" * 129),
    ("source_root_id", "gc/1000"),
    ("step_key", "-implement"),
    ("workflow_id", "has space"),
    ("run_id", "run-1"),  # a run id needs a workflow id
    ("summary", ""),
    ("summary", " padded"),
    ("summary", "nul\x00byte"),
    ("summary", "carriage\rreturn"),
    ("summary", "é" * 257),  # 257 characters, 514 bytes
    ("impact", "x" * 1025),
    ("state", "done"),
    ("evidence", []),
    ("evidence", [EVIDENCE] * 65),
    ("evidence.0.kind", "photo"),
    ("evidence.0.uri", "ftp://host/x"),
    ("evidence.0.uri", "https:"),
    ("evidence.0.uri", "file:/a b"),
    ("evidence.0.uri", "s3://bucket/" + "k" * 501),  # 513 bytes
    ("evidence.0.sha256", SHA.upper()),
    ("producer_fence.producer_id", ""),
    ("producer_fence.generation", 0),
    ("producer_fence.generation", "3"),
    ("producer_fence.token", "tok 9"),
    ("occurred_at", 0),
    ("outcome_id", "outcome-" + "0" * 32),  # well-formed, but not this content's id
    ("outcome_id", "gc-1234"),
    ("colour", "red"),  # unknown field
]


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    target: Any = data
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    target[last] = value


@pytest.mark.parametrize(("path", "value"), INVALID, ids=[f"{p}={v!r}"[:40] for p, v in INVALID])
async def test_ac_co_1_an_invalid_envelope_is_rejected_naming_the_field(
    runtime: Runtime, path: str, value: Any
) -> None:
    env = envelope()
    _set(env, path, value)
    reply = await send(runtime, {"type": "outcome_ready", "envelope": env})
    assert not reply.ok and reply.error is not None
    assert (reply.error.code, reply.error.field) == ("invalid_message", f"envelope.{path}")
    missing = await send(runtime, {"type": "get_outcome", "outcome_id": envelope()["outcome_id"]})
    assert missing.error is not None and missing.error.code == "not_found"  # nothing was stored


async def test_ac_co_1_a_missing_field_is_named(runtime: Runtime) -> None:
    env = envelope()
    del env["step_key"]
    reply = await send(runtime, {"type": "outcome_ready", "envelope": env})
    assert reply.error is not None and reply.error.field == "envelope.step_key"


async def test_ac_co_1_limits_are_inclusive(runtime: Runtime) -> None:
    env = envelope(
        workflow_id="coordinator-outcome/formula:42",
        run_id="5f1c0d9e-0000-4000-8000-000000000001",
        summary="é" * 256,  # exactly 512 bytes
        impact="line one\nline two " + "x" * 1006,  # 1024 bytes, a newline is allowed
        evidence=[{**EVIDENCE, "uri": "s3://bucket/" + "k" * 500}] * 64,  # a 512-byte URI, 64 items
        state="verified",
        producer="temporal",
        store_ref="rig:gc-rig.1",
    )
    assert len(env["impact"].encode()) == 1024
    assert (await ready(runtime, env))["received"] == "started"
    assert (await state(runtime, env["outcome_id"]))["envelope"] == env


def test_ac_co_2_the_outcome_id_is_a_sha256_over_the_canonical_json() -> None:
    canonical = (
        '{"fence":{"generation":3,"producer_id":"worker-7","token":"tok-9"},"producer":"direct-worker",'
        '"state":"terminal","store_ref":"city:gascity","version":1,"work_id":"gc-1234"}'
    )
    expected = "outcome-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]
    assert envelope()["outcome_id"] == expected == "outcome-a065a485a257160220ddb30ea32bbd96"


@pytest.mark.parametrize(
    ("field", "value", "changes_id"),
    [
        ("state", "verified", True),
        ("work_id", "gc-9", True),
        ("store_ref", "rig:gascity", True),
        ("producer", "formula-step", True),
        ("producer_fence", {"producer_id": "worker-7", "generation": 4, "token": "tok-9"}, True),
        ("summary", "Another summary.", False),
        ("evidence", [{**EVIDENCE, "kind": "patch"}], False),
        ("occurred_at", 1_800_000_000.0, False),
        ("step_key", "review", False),
    ],
)
def test_ac_co_2_only_identity_fields_change_the_outcome_id(field: str, value: Any, changes_id: bool) -> None:
    base = envelope()
    changed = envelope(**{field: value})
    assert (changed["outcome_id"] != base["outcome_id"]) is changes_id


async def test_ac_co_2_an_id_from_other_content_is_rejected(runtime: Runtime) -> None:
    other = envelope(state="verified")
    env = envelope(outcome_id=other["outcome_id"])
    reply = await send(runtime, {"type": "outcome_ready", "envelope": env})
    assert reply.error is not None and reply.error.field == "envelope.outcome_id"
    assert "does not match" in reply.error.message


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (ack(envelope(), "bad fence"), "coordinator_fence"),
        (ack(envelope(), "coord-1", store_ref="gascity"), "store_ref"),
        (ack(envelope(), "coord-1", outcome_id="outcome-XYZ"), "outcome_id"),
        ({"type": "get_outcome", "outcome_id": "gc-1234"}, "outcome_id"),
    ],
)
async def test_ac_co_1_malformed_acks_and_queries_are_rejected_naming_the_field(
    runtime: Runtime, message: dict[str, Any], field: str
) -> None:
    reply = await send(runtime, message)
    assert reply.error is not None and (reply.error.code, reply.error.field) == ("invalid_message", field)


async def test_ac_co_3_unknown_outcomes_are_not_found(runtime: Runtime) -> None:
    env = envelope()
    for message in (ack(env, "coord-1"), {"type": "get_outcome", "outcome_id": env["outcome_id"]}):
        error = (await send(runtime, message)).error
        assert error is not None and (error.code, error.field) == ("not_found", "outcome_id")
