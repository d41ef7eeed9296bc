"""The outcome envelope over the protocol: field-by-field validation (AC-CO-1) and the derived id (AC-CO-2).

The rules are Gas City's (gascity-wire-format.md); Go-emitted JSON and independent id vectors are in
test_outcome_wire_format.py. Ids AC-CO-n are listed in onceflow.actors.runtime.outcome
(coordinator-outcome-delivery.md has none of its own).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from helpers import send
from outcome_support import SHA, ack, envelope, ready, state

from onceflow.actors.runtime.supervisor import Runtime

EVIDENCE = {"kind": "commit", "uri": "git:repo@abc123", "sha256": SHA}

# (dotted path inside the envelope, bad value); the reply must name exactly `envelope.<path>`.
INVALID: list[tuple[str, Any]] = [
    ("contract_version", 2),
    ("contract_version", 1.0),  # Go decodes an int field from an integer literal only
    ("contract_version", True),
    ("producer", "robot"),
    ("store_ref", "town:gascity"),
    ("store_ref", "city:"),
    ("work_id", " gc-1234"),
    ("work_id", ""),
    ("work_id", "g" * 129),
    ("work_id", "gc-1234\n"),
    ("source_root_id", "gc/1000"),
    ("step_key", "-implement"),
    ("workflow_id", " padded"),
    ("workflow_id", "tab\there"),
    ("workflow_id", "line\nbreak"),
    ("workflow_id", "w" * 256),
    ("workflow_run_id", "run-1"),  # a workflow run id needs a workflow id
    ("summary", ""),
    ("summary", " padded"),
    ("summary", "padded\u00a0"),  # a no-break space is whitespace to Go's TrimSpace
    ("summary", "nul\x00byte"),
    ("summary", "carriage\rreturn"),
    ("summary", "é" * 257),  # 257 characters, 514 bytes
    ("impact", "x" * 1025),
    ("impact", "nul\x00byte"),
    ("state", "done"),
    ("evidence", []),
    ("evidence", [EVIDENCE] * 65),
    ("evidence.0.kind", "photo"),
    ("evidence.0.uri", "ftp://host/x"),
    ("evidence.0.uri", "https:"),
    ("evidence.0.uri", "file:/a b"),
    ("evidence.0.uri", "git:repo\u2003@abc"),  # an em space
    ("evidence.0.uri", "s3://bucket/" + "k" * 501),  # 513 bytes
    ("evidence.0.sha256", SHA.upper()),
    ("fence.producer_id", ""),
    ("fence.generation", 0),
    ("fence.generation", "3"),
    ("fence.generation", 3.0),
    ("fence.generation", 2**63),  # past Go's int
    ("fence.token", "tok 9"),
    ("occurred_at", 1_700_000_000),  # Unix seconds are not the wire format
    ("occurred_at", ""),
    ("occurred_at", "2023-11-14T22:13:20+00:00"),  # UTC is written Z
    ("occurred_at", "2023-11-14T23:13:20+01:00"),
    ("occurred_at", "2023-11-14T22:13:20z"),
    ("occurred_at", "2023-11-14 22:13:20Z"),
    ("occurred_at", "2023-11-14T22:13Z"),
    ("occurred_at", "2023-02-30T00:00:00Z"),
    ("occurred_at", "2023-11-14T24:00:00Z"),
    ("occurred_at", "2023-11-14T22:13:20.1234567890Z"),  # finer than nanoseconds
    ("occurred_at", "0001-01-01T00:00:00Z"),  # Go's zero time
    ("occurred_at", "0001-01-01T00:00:00.000Z"),
    ("outcome_id", "outcome-" + "0" * 32),  # well-formed, but not this content's id
    ("outcome_id", "gc-1234"),
    ("colour", "red"),  # unknown field
    ("run_id", "run-1"),  # the names onceflow used before it spoke Gas City's format
    ("producer_fence", {"producer_id": "worker-7", "generation": 3, "token": "tok-9"}),
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
        workflow_id="Formula 42 / " + "w" * 242,  # 255 bytes; inner spaces are allowed
        workflow_run_id="5f1c0d9e-0000-4000-8000-000000000001",
        occurred_at="0001-01-01T00:00:00.000000001Z",  # one nanosecond after Go's zero time
        summary="é" * 256,  # exactly 512 bytes
        impact="line one\nline two " + "x" * 1006,  # 1024 bytes, a newline is allowed
        evidence=[{**EVIDENCE, "uri": "s3://bucket/" + "k" * 500}] * 64,  # a 512-byte URI, 64 items
        state="verified",
        producer="temporal",
        store_ref="rig:gc-rig.1",
    )
    assert len(env["impact"].encode()) == 1024 and len(env["workflow_id"].encode()) == 255
    assert (await ready(runtime, env))["received"] == "started"
    assert (await state(runtime, env["outcome_id"]))["envelope"] == env


@pytest.mark.parametrize("empty", ["", None], ids=["empty", "null"])
async def test_ac_co_1_an_empty_workflow_id_is_absent_and_omitted(
    runtime: Runtime, empty: str | None
) -> None:
    """Go decodes "" and null to the empty string, which Gas City treats, and emits (omitempty), as absent."""
    env = envelope(workflow_id=empty, workflow_run_id=empty)
    assert (await ready(runtime, env))["received"] == "started"
    stored = (await state(runtime, env["outcome_id"]))["envelope"]
    assert stored == {k: v for k, v in env.items() if k not in ("workflow_id", "workflow_run_id")}


async def test_ac_co_1_a_workflow_run_id_without_a_workflow_id_is_rejected_even_when_the_id_is_empty(
    runtime: Runtime,
) -> None:
    reply = await send(
        runtime, {"type": "outcome_ready", "envelope": envelope(workflow_id="", workflow_run_id="r-1")}
    )
    assert reply.error is not None and reply.error.field == "envelope.workflow_run_id"


def test_ac_co_2_the_outcome_id_is_a_sha256_over_the_canonical_json() -> None:
    canonical = (
        '{"contract_version":1,"producer":"direct-worker","store_ref":"city:gascity","work_id":"gc-1234",'
        '"state":"terminal","fence":{"producer_id":"worker-7","generation":3,"token":"tok-9"}}'
    )
    expected = "outcome-" + hashlib.sha256(canonical.encode()).digest()[:16].hex()
    assert envelope()["outcome_id"] == expected == "outcome-552c9ef8c5842766879eb75ef3ffa3b2"


@pytest.mark.parametrize(
    ("field", "value", "changes_id"),
    [
        ("state", "verified", True),
        ("work_id", "gc-9", True),
        ("store_ref", "rig:gascity", True),
        ("producer", "formula-step", True),
        ("fence", {"producer_id": "worker-7", "generation": 4, "token": "tok-9"}, True),
        ("fence", {"producer_id": "worker-8", "generation": 3, "token": "tok-9"}, True),
        ("fence", {"producer_id": "worker-7", "generation": 3, "token": "tok-10"}, True),
        ("summary", "Another summary.", False),
        ("evidence", [{**EVIDENCE, "kind": "patch"}], False),
        ("occurred_at", "2027-01-15T08:00:00Z", False),
        ("step_key", "review", False),
        ("source_root_id", "gc-2000", False),
        ("workflow_id", "formula-42", False),
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
        (ack(envelope(), "coord-1", outcome_id="outcome/XYZ"), "outcome_id"),
        (ack(envelope(), "coord-1", work_id="gc 1234"), "work_id"),
        (ack(envelope(), "coord-1", acknowledged_by="the mayor"), "acknowledged_by"),
        ({k: v for k, v in ack(envelope(), "coord-1").items() if k != "acknowledged_by"}, "acknowledged_by"),
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
